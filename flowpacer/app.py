"""The composition root: builds the stages, wires them, and runs the daemon's loop.

    tracer thread ──events──┐
    sock_diag (every N s) ──┴─> FlowTable ─dirty keys─> engine.plan ─> backend.apply ─> kernel
    control socket, signals ──> reload / status / stop

The tracer's thread applies its events itself and the main loop runs the reconcile pass,
control requests and signals; both hold ``Daemon.lock`` while they touch the flow table or the
backend, and the sock_diag dump runs outside it.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from . import engine, rules as rules_loader
from .backend import choose, fallback, psp_available
from .backend.tc import TcBackend
from .control import DEFAULT_SOCKET, ControlServer
from .errors import BackendError, FlowpacerError, RulesError, TracerUnavailable
from .flows import FlowTable
from .memory import release_compiler_memory, trim_heap
from .metrics import (DEFAULT_LISTEN, DEFAULT_MAX_FLOW_SERIES, FlowpacerCollector,
                      LatencyHistogram, MetricsServer)
from .tc.nl import RtnlSocket
from .model import BackendKind, FlowKey, FlowSource, OpKind, RuleSet
from .sockdiag import SockDiagSource

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


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.debug("sd_notify: %s", e)


AUDIT_S = 5.0          # how often the flow classes are checked against the kernel
REBUILD_LOG_S = 60.0   # a backend that cannot be rebuilt: its warning is repeated this often
TRIM_S = 10.0          # how often freed heap is handed back (a few ms each time)


def check_rules_access(path: str) -> None:
    """Refuse a rules file that someone other than root could have written (as sudo does with
    sudoers): it decides how every flow on the server is paced."""
    import stat as st
    try:
        info = os.stat(path)
    except OSError as e:
        raise FlowpacerError(f"{path}: cannot read: {e.strerror}") from None
    if not st.S_ISREG(info.st_mode):
        raise FlowpacerError(f"{path}: not a regular file")
    if info.st_uid != 0:
        raise FlowpacerError(f"{path}: owned by uid {info.st_uid}, not root: refusing it "
                             "(chown root)")
    if info.st_mode & (st.S_IWGRP | st.S_IWOTH):
        raise FlowpacerError(f"{path}: writable by group or others (mode "
                             f"{st.S_IMODE(info.st_mode):04o}): refusing it (chmod go-w)")


def load_rules(path: str) -> RuleSet:
    check_rules_access(path)
    return rules_loader.load(path)


@dataclass
class Counters:
    applies: int = 0
    op_errors: int = 0
    reloads_ok: int = 0
    reloads_failed: int = 0
    rebuild_failures: int = 0      # attempts to rebuild a lost root qdisc that failed
    apply_latency_ns: deque = field(default_factory=lambda: deque(maxlen=4096))
    apply_hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    shape_latency_ns: deque = field(default_factory=lambda: deque(maxlen=4096))


class Daemon:
    def __init__(self, opts: Options):
        self.opts = opts
        self.rules: Optional[RuleSet] = None
        self.backend: Optional[TcBackend] = None
        self.backend_reason = ""
        self.table = FlowTable()
        self.sockdiag = SockDiagSource()
        self.tracer = None
        self.tracer_status = "not started"
        self.counters = Counters()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._signals: deque = deque()
        self._control: Optional[ControlServer] = None
        self._metrics: Optional[MetricsServer] = None
        self._metrics_rtnl: Optional[RtnlSocket] = None
        # held by the loop while it changes flows or kernel state; scrapes take it to copy a view
        self.lock = threading.RLock()
        self._tracer_thread: Optional[threading.Thread] = None
        self._next_scan = 0.0
        self._next_audit = 0.0
        self._next_trim = 0.0
        self._retry: set = set()      # keys whose last operation failed
        self.backend_state = "ok"     # ok | gone | lost | foreign | speed (see TcBackend.check)
        self.backend_problem = ""     # why the backend cannot be rebuilt (empty when it can)
        self._problem_logged_at = 0.0
        self._episode_failures = 0    # failed rebuilds since the backend last worked
        self.fell_back = False        # auto: psp was lost and htb stands in until reload/restart

    # ---------------------------------------------------------------- set-up
    def _interface(self, rs: RuleSet) -> str:
        ifname = self.opts.interface or rs.interface
        if not ifname:
            raise BackendError("no interface: give it in the rules file or with --interface")
        return ifname

    def _make_backend(self, rs: RuleSet) -> TcBackend:
        kind = self.opts.backend or rs.backend
        codec, reason = choose(kind)
        b = TcBackend(codec, self._interface(rs), rs.link_rate_bps, self.opts.take_over)
        b.setup()
        self.backend_reason = reason
        self.fell_back = False
        self.backend_problem = ""
        log.info("backend %s on %s (%s)", codec.kind, b.interface, reason)
        return b

    def start(self) -> None:
        """Load rules, set up the backend and the flow sources. Raises FlowpacerError."""
        self.rules = load_rules(self.opts.rules_path)
        self.backend = self._make_backend(self.rules)
        self.table.dirty.update(self.backend.installed())   # adopted: kept only if still live
        # adopt/clean up at once: classes of flows that ended while no daemon ran go now, live
        # flows keep (or get) their class before the tracer's slow compile
        self._rescan()
        if self.opts.tracer:
            self._start_tracer()
        else:
            self.tracer_status = "disabled (--no-tracer)"
        self._control = ControlServer(self.opts.socket_path, self._handle)
        if self.opts.metrics_listen:
            try:
                self._metrics = MetricsServer(self.opts.metrics_listen, FlowpacerCollector(
                    self.metrics_view, self._class_stats, self.opts.max_flow_series))
            except (OSError, ValueError) as e:
                raise FlowpacerError(f"metrics endpoint {self.opts.metrics_listen}: {e}") from None
        self._rescan()
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        import gc
        gc.collect()
        gc.freeze()     # start-up objects (bcc, rules) stay out of later collections' work
        sd_notify("READY=1\nSTATUS=shaping flows on " + self.backend.interface)
        log.info("ready: %d flows shaped, flow source: %s", len(self.backend.installed()),
                 self.tracer_status)

    def _start_tracer(self) -> None:
        try:
            from .tracer import Tracer
        except ImportError as e:
            self.tracer_status = f"sock_diag polling only (tracer cannot load: {e})"
            log.warning("%s", self.tracer_status)
            return
        try:
            t = Tracer(ring_pages=256)
            t.set_watch(*engine.watch_filter(self.rules))   # applied before anything is reported
            t.start()
        except (TracerUnavailable, OSError) as e:
            self.tracer_status = f"sock_diag polling only (tracer unavailable: {e})"
            log.warning("%s", self.tracer_status)
            return
        self.tracer = t
        release_compiler_memory()
        self.tracer_status = f"tracer ({getattr(t, 'hooks', 'tracepoints')}) + sock_diag reconcile"
        self._tracer_thread = threading.Thread(target=self._tracer_loop, name="tracer", daemon=True)
        self._tracer_thread.start()

    def _tracer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.tracer.poll(100)
            except Exception as e:  # the tracer thread must never die silently
                log.error("tracer poll failed: %s; falling back to sock_diag polling", e)
                self.tracer_status = f"sock_diag polling only (tracer failed: {e})"
                return
            if events:
                # applied right here: a hand-over to the main thread cost ~0.4 ms per event
                with self.lock:
                    for ev in events:
                        self.table.on_event(ev)
                    self._apply(self.table.take_dirty())

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)

    # ---------------------------------------------------------------- loop
    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        sel.register(self._control.fileno(), selectors.EVENT_READ, "control")
        try:
            while not self._stop.is_set():
                timeout = max(0.0, self._next_scan - time.monotonic())
                for k, _ in sel.select(timeout):
                    if k.data == "wake":
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    else:
                        self._control.serve_one()    # handlers take the lock themselves
                with self.lock:
                    self._drain_signals()
                if time.monotonic() >= self._next_scan:
                    self._rescan()
        finally:
            sel.close()

    def _drain_signals(self) -> None:
        while self._signals:
            sig = self._signals.popleft()
            if sig == signal.SIGHUP:
                self.reload()
            else:
                log.info("signal %d: stopping", sig)
                self._stop.set()

    def _rescan(self) -> None:
        started = time.monotonic_ns()
        try:
            snap = self.sockdiag.snapshot()          # outside the lock: events keep flowing
        except Exception as e:  # never let a scan failure stop the daemon
            log.warning("sock_diag scan failed: %s", e)
            snap = None
        with self.lock:
            self._check_backend()
            if snap is not None:
                self.table.on_snapshot(snap, started)
            self.table.dirty.update(self._retry)
            self._retry.clear()
            self._apply(self.table.take_dirty())
        now = time.monotonic()
        if now >= self._next_trim:
            self._next_trim = now + TRIM_S
            trim_heap()
        self._next_scan = now + self.opts.rescan_s

    def _check_backend(self) -> None:
        """Notice an interface that went away or came back, a root qdisc someone deleted or
        replaced, a changed link speed; rebuild and re-apply where that is ours to do."""
        b = self.backend
        if b is None:
            return
        try:
            state = b.check()
        except (OSError, FlowpacerError) as e:
            log.warning("backend check failed: %s", e)
            return
        prev, self.backend_state = self.backend_state, state
        if state == "ok":
            if prev != "ok":
                log.info("%s: flowpacer's qdisc is in place again", b.interface)
            now = time.monotonic()
            if now >= self._next_audit:
                self._next_audit = now + AUDIT_S
                gone = b.audit()
                if gone:
                    self.counters.op_errors += len(gone)
                    log.warning("%s: %d flow classes were removed by someone else; adding them "
                                "again", b.interface, len(gone))
                    self.table.dirty.update(gone)
                    self._apply(self.table.take_dirty())
            return
        if state == "gone":
            if prev != "gone":
                log.warning("%s: interface is gone; flows stay known and are shaped again when it "
                            "returns", b.interface)
                b.forget()
            return
        if state == "foreign":
            if prev != "foreign":
                log.error("%s: someone replaced flowpacer's root qdisc; not fighting it: flows are "
                          "not shaped until it is removed (or flowpacer restarts with --take-over)",
                          b.interface)
                b.forget()
            return
        # lost (our qdisc vanished, the interface is back) or speed: rebuild and re-apply
        why = {"lost": "root qdisc missing (interface re-created or qdisc deleted)",
               "speed": "link speed changed"}[state]
        try:
            b.forget()
            b.setup()
        except (OSError, FlowpacerError) as e:
            self._rebuild_failed(b, why, e)
            return
        self.backend_state = "ok"
        if self.backend_problem:
            log.warning("%s: rebuilt after %d failed attempts", b.interface,
                        self._episode_failures)
            self.backend_problem = ""
        self._episode_failures = 0
        log.warning("%s: %s: rebuilt, re-applying %d flows", b.interface, why, len(self.table))
        self.table.mark_all(b.installed().keys())
        self._apply(self.table.take_dirty())

    def _rebuild_failed(self, b: TcBackend, why: str, err: Exception) -> None:
        """The lost qdisc cannot be made again (e.g. the psp module was unloaded): counted,
        logged once per reason and then once every REBUILD_LOG_S, retried at every pass; flows
        stay known (and unshaped) until it works. With ``backend: auto`` a psp that is gone
        is replaced by htb instead."""
        self.counters.rebuild_failures += 1
        self._episode_failures += 1
        reason = str(err)
        if self._fall_back(b, why, reason):
            return
        now = time.monotonic()
        if reason != self.backend_problem:
            log.warning("%s: %s; cannot rebuild: %s; flows stay known and unshaped, retrying at "
                        "every pass", b.interface, why, reason)
            self._problem_logged_at = now
        elif now - self._problem_logged_at >= REBUILD_LOG_S:
            log.warning("%s: still cannot rebuild (%d attempts failed): %s", b.interface,
                        self._episode_failures, reason)
            self._problem_logged_at = now
        else:
            log.debug("%s: rebuild failed again: %s", b.interface, reason)
        self.backend_problem = reason

    def _fall_back(self, b: TcBackend, why: str, reason: str) -> bool:
        """``backend: auto`` on psp whose module is gone: carry on with htb. True if done."""
        alt = fallback(self.opts.backend or self.rules.backend, b.name)
        if alt is None:
            return False
        codec, alt_reason = alt
        nb = TcBackend(codec, b.interface, self.rules.link_rate_bps, self.opts.take_over)
        try:
            nb.setup()
        except (OSError, FlowpacerError) as e:
            nb.close()
            if self.backend_problem != reason:
                log.warning("%s: cannot fall back to %s either: %s", b.interface, codec.kind, e)
            return False
        b.close()
        self.backend = nb
        self.backend_state = "ok"
        self.backend_problem = ""
        self._episode_failures = 0
        self.fell_back = True
        self.backend_reason = f"{alt_reason}; psp: {reason}"
        log.warning("%s: %s and psp cannot be rebuilt (%s): %s; re-applying %d flows",
                    nb.interface, why, reason, alt_reason, len(self.table))
        self.table.mark_all()
        self._apply(self.table.take_dirty())
        return True

    def _apply(self, keys: Iterable[FlowKey]):
        keys = list(keys)
        if not keys or self.backend is None:
            return None
        flows = self.table.flows
        want = engine.desired({k: flows[k] for k in keys if k in flows}, self.rules)
        have = {}
        for k in keys:
            s = self.backend.shape_of(k)
            if s is not None:
                have[k] = s
        ops = engine.plan(want, have)
        if not ops or self.backend_state in ("gone", "foreign", "lost"):
            return None
        t0 = time.monotonic_ns()
        try:
            res = self.backend.apply(ops)
        except (OSError, FlowpacerError) as e:
            # the transport failed (e.g. ENOBUFS): what went in is uncertain, so rebuild the
            # bookkeeping from the kernel and let the next pass re-plan every flow
            self.counters.op_errors += 1
            log.error("apply failed: %s; resynchronising with the kernel", e)
            try:
                self.backend.resync()
            except (OSError, FlowpacerError) as e2:
                log.error("resync failed: %s", e2)
            self.table.mark_all(self.backend.installed().keys())
            self._next_scan = 0.0
            return None
        t1 = time.monotonic_ns()
        self.counters.applies += 1
        self.counters.apply_latency_ns.append(t1 - t0)
        self.counters.apply_hist.observe((t1 - t0) / 1e9)
        for op in ops:
            f = flows.get(op.key)
            if op.kind is OpKind.ADD and f is not None and f.source is FlowSource.TRACER:
                self.counters.shape_latency_ns.append(t1 - f.seen_ns)
        for err in res.errors:
            self.counters.op_errors += 1
            self._retry.add(err.op.key)     # planned again at the next reconcile pass
            log.warning("%s", err.reason)
        if res.added or res.removed or res.changed:
            log.debug("applied: +%d ~%d -%d", res.added, res.changed, res.removed)
        return res

    # --------------------------------------------------------------- reload
    def reload(self) -> dict:
        with self.lock:
            return self._reload()

    def _reload(self) -> dict:
        sd_notify("RELOADING=1")
        try:
            try:
                new = load_rules(self.opts.rules_path)
            except RulesError as e:
                self.counters.reloads_failed += 1
                for p in e.problems:
                    log.error("reload refused: %s", p)
                return {"ok": False, "errors": [str(p) for p in e.problems]}
            except FlowpacerError as e:
                self.counters.reloads_failed += 1
                log.error("reload refused: %s", e)
                return {"ok": False, "errors": [str(e)]}
            old = self.rules
            switch = (self._interface(new) != self.backend.interface
                      or (self.opts.backend or new.backend) != (self.opts.backend or old.backend)
                      or new.link_rate_bps != old.link_rate_bps
                      # auto fell back to htb after psp was lost: back to psp when it can be had
                      or (self.fell_back and psp_available()[0]))
            if switch:
                try:
                    nb = self._switch_backend(new)
                except FlowpacerError as e:
                    self.counters.reloads_failed += 1
                    log.error("reload refused: %s", e)
                    return {"ok": False, "errors": [str(e)]}
            self.rules = new
            if self.tracer is not None:
                self.tracer.set_watch(*engine.watch_filter(new))
            self.table.mark_all(self.backend.installed().keys())
            res = self._apply(self.table.take_dirty())
            self.counters.reloads_ok += 1
            out = {"ok": True, "rules_changed": new != old, "switched_backend": switch,
                   "added": res.added if res else 0, "changed": res.changed if res else 0,
                   "removed": res.removed if res else 0,
                   "errors": [e.reason for e in res.errors] if res else []}
            log.info("reloaded %s: %s", self.opts.rules_path,
                     ", ".join(f"{k} {v}" for k, v in out.items() if k != "errors"))
            return out
        finally:
            sd_notify("READY=1")

    def _switch_backend(self, new: RuleSet) -> TcBackend:
        """Clean switch-over: the old backend's objects go, the new backend starts empty."""
        old = self.backend
        old.teardown()
        old.close()
        self.backend = None
        try:
            self.backend = self._make_backend(new)
        except FlowpacerError:
            # put the old configuration back so that flows stay shaped
            self.backend = self._make_backend(self.rules)
            self.table.mark_all()
            self._apply(self.table.take_dirty())
            raise
        return self.backend

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        """The control socket's status answer. The flows are copied under the lock; the kernel's
        class counters are read after it is released, so that a status poll (``top`` asks every
        second) never holds up the tracer's events."""
        with self.lock:
            b = self.backend
            rows = []
            for key, classid, shape in (b.flows_snapshot() if b else ()):
                f = self.table.flows.get(key)
                rows.append((classid, {
                    "rule": shape.rule,
                    "pid": f.proc.pid if f else 0,
                    "process": f.proc.comm if f else "",
                    "uid": f.proc.uid if f else -1,
                    "direction": f.direction.value if f else "",
                    "source": f.source.value if f else "",
                    "local": _ep(key.local_addr, key.local_port),
                    "remote": _ep(key.remote_addr, key.remote_port),
                    "classid": _classid(classid),
                    "rate_bit": shape.rate_bps * 8,
                    "ceil_bit": shape.ceil_bps * 8,
                }))
            head = {
                "backend": b.name if b else None,
                "backend_reason": self.backend_reason,
                "interface": b.interface if b else None,
                "backend_state": self.backend_state,
                "backend_problem": self.backend_problem,
                "link_rate_bit": b.link_rate_bps * 8 if b else 0,
                "rules": os.path.abspath(self.opts.rules_path),
                "flow_source": self.tracer_status,
                "tracer": self.tracer.stats() if self.tracer else None,
                "live_flows": len(self.table),
                "shaped_flows": len(rows),
                "counters": {"applies": self.counters.applies, "op_errors": self.counters.op_errors,
                             "reloads_ok": self.counters.reloads_ok,
                             "reloads_failed": self.counters.reloads_failed,
                             "backend_rebuild_failures": self.counters.rebuild_failures,
                             "events": {f"{s}_{k}": n for (s, k), n in self.table.events.items()},
                             "shape_latency_us": _pcts(self.counters.shape_latency_ns),
                             "apply_latency_us": _pcts(self.counters.apply_latency_ns),
                             "reconcile_added": self.table.reconcile_added,
                             "reconcile_removed": self.table.reconcile_removed},
            }
        stats = {}
        if b is not None and self.backend_state == "ok":
            try:
                with RtnlSocket() as rt:
                    stats = b.stats_by_class(rt)
            except (OSError, FlowpacerError) as e:
                log.debug("status: class statistics: %s", e)
        flows = []
        for classid, row in rows:
            st = stats.get(classid)
            row.update(bytes=st.bytes if st else 0, packets=st.packets if st else 0,
                       drops=st.drops if st else 0)
            flows.append(row)
        flows.sort(key=lambda x: (x["rule"], x["local"], x["remote"]))
        head["flows"] = flows
        return head

    def metrics_view(self) -> dict:
        """A consistent copy of what a scrape needs (taken under the loop's lock)."""
        with self.lock:
            b = self.backend
            flows = []
            for key, classid, shape in (b.flows_snapshot() if b else ()):
                f = self.table.flows.get(key)
                flows.append({"key": key, "classid": classid, "rule": shape.rule,
                              "rate_bps": shape.rate_bps,
                              "process": f.proc.comm if f else "",
                              "direction": f.direction.value if f else "",
                              "local_address": str(key.local_addr), "local_port": key.local_port,
                              "remote_address": str(key.remote_addr),
                              "remote_port": key.remote_port})
            ts = self.tracer.stats() if self.tracer is not None else {}
            c = self.counters
            return {"flows": flows,
                    "rule_names": [r.name for r in self.rules.rules] if self.rules else [],
                    "backend": b.name if b else None, "interface": b.interface if b else None,
                    "backend_state": self.backend_state,
                    "backend_rebuild_failures": c.rebuild_failures,
                    "flow_source": self.tracer_status, "events": dict(self.table.events),
                    "tracer_lost": ts.get("lost", 0),
                    "tracer_unattributed": ts.get("unattributed", 0),
                    "netlink_errors": c.op_errors, "reloads_ok": c.reloads_ok,
                    "reloads_failed": c.reloads_failed, "live_flows": len(self.table),
                    "apply_hist": c.apply_hist.cumulative()}

    def _class_stats(self) -> dict:
        """Read by the metrics thread over its own netlink socket, without the loop's lock."""
        b = self.backend
        if b is None:
            return {}
        if self._metrics_rtnl is None:
            self._metrics_rtnl = RtnlSocket()
        return b.stats_by_class(self._metrics_rtnl)

    def _handle(self, req: dict) -> dict:
        cmd = req.get("cmd")
        try:
            if cmd == "status":
                return self.status()
            if cmd == "reload":
                return self.reload()
            if cmd == "ping":
                return {"ok": True}
        except FlowpacerError as e:
            return {"error": str(e)}
        return {"error": f"unknown command {cmd!r}"}

    # -------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        sd_notify("STOPPING=1")
        self._stop.set()
        if self._tracer_thread is not None:
            self._tracer_thread.join(timeout=2)
        if self.tracer is not None:
            try:
                self.tracer.close()
            except Exception as e:
                log.debug("tracer close: %s", e)
        if self.backend is not None:
            self.backend.teardown()
            self.backend.close()
        if self._control is not None:
            self._control.close()
        if self._metrics is not None:
            self._metrics.close()
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _pcts(samples_ns) -> dict:
    s = sorted(samples_ns)
    if not s:
        return {"n": 0}
    pick = lambda p: round(s[min(len(s) - 1, int(p / 100 * (len(s) - 1) + 0.5))] / 1000, 1)
    return {"n": len(s), "p50": pick(50), "p90": pick(90), "p99": pick(99), "max": round(s[-1] / 1000, 1)}


def _ep(addr, port) -> str:
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def _classid(c: Optional[int]) -> str:
    return f"{c >> 16:x}:{c & 0xFFFF:x}" if c is not None else ""
