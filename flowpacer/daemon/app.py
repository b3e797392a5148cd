"""The composition root: builds the stages and wires them. Nothing here decides policy.

    tracer stage ──events──┐  (tracerstage.py)
    first-byte stage ──────┤ (claims; firstbytestage.py)
    main stage: sock_diag ─┴─> Reconciler (FlowTable -> engine -> backend) ─> kernel
     (mainloop.py: signals, reconcile pass, watchdog)      ^
    control stage ─── status / reload ─────────────────────┤ InterfaceSet: a BackendSupervisor
                                                           │  per interface (health, rebuild,
    metrics stage ─── scrape ──────────────────────────────┘  fall-back, switch)

Each long-running loop is a supervised ``Stage`` (``stages.py``): a failure is logged with its
traceback once, counted and restarted with back-off; a tracer that keeps failing degrades to
sock_diag polling (said in the log, in status and in metrics), a main loop or control socket
that keeps failing stops the daemon with exit status 1 so that systemd restarts it (and the
new process adopts the live flows). systemd's watchdog is fed only while no stage is hung.

Everything with a side effect is injected (backend factory, flow sources, clock, notify), so
the daemon's supervision is tested in-process with fakes (``harness/fakes.py``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from flowpacer.policy import rules as rules_loader
from flowpacer.surfaces import view as views
from flowpacer.surfaces import explain
from flowpacer.surfaces.control import DEFAULT_SOCKET, ControlServer, command_handler
from flowpacer.errors import FlowpacerError
from flowpacer.daemon.mainloop import MainLoop, sd_notify
from flowpacer.daemon.memory import tune_gc
from flowpacer.surfaces.metrics import (DEFAULT_ADDRESSES, DEFAULT_LISTEN,
                                        DEFAULT_MAX_FLOW_SERIES, FlowpacerCollector,
                                        MetricsServer)
from flowpacer.model import (BackendKind, DaemonView, FlowSourceStatus,
                             ReloadResult, RuleSet, TracerStats)
from flowpacer.daemon.firstbytestage import FirstByteStage, real_firstbyte
from flowpacer.daemon.reconciler import Reconciler
from flowpacer.daemon.tracerstage import TracerStage, real_tracer
from flowpacer.daemon.stages import GiveUp, Stage, StageContext
from flowpacer.daemon.interfaces import InterfaceSet
from flowpacer.daemon.supervisor import TcBackendFactory

log = logging.getLogger(__name__)


@dataclass
class Options:
    rules_path: str
    interface: Optional[str] = None        # overrides the rules file
    backend: Optional[BackendKind] = None  # overrides the rules file
    socket_path: str = DEFAULT_SOCKET
    take_over: bool = False
    rescan_s: float = 1.0
    tracer: bool = True
    metrics_listen: Optional[str] = DEFAULT_LISTEN   # None: no metrics endpoint
    max_flow_series: int = DEFAULT_MAX_FLOW_SERIES
    metrics_addresses: str = DEFAULT_ADDRESSES   # full | prefix | none (metrics.AddressLabels)
    web_config_file: Optional[str] = None  # TLS / basic auth of the metrics endpoint
    first_byte: bool = True                # issue 16 (off: benchmarks' "before" figures)
    strict_units: bool = False             # tc's byte units refused, not warned about
    # issue 28: on exit leave the qdisc, classes and filters for the next process to adopt (the
    # unit's ExecStopPost= removes them when the stop is not a restart)
    keep_on_exit: bool = False


def _read_stats(stage_obj, method: str, typed: Callable = lambda x: x):
    """``typed(stage_obj.method())`` for a view (None when the stage is off or the read failed:
    a view never fails because of one stage's counters)."""
    if stage_obj is None:
        return None
    try:
        return typed(getattr(stage_obj, method)())
    except Exception as e:
        log.debug("%s %s: %s", type(stage_obj).__name__, method, e)
        return None


def real_link_watch():
    from flowpacer.kernel.linkwatch import LinkWatch
    return LinkWatch()


class Daemon:
    def __init__(self, opts: Options, *, backend_factory=None, sockdiag=None,
                 tracer_factory: Optional[Callable[[], object]] = None,
                 load: Optional[Callable[[str], RuleSet]] = None,
                 notify: Callable[[str], None] = sd_notify,
                 clock: Callable[[], float] = time.monotonic,
                 stage_backoff_s=(0.2, 10.0),
                 firstbyte_factory: Optional[Callable[[], object]] = None,
                 router=None, link_watch: Optional[Callable[[], object]] = None):
        self.opts = opts
        self._load = load or (lambda path: rules_loader.load_checked(path, opts.strict_units))
        self.notify = notify
        self.clock = clock
        self._backoff = stage_backoff_s
        # RTNL link events (issue 29: a bond's members): the kernel's with the real backends,
        # none with injected fakes unless a test gives its own
        self._make_link_watch = link_watch if link_watch is not None else (
            real_link_watch if backend_factory is None else None)
        # issue 29: a backend per interface the rules name (one without ``interfaces:``);
        # ``router``: route lookups and the device list (None: the kernel's, when needed)
        self.supervisor = InterfaceSet(backend_factory or TcBackendFactory(opts.take_over),
                                       interface=opts.interface, kind=opts.backend,
                                       clock=clock, router=router)
        if sockdiag is None:
            from flowpacer.sources.sockdiag import SockDiagSource
            sockdiag = SockDiagSource()
        self.sockdiag = sockdiag
        self.tracer_stage = TracerStage(tracer_factory or real_tracer, self._stage,
                                        enabled=opts.tracer, rescan_s=opts.rescan_s)
        # first-byte shaping (issue 16) with the real tracer only: fakes have no kernel
        self.firstbyte_stage = FirstByteStage(
            firstbyte_factory or (None if tracer_factory else real_firstbyte), self._stage,
            tracer=opts.tracer, enabled=opts.first_byte)
        self.reconciler: Optional[Reconciler] = None
        self.exit_code = 0
        self._stop = threading.Event()
        self.loop: Optional[MainLoop] = None
        self._control: Optional[ControlServer] = None
        self._handle = command_handler({"status": lambda req: self.status(
                                            req.get("all") is True, req.get("spares") is True),
                                        "explain": self.explain,
                                        "reload": lambda req: views.reload_json(self.reload()),
                                        "ping": lambda req: {"ok": True}})
        self._metrics: Optional[MetricsServer] = None
        self._metrics_channels = None
        self.stages: List[Stage] = []
        self.main_stage: Optional[Stage] = None

    @property
    def lock(self):
        return self.reconciler.lock

    # ---------------------------------------------------------------- set-up
    def start(self) -> None:
        """Load rules, set up the backend, the flow sources and the stages. Raises
        FlowpacerError."""
        rs = self._load(self.opts.rules_path)
        self.supervisor.start(rs)
        self.reconciler = Reconciler(self.supervisor, rs)
        self.reconciler.adopt()
        self.loop = MainLoop(self.reconciler, self.sockdiag, rescan_s=self.opts.rescan_s,
                             reload=self.reload, stages=lambda: self.stages, stop=self._stop,
                             notify=self.notify, clock=self.clock, links=self._link_watch(),
                             watched=self.supervisor.watched_links)
        # adopt/clean up at once: classes of flows that ended while no daemon ran go now, live
        # flows keep (or get) their class before the tracer's slow compile
        self.loop.rescan()
        self.main_stage = self._stage("main", self.loop.run, GiveUp.EXIT, stall_s=30.0)
        self.stages = [self.main_stage, self.tracer_stage.stage(self.reconciler),
                       self.firstbyte_stage.stage(self.reconciler)]
        self._control = ControlServer(self.opts.socket_path, self._handle)
        self.stages.append(self._stage("control", self._serve_control, GiveUp.EXIT))
        if self.opts.metrics_listen:
            try:
                from flowpacer.surfaces.webconfig import load as load_web_config
                web = load_web_config(self.opts.web_config_file) \
                    if self.opts.web_config_file else None
                self._metrics = MetricsServer(self.opts.metrics_listen, FlowpacerCollector(
                    self.view, self._class_stats, self.opts.max_flow_series,
                    self.opts.metrics_addresses), web_config=web)
            except (OSError, ValueError) as e:
                raise FlowpacerError(f"metrics endpoint {self.opts.metrics_listen}: {e}") from None
            self.stages.append(self._stage("metrics", self._serve_metrics, GiveUp.DEGRADE))
        else:
            self.stages.append(Stage.disabled("metrics", "--no-metrics"))
        self.loop.rescan()
        self.loop.catch_signals()
        # the main loop's work runs in this thread from here on (its passes above, ``run``
        # right after): it is running before the control socket can answer a status
        self.main_stage.begin()
        for s in self.stages:
            if s is not self.main_stage:
                s.start()
        tune_gc()
        self.notify("READY=1\nSTATUS=shaping flows on " + ", ".join(
            b.interface for b in self._send_backends()))
        log.info("ready: %d flows shaped, flow source: %s",
                 sum(len(b.installed()) for b in self._send_backends()),
                 self.tracer_stage.flow_source.text)

    def _link_watch(self):
        """The main loop's link events, or None (then link rates follow at every pass)."""
        if self._make_link_watch is None:
            return None
        try:
            return self._make_link_watch()
        except OSError as e:
            log.warning("cannot listen to link events (%s): link rates are checked at every "
                        "reconcile pass only", e)
            return None

    def _send_backends(self) -> list:
        return [p.backend for p in self.supervisor.ports() if p.backend is not None]

    def _stage(self, name, run, give_up: GiveUp, stall_s: float = 30.0,
               on_degrade: Optional[Callable[[Stage, str], None]] = None) -> Stage:
        """``on_degrade``: what the daemon does without this stage once it is given up (a
        ``GiveUp.DEGRADE`` stage; None: nothing more than saying so)."""
        return Stage(name, run, on_give_up=give_up, on_degrade=on_degrade,
                     on_fatal=self._fatal, backoff_s=self._backoff, stall_s=stall_s,
                     clock=self.clock, stop_event=self._stop)

    # --------------------------------------------------------------- stages
    def _serve_control(self, ctx: StageContext) -> None:
        self._control.run(ctx)

    def _serve_metrics(self, ctx: StageContext) -> None:
        self._metrics.run(ctx)

    def _fatal(self, stage: Stage, why: str) -> None:
        self.exit_code = 1
        self._stop.set()
        self.loop.wake()

    def run(self) -> None:
        """The main loop, in the calling (main) thread, until a signal or a fatal stage."""
        self.main_stage.run_here()

    def reload(self) -> ReloadResult:
        self.notify("RELOADING=1")
        try:
            out = self.reconciler.reload(lambda: self._load(self.opts.rules_path),
                                         self.tracer_stage.rules_changed)
        finally:
            self.notify("READY=1")
        if out.ok:
            log.info("reloaded %s: rules changed %s, switched backend %s, added %d, changed %d, "
                     "removed %d", self.opts.rules_path, out.rules_changed, out.switched_backend,
                     out.added, out.changed, out.removed)
        return out

    # ---------------------------------------------------------------- views
    def view(self) -> DaemonView:
        """A consistent copy of the daemon's state (taken under the reconciler's lock)."""
        tracer_stats = _read_stats(self.tracer_stage.tracer, "stats", TracerStats.from_stats)
        fb = self.firstbyte_stage.firstbyte
        first_byte = _read_stats(fb, "view")
        source = self.tracer_stage.flow_source
        if fb is not None:    # status names the rules shaped from byte one (reloads change them)
            source = FlowSourceStatus(source.mode, source.detail, fb.summary)
        with self.lock:
            return views.build(self.reconciler, self.supervisor, self.stages,
                               rules_path=os.path.abspath(self.opts.rules_path),
                               flow_source=source, tracer_stats=tracer_stats,
                               first_byte=first_byte)

    def status(self, all_flows: bool = False, spares: bool = False) -> dict:
        """The control socket's status answer. The view is copied under the lock; the kernel's
        class counters are read after it is released, so that a status poll (``top`` asks every
        second) never holds up the tracer's events. ``all_flows``: also every live flow without
        a send class, with the reason (``status --all``); ``spares``: also each interface's
        spare classes by name (``spare_classids``, up to 16 384 each; a check of the kernel that
        tells a spare from a leaked class asks for them)."""
        unshaped = (explain.unshaped(self.lock, self.reconciler, self.supervisor)
                    if all_flows else None)
        spare_ids = None
        if spares:
            with self.lock:
                spare_ids = {b.interface: list(b.spare_handles()) for b in self._send_backends()}
        v = self.view()
        channels = self.supervisor.open_stats_channel()
        try:
            stats = self.supervisor.class_stats(channels)
        except (OSError, FlowpacerError) as e:
            log.debug("status: class statistics: %s", e)
            stats = {}
        finally:
            channels.close()
        return views.status_json(v, stats, unshaped=unshaped, spare_classids=spare_ids)

    def explain(self, req: dict) -> dict:
        """The control socket's explain answer (``surfaces/explain.py``)."""
        return explain.live(req, self.lock, self.reconciler, self.supervisor, self.status)

    def _class_stats(self) -> dict:
        """Read by the metrics stage over its own channels, without the loop's lock."""
        if self._metrics_channels is None:
            self._metrics_channels = self.supervisor.open_stats_channel()
        return self.supervisor.class_stats(self._metrics_channels)

    # -------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        self.notify("STOPPING=1")
        self._stop.set()
        for s in self.stages:
            if s is not self.main_stage:
                s.stop(timeout=2)
        self.tracer_stage.close()
        self.firstbyte_stage.close()
        sends = self._send_backends()
        keep = self.opts.keep_on_exit and bool(sends)
        if keep:
            log.info("exiting with %d flow classes left on %s for the next start to adopt "
                     "(flowpacer cleanup removes them)",
                     sum(len(b.installed()) for b in sends), ", ".join(b.interface for b in sends))
        self.supervisor.shutdown(keep=keep)
        if self._control is not None:
            self._control.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._metrics_channels is not None:
            self._metrics_channels.close()
        if self.loop is not None:
            self.loop.close()
