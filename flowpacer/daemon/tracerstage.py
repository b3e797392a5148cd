"""The tracer stage: the eBPF tracer's events to the reconciler, in a supervised ``Stage`` of its own.

It owns the tracer and the flow source's status (``FlowSourceStatus``): the tracer running,
off (``--no-tracer``), unavailable, or given up after repeated failures, when the daemon finds
flows by sock_diag polling alone. The composition root (``app.py``) builds it, hands it the
reconciler when the stages start, and reads ``tracer`` and ``flow_source`` for its view.
"""
from __future__ import annotations

import logging
from typing import Callable

from flowpacer.daemon.memory import release_compiler_memory
from flowpacer.daemon.stages import GiveUp, Stage, StageContext
from flowpacer.errors import TracerUnavailable
from flowpacer.model import FlowSourceMode, FlowSourceStatus, RuleSet
from flowpacer.policy import engine
from flowpacer.sources.contract import FlowTracer

log = logging.getLogger(__name__)

# what the daemon's stage builder (``Daemon._stage``) takes: name, run, give_up, stall_s and
# on_degrade, and it returns the supervised Stage
StageMaker = Callable[..., Stage]


def real_tracer():
    from flowpacer.sources.tracer import Tracer
    return Tracer(ring_pages=256)


class TracerStage:
    """``factory``: makes the tracer (``real_tracer``, or a fake in tests); ``make_stage``: the
    daemon's stage builder (its back-off, clock, stop event and fatal handler); ``enabled``:
    false with ``--no-tracer``; ``rescan_s``: the sock_diag period, said in the log on
    degrading."""

    def __init__(self, factory: Callable[[], object], make_stage: StageMaker, *,
                 enabled: bool, rescan_s: float):
        self._factory = factory
        self._make_stage = make_stage
        self._enabled = enabled
        self._rescan_s = rescan_s
        self._rec = None
        self.tracer = None
        self.flow_source = FlowSourceStatus()

    def stage(self, rec) -> Stage:
        """Start the tracer for the reconciler ``rec``: its supervised stage, or a disabled one
        (off, or the tracer cannot run: the flow source says why)."""
        self._rec = rec
        if not self._enabled:
            self.flow_source = FlowSourceStatus(FlowSourceMode.NO_TRACER)
            return Stage.disabled("tracer", "--no-tracer")
        try:
            t = self._factory()
            t.set_watch(*engine.watch_filter(rec.rules))  # before anything reports
            t.start()
            set_udp_idle(t, rec.rules)
        except ImportError as e:
            self.flow_source = FlowSourceStatus(FlowSourceMode.TRACER_CANNOT_LOAD, str(e))
        except (TracerUnavailable, OSError) as e:
            self.flow_source = FlowSourceStatus(FlowSourceMode.TRACER_UNAVAILABLE, str(e))
        else:
            self.tracer = t
            rec.udp_adopter = t.adopt_udp_connected
            release_compiler_memory()
            self.flow_source = FlowSourceStatus(FlowSourceMode.TRACER, t.hooks)
            return self._make_stage("tracer", self._trace, GiveUp.DEGRADE, stall_s=10.0,
                                    on_degrade=self._degraded)
        log.warning("%s", self.flow_source.text)
        return Stage.disabled("tracer", self.flow_source.text)

    def _trace(self, ctx: StageContext) -> None:
        rec = self._rec
        while not ctx.stopping():
            events = self.tracer.poll(100)
            ctx.beat()
            if events:
                # applied right here: a hand-over to the main thread cost ~0.4 ms per event
                rec.on_events(events)

    def _degraded(self, stage: Stage, why: str) -> None:
        self.flow_source = FlowSourceStatus(FlowSourceMode.TRACER_FAILED, why)
        log.error("flow source degraded: %s; flows are found by sock_diag every %.1f s",
                  self.flow_source.text, self._rescan_s)
        self._rec.udp_adopter = None
        t, self.tracer = self.tracer, None
        _close_quietly(t)

    def rules_changed(self, rs: RuleSet) -> None:
        """New rules (a reload): what the tracer watches and its UDP idle timeouts."""
        if self.tracer is not None:
            self.tracer.set_watch(*engine.watch_filter(rs))
            set_udp_idle(self.tracer, rs)

    def close(self) -> None:
        _close_quietly(self.tracer)


def _close_quietly(tracer) -> None:
    """Close the tracer (None: nothing); a failure there is only logged."""
    if tracer is not None:
        try:
            tracer.close()
        except Exception as e:
            log.debug("tracer close: %s", e)


def set_udp_idle(tracer: FlowTracer, rs: RuleSet) -> None:
    """The rules' UDP idle timeouts to the tracer (issue 17)."""
    tracer.set_udp_idle(*engine.udp_idle_timeouts(rs))
