"""In-memory stand-ins for the daemon's side effects (backend, flow sources), so that its
supervision (stage failures, restart adoption, fall-back, reload, watchdog) is tested
in-process. Pure bookkeeping: nothing here touches the kernel. Real-kernel behaviour is tested
with the real backend elsewhere; these fakes only have to keep the backend's contract
(``flowpacer.backend.contract.Backend``; harness/backend_contract.py checks it).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, List, Optional

from flowpacer.backend.contract import Capabilities
from flowpacer.errors import BackendError
from flowpacer.model import (ApplyResult, BackendHealth, BackendKind, ClassRole, ClassStats,
                             FlowKey, Op, OpError, OpKind, Shape, Side)


class FakeStatsChannel:
    def __init__(self):
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    """A ``Backend`` (flowpacer/backend/contract.py) in memory: classes without groups or
    pools, every class with 1000 bytes sent."""

    def __init__(self, name: str = "htb", interface: str = "fake0",
                 link_rate_bps: int = 125_000_000,
                 installed: Optional[Dict[FlowKey, Shape]] = None, side: Side = Side.SEND):
        self.kind = BackendKind(name)
        self.name = name
        self.capabilities = Capabilities(has_classes=True, groups=False, kernel_shares=False,
                                         pools=False, side=side)
        self.interface = interface
        self.link_rate_bps = link_rate_bps
        self.health = BackendHealth.OK
        self.setup_error: Optional[Exception] = None    # setup() raises this (a lost module)
        self.raise_on_apply: List[Exception] = []       # apply() raises these, one per call
        self.refuse: set = set()                        # keys whose ADD the "kernel" refuses
        self.busy: set = set()                          # keys whose REMOVE it refuses
        self.flows: Dict[FlowKey, tuple] = {}           # key -> (classid, Shape)
        self.kernel_before: Dict[FlowKey, Shape] = dict(installed or {})  # what a crash left
        self.applied: List[Op] = []
        self.torn_down = False
        self.closed = False
        self._next = 0x10

    # set-up and health
    def setup(self) -> None:
        if self.setup_error is not None:
            raise self.setup_error
        for k, s in self.kernel_before.items():          # adopt what is there
            self._install(k, s)
        self.kernel_before = {}

    def check(self) -> BackendHealth:
        return self.health

    def audit(self) -> List[FlowKey]:
        return []

    def forget(self) -> None:
        self.flows.clear()

    def resync(self) -> None:
        pass

    def teardown(self) -> None:
        self.flows.clear()
        self.torn_down = True

    def close(self) -> None:
        self.closed = True

    # flows
    def _install(self, key: FlowKey, shape: Shape) -> None:
        self.flows[key] = (0xF1F00000 | self._next, shape)
        self._next += 1

    def installed(self) -> Dict[FlowKey, Shape]:
        return {k: s for k, (_, s) in self.flows.items()}

    def shape_of(self, key: FlowKey) -> Optional[Shape]:
        v = self.flows.get(key)
        return v[1] if v else None

    def apply(self, plan) -> ApplyResult:
        if self.raise_on_apply:
            raise self.raise_on_apply.pop(0)
        res = ApplyResult()
        for op in plan:
            self.applied.append(op)
            cur = self.flows.get(op.key)
            if op.kind is OpKind.REMOVE:
                if cur is not None and op.key in self.busy:
                    res.errors.append(OpError(op, f"delete class of {op.key}: busy (test)"))
                elif cur is not None:
                    del self.flows[op.key]
                    res.removed += 1
            elif cur is not None:
                if (cur[1].rate_bps, cur[1].ceil_bps) != (op.shape.rate_bps, op.shape.ceil_bps):
                    res.changed += 1
                self.flows[op.key] = (cur[0], op.shape)
            elif op.kind is not OpKind.ADD:
                res.errors.append(OpError(op, f"{op.kind.value} of unknown flow {op.key}"))
            elif op.key in self.refuse:
                res.errors.append(OpError(op, f"add class for {op.key}: refused (test)"))
            else:
                self._install(op.key, op.shape)
                res.added += 1
        return res

    def flows_snapshot(self):
        return [(k, f"{c >> 16:x}:{c & 0xFFFF:x}", s) for k, (c, s) in self.flows.items()]

    def group_views(self):
        return ()

    def open_stats_channel(self) -> FakeStatsChannel:
        return FakeStatsChannel()

    def class_stats(self, channel=None):
        out = {k: ClassStats(bytes=1000, packets=1) for k in self.flows}
        out[ClassRole.DEFAULT] = ClassStats()
        return out

    def stats(self) -> Dict[FlowKey, ClassStats]:
        return {k: st for k, st in self.class_stats().items() if isinstance(k, FlowKey)}


class FakeFactory:
    """Hands out FakeBackends; ``psp`` says whether the psp "module" is there."""

    def __init__(self, psp: bool = False, installed: Optional[Dict[FlowKey, Shape]] = None):
        self.psp = psp
        self.made: List[FakeBackend] = []
        self._installed = installed
        # the receive side (issue 17): backends made, why making one fails, clean-ups asked
        self.made_rx: List[FakeBackend] = []
        self.rx_error: Optional[Exception] = None
        self.rx_cleanups: List[str] = []

    def _new(self, name, interface, link_rate_bps):
        b = FakeBackend(name, interface, link_rate_bps or 125_000_000,
                        installed=self._installed if not self.made else None)
        self.made.append(b)
        b.setup()
        return b

    def make(self, kind, interface, link_rate_bps):
        from flowpacer.model import BackendKind
        if kind is BackendKind.PSP and not self.psp:
            raise BackendError("backend psp requested but the module is not available: test")
        name = "psp" if kind is BackendKind.PSP or (kind is BackendKind.AUTO and self.psp) else "htb"
        return self._new(name, interface, link_rate_bps), f"{name} (fake)"

    def fallback(self, kind, lost, interface, link_rate_bps):
        from flowpacer.model import BackendKind
        if kind is not BackendKind.AUTO or lost != "psp" or self.psp:
            return None
        return self._new("htb", interface, link_rate_bps), "auto: psp gone, using htb (fake)"

    def preferred_available(self) -> bool:
        return self.psp

    def make_receive(self, send_backend, interface, link_rate_bps):
        if self.rx_error is not None:
            raise self.rx_error
        b = FakeBackend(send_backend.name, "fpi-" + interface, link_rate_bps or 125_000_000,
                        side=Side.RECEIVE)
        self.made_rx.append(b)
        b.setup()
        return b

    def cleanup_receive(self, interface) -> None:
        self.rx_cleanups.append(interface)


class FakeSockDiag:
    """A snapshot source whose answer the test sets (``flows``), or that raises (``error``)."""

    def __init__(self):
        self.flows: Dict[FlowKey, object] = {}
        self.error: Optional[Exception] = None
        self.scans = 0

    def snapshot(self):
        self.scans += 1
        if self.error is not None:
            raise self.error
        return dict(self.flows)


class FakeTracer:
    """Events the test queues come out of ``poll``; ``fail_with`` makes poll raise, and
    ``hang`` blocks poll until released (a stuck tracer)."""

    hooks = "fake"

    def __init__(self):
        self.queue: List[list] = []
        self.fail_with: Optional[Callable[[], Exception]] = None
        self.hang = threading.Event()       # set: poll blocks until ``release`` is set
        self.release = threading.Event()
        self.polls = 0
        self.closed = False
        self._lock = threading.Lock()
        self._idle = threading.Event()      # never set: poll's own timeout

    def set_watch(self, comms, uids) -> None:
        pass

    def start(self) -> None:
        pass

    def push(self, events) -> None:
        with self._lock:
            self.queue.append(list(events))

    def poll(self, timeout_ms: int):
        self.polls += 1
        if self.hang.is_set():
            self.release.wait(30)
        if self.fail_with is not None:
            raise self.fail_with()
        with self._lock:
            if self.queue:
                return self.queue.pop(0)
        self._idle.wait(timeout_ms / 1000)
        return []

    def stats(self) -> dict:
        return {"lost": 0, "unattributed": 0}

    def close(self) -> None:
        self.closed = True


@contextlib.contextmanager
def inprocess_daemon(tmp_path, ruleset, *, factory=None, sockdiag=None, tracer=None,
                     notify=None, tracer_enabled: bool = True, rescan_s: float = 0.05,
                     backoff_s=(0.01, 0.05)):
    """A real ``Daemon`` wired to fakes, its main loop in a thread; stopped and shut down on
    exit. Yields the daemon (``d.supervisor.backend`` is the FakeBackend)."""
    from flowpacer.app import Daemon, Options
    opts = Options(rules_path=str(tmp_path / "rules.yaml"), socket_path=str(tmp_path / "ctl.sock"),
                   rescan_s=rescan_s, tracer=tracer_enabled, metrics_listen=None)
    d = Daemon(opts, backend_factory=factory or FakeFactory(),
               sockdiag=sockdiag or FakeSockDiag(), tracer_factory=lambda: tracer or FakeTracer(),
               load=lambda path: ruleset() if callable(ruleset) else ruleset,
               notify=notify or (lambda s: None), stage_backoff_s=backoff_s)
    d.start()
    t = threading.Thread(target=d.run, name="test-main", daemon=True)
    t.start()
    try:
        yield d
    finally:
        d._stop.set()
        t.join(10)
        d.shutdown()


class StageCtx:
    """What a stage's ``run(ctx)`` sees, for running a server loop in a test's own thread."""

    def __init__(self):
        self.stop = threading.Event()
        self.beats = 0

    def stopping(self):
        return self.stop.is_set()

    def beat(self):
        self.beats += 1

    def wait(self, s):
        return self.stop.wait(s)
