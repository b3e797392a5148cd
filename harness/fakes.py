"""In-memory stand-ins for the daemon's side effects (backend, flow sources), so that its
supervision (stage failures, restart adoption, fall-back, reload, watchdog) is tested
in-process. Pure bookkeeping: nothing here touches the kernel. Real-kernel behaviour is tested
with the real backend elsewhere; these fakes only have to keep the backend's contract
(``flowpacer.kernel.backend.contract.Backend``; harness/backend_contract.py checks it), the first-byte
pool ops included. ``FakeFirstByte`` is the first-byte source over in-memory maps.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from flowpacer.kernel import bond
from flowpacer.kernel.backend.contract import Capabilities
from flowpacer.kernel.backend.filters import LayoutFull
from flowpacer.kernel.backend.handles import FLOW_CLASS_IDS
from flowpacer.kernel.backend.pool import Pool, book
from flowpacer.errors import BackendError
from flowpacer.sources.sockdiag import Snapshot
from flowpacer.sources.firstbyte import (COUNTERS, EVENT, FB_DIR_INBOUND, FB_DIR_OUTBOUND,
                                         FB_F_CLOSED, POOL_SLOTS, FirstByte)
from flowpacer.model import (ApplyResult, BackendHealth, BackendKind, ClassRole, ClassStats,
                             FlowKey, GroupKey, GroupView, Op, OpError, OpKind, PoolOp, Shape,
                             Side, SpareOp)


class FakeStatsChannel:
    def __init__(self):
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    """A ``Backend`` (flowpacer/kernel/backend/contract.py) in memory: classes without groups, the
    first-byte pools on the send side (``Pools``), every class with 1000 bytes sent. With
    ``spare_max``, a removed flow's class id is kept as a spare (up to that many) and given to
    the next new flow, as htb's TcBackend does (issue 26); ``spares``: what a crash left. With
    ``groups``, it declares group classes and has one for each group of its flows' shapes (their
    nominal rates, no hierarchy, no sharing: what status and metrics read, not the tc trees)."""

    def __init__(self, name: str = "htb", interface: str = "fake0",
                 link_rate_bps: int = 125_000_000,
                 installed: Optional[Dict[FlowKey, Shape]] = None, side: Side = Side.SEND,
                 spare_max: int = 0, spares: Sequence[int] = (), groups: bool = False,
                 follow_speed: bool = False):
        """``follow_speed``: no link rate in the rules: the link rate is the device's as
        ``kernel/bond.py`` reads it (tests point ``bond.SYSFS`` at a fake tree), and a changed
        figure is the SPEED health state (the classes stay, as the real backend's do)."""
        self.kind = BackendKind(name)
        self.name = name
        self.capabilities = Capabilities(has_classes=True, groups=groups, kernel_shares=False,
                                         pools=side is Side.SEND, side=side,
                                         class_ids=FLOW_CLASS_IDS,   # as the tc backends
                                         spares=spare_max > 0)
        self.interface = interface
        self.link_rate_bps = link_rate_bps
        self.link_rate_source = "rules"
        self.follow_speed = follow_speed
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
        self.pool = Pool(0xF1F0)        # first-byte pools (issue 16): bookkeeping only
        self.spare_max = spare_max
        self.spare_from = 0             # kept from the first closed flow (a small test's size)
        self.spare_target = 0           # the last SpareOp's target
        self.spares: List[int] = list(spares)[:spare_max]   # class ids of spare classes
        self._next = max([self._next] + [(c & 0xFFFF) + 1 for c in self.spares])

    # set-up and health
    def setup(self) -> None:
        if self.setup_error is not None:
            raise self.setup_error
        if self.follow_speed:
            got = bond.link_rate(self.interface)
            if not got.rate_bps:
                raise BackendError(f"interface {self.interface} reports no speed (fake)")
            self.link_rate_bps, self.link_rate_source = got.rate_bps, got.source
        for k, s in self.kernel_before.items():          # adopt what is there
            self._install(k, s, spare=False)
        self.kernel_before = {}

    def check(self) -> BackendHealth:
        if self.follow_speed and self.health is BackendHealth.OK:
            got = bond.link_rate(self.interface)
            if got.rate_bps and got.rate_bps != self.link_rate_bps:
                # set up again, the real backend adopts its classes with the new link rate
                self.kernel_before = {k: s for k, (_c, s) in self.flows.items()}
                return BackendHealth.SPEED
        return self.health

    def audit(self) -> List[FlowKey]:
        return []

    def forget(self) -> None:
        self.flows.clear()
        self.spares.clear()
        self.pool.forget()

    def resync(self) -> None:
        pass

    def teardown(self) -> None:
        self.flows.clear()
        self.spares.clear()
        self.torn_down = True

    def close(self) -> None:
        self.closed = True

    # flows
    def _install(self, key: FlowKey, shape: Shape, spare: bool = True) -> None:
        claimed = self.pool.take_claim(key)      # a claimed pool class is the flow's
        if claimed is not None:
            self.flows[key] = (0xF1F00000 | claimed, shape)
            return
        if spare and self.spares:
            self.flows[key] = (self.spares.pop(), shape)
            return
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
            if isinstance(op, PoolOp):
                self._apply_pool(op, res)
                continue
            if isinstance(op, SpareOp):
                self._apply_spares(op, res)
                continue
            cur = self.flows.get(op.key)
            if op.kind is OpKind.REMOVE:
                if cur is not None and op.key in self.busy:
                    res.errors.append(OpError(op, f"delete class of {op.key}: busy (test)"))
                elif cur is not None:
                    del self.flows[op.key]
                    if cur[0] & 0xFFFF >= 0xC000:
                        self.pool.free_minor(cur[0] & 0xFFFF)
                    elif len(self.spares) < self.spare_max and (
                            len(self.flows) + len(self.spares) >= self.spare_from
                            or len(self.spares) < self.spare_target):
                        self.spares.append(cur[0])
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

    def _apply_spares(self, op: SpareOp, res: ApplyResult) -> None:
        """Ready spare classes (issue 26), as TcBackend makes them: new ids, up to spare_max."""
        self.spare_target = op.target
        if not self.capabilities.spares:
            res.spare_errors.append("make spare classes: this backend keeps none")
            return
        for _ in range(op.count):
            if len(self.spares) >= self.spare_max:
                return
            self.spares.append(0xF1F00000 | self._next)
            self._next += 1
            res.spares_made += 1

    def _apply_pool(self, op: PoolOp, res: ApplyResult) -> None:
        """The pool ops as TcBackend applies them (backend/pool.py), without a kernel."""
        pool, k = self.pool, op.kind
        if k is OpKind.POOL_CHANGE:
            made = res.pool_made.setdefault(op.rule, [])
            for cid in op.classids:
                if cid in pool.classes:
                    pool.classes[cid] = op.rule
                    made.append(cid)
        elif k is OpKind.POOL_FILL:
            made = res.pool_made.setdefault(op.rule, [])
            for _ in range(op.count):
                try:
                    cid = 0xF1F00000 | pool.alloc_minor()
                except LayoutFull:
                    break
                pool.classes[cid] = op.rule
                made.append(cid)
        else:       # the kernel's deletes all succeed here
            for cid, claimed, _what in book(pool, op, res):
                pool.free_minor(cid & 0xFFFF, claimed=claimed)

    def flows_snapshot(self):
        return [(k, f"{c >> 16:x}:{c & 0xFFFF:x}", s) for k, (c, s) in self.flows.items()]

    def _group_classes(self) -> Dict[GroupKey, tuple]:
        """GroupKey -> (display name, Group) of the groups its flows are in (``groups`` only)."""
        if not self.capabilities.groups:
            return {}
        found = {}
        for _c, shape in self.flows.values():
            for g in shape.groups:
                found.setdefault(GroupKey(g.kind, g.id), g)
        return {k: (f"f1f0:{0xB000 + i:x}", g) for i, (k, g) in enumerate(sorted(
            found.items(), key=lambda kv: (kv[0].kind.value, kv[0].id)))}

    def group_views(self):
        return tuple(GroupView(g.kind, g.id, handle, g.rate_bps, g.ceil_bps)
                     for handle, g in self._group_classes().values())

    def spare_count(self) -> int:
        return len(self.spares)

    def spare_handles(self):
        return tuple(f"{c >> 16:x}:{c & 0xFFFF:x}" for c in sorted(self.spares))

    def open_stats_channel(self) -> FakeStatsChannel:
        return FakeStatsChannel()

    def class_stats(self, channel=None):
        out = {k: ClassStats(bytes=1000, packets=1) for k in self.flows}
        out.update((k, ClassStats(bytes=1000, packets=1)) for k in self._group_classes())
        out[ClassRole.DEFAULT] = ClassStats()
        return out

    def stats(self) -> Dict[FlowKey, ClassStats]:
        return {k: st for k, st in self.class_stats().items() if isinstance(k, FlowKey)}


class FakeFactory:
    """Hands out FakeBackends; ``psp`` says whether the psp "module" is there."""

    def __init__(self, psp: bool = False, installed: Optional[Dict[FlowKey, Shape]] = None,
                 spare_max: int = 0, groups: bool = False, follow_speed: bool = False):
        """``spare_max``: the send backends keep closed flows' classes as spares (issue 26);
        ``groups``: they have group classes (``FakeBackend``'s ``groups``); ``follow_speed``:
        an interface without a link rate in the rules takes the device's (``FakeBackend``)."""
        self.psp = psp
        self.follow_speed = follow_speed
        self.spare_max = spare_max
        self.groups = groups
        self.made: List[FakeBackend] = []
        self._installed = installed
        # the receive side (issue 17): backends made, why making one fails, clean-ups asked
        self.made_rx: List[FakeBackend] = []
        self.rx_error: Optional[Exception] = None
        self.rx_cleanups: List[str] = []

    def _new(self, name, interface, link_rate_bps):
        b = FakeBackend(name, interface, link_rate_bps or 125_000_000,
                        installed=self._installed if not self.made else None,
                        spare_max=self.spare_max, groups=self.groups,
                        follow_speed=self.follow_speed and not link_rate_bps)
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


class FakeRouter:
    """Route lookups and the device list for several interfaces (issue 29) without a kernel:
    ``routes`` maps a remote network (text, e.g. "10.2.0.0/16") to an interface name (None: no
    route), the longest prefix wins; ``devices`` is what globs are matched against."""

    def __init__(self, routes: Optional[Dict[str, Optional[str]]] = None,
                 devices: Optional[List[str]] = None):
        self.routes: Dict[str, Optional[str]] = dict(routes or {})
        self.devices: List[str] = list(devices or [])
        self.by_mark: Dict[int, Optional[str]] = {}     # a socket mark's interface (fwmark)
        self.lookups = 0

    def egress(self, items):
        out = {}
        nets = sorted(((ipaddress.ip_network(n), i) for n, i in self.routes.items()),
                      key=lambda x: -x[0].prefixlen)
        for key, _uid, mark, _oif in items:
            self.lookups += 1
            if mark in self.by_mark:            # ip rule fwmark MARK lookup ...
                out[key] = self.by_mark[mark]
                continue
            out[key] = next((i for n, i in nets if n.version == key.remote_addr.version
                             and key.remote_addr in n), None)
        return out

    def links(self):
        return list(self.devices)

    def close(self):
        pass


class FakeSockDiag:
    """A snapshot source whose answer the test sets (``flows``), or that raises (``error``)."""

    def __init__(self):
        self.flows: Dict[FlowKey, object] = {}
        self.error: Optional[Exception] = None
        self.scans = 0

    def snapshot(self) -> Snapshot:
        self.scans += 1
        if self.error is not None:
            raise self.error
        return Snapshot(self.flows)


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
        self.udp_idle: Optional[tuple] = None   # set_udp_idle's last (shortest, longest) ns
        self.adopted_udp: List[dict] = []       # adopt_udp_connected's calls

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

    def set_udp_idle(self, shortest_ns: int, longest_ns: int) -> None:
        self.udp_idle = (shortest_ns, longest_ns)

    def adopt_udp_connected(self, socks) -> None:
        self.adopted_udp.append(dict(socks))

    def stats(self) -> dict:
        return {"lost": 0, "unattributed": 0}

    def close(self) -> None:
        self.closed = True


class _FakeBpf:
    def cleanup(self) -> None:
        pass


class FakeFirstByte(FirstByte):
    """A ``flowpacer.sources.firstbyte.FirstByte`` whose kernel side (the sock_ops program, its maps
    and ring buffer) is in memory: ``claim`` plays the program's ticket protocol on the rings
    the daemon filled, ``close_socket`` its close report. Everything above the maps (the
    rounds with the reconciler, pools, counters) is the real code. ``on_kernel_access`` is
    called at every map access (the lock test checks who holds what there)."""

    def __init__(self, *args, on_kernel_access: Optional[Callable[[str], None]] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.on_kernel_access = on_kernel_access or (lambda what: None)
        self.take: Dict[int, int] = {}
        self.fill: Dict[int, int] = {}
        self.slots: Dict[int, int] = {}
        self.live = 0
        self.rules_written = 0
        self.records: List[bytes] = []
        self.guard_written = False
        self.placed_slots: Dict[int, int] = {}   # fb_placed: slot -> the placed claim's ts_ns
        self.claim_ts: Dict[int, int] = {}       # class id -> its last claim's ts_ns
        self._records_lock = threading.Lock()
        self._idle = threading.Event()           # never set: poll's own timeout

    # the kernel side
    def start(self) -> None:
        self._bpf = _FakeBpf()
        self.netns_cookie = 1
        self.summary = "fake first byte"

    def _seed_listeners(self) -> int:
        self.on_kernel_access("listeners")
        return 0

    def _write_config(self, live, c=None) -> None:
        self.on_kernel_access("config")
        self.live = live
        self.guard_written = self._guard

    def _set_placed(self, slot: int, ts_ns: int) -> None:
        self.on_kernel_access("placed")
        self.placed_slots[slot] = ts_ns

    def _write_rules(self, c) -> None:
        self.on_kernel_access("rules")
        self.rules_written += 1

    def _take(self, rule: int) -> int:
        self.on_kernel_access("take")
        return self.take.get(rule, 0)

    def _set_take(self, rule: int, ticket: int) -> None:
        self.on_kernel_access("take")
        self.take[rule] = ticket

    def _set_slot(self, index: int, classid: int) -> None:
        self.on_kernel_access("pool")
        self.slots[index] = classid

    def _set_fill(self, rule: int, ticket: int) -> None:
        self.on_kernel_access("fill")
        self.fill[rule] = ticket

    def _write_stopgaps(self, rows) -> None:
        self.on_kernel_access("rates")
        self.rates = list(rows)

    def _counters(self):
        return [0] * len(COUNTERS)

    def _ring_poll(self, timeout_ms: int) -> None:
        with self._records_lock:
            recs, self.records = self.records, []
        if not recs:
            self._idle.wait(min(timeout_ms, 20) / 1000)
        self._raw.extend(recs)

    # what the program does
    def ready(self, rule: int) -> int:
        return self.fill.get(rule, 0) - self.take.get(rule, 0)

    def ring(self, rule: int) -> List[int]:
        """The class ids ready in rule ``rule``'s ring, in ticket order."""
        return [self.slots[rule * POOL_SLOTS + t % POOL_SLOTS]
                for t in range(self.take.get(rule, 0), self.fill.get(rule, 0))]

    def claim(self, rule: int, key: FlowKey, inbound: bool = True) -> Optional[int]:
        """A handshake of ``key`` matched kernel rule ``rule``: its socket takes the next ready
        class and the claim is reported; None when claims are off or the pool is empty."""
        if not self.live or self.ready(rule) <= 0:
            return None
        t = self.take[rule]
        cid = self.slots[rule * POOL_SLOTS + t % POOL_SLOTS]
        self.take[rule] = t + 1
        self._record(cid, rule, key, inbound, 0)
        return cid

    def close_socket(self, cid: int, key: FlowKey) -> None:
        self._record(cid, 0, key, True, FB_F_CLOSED)

    def _record(self, cid: int, rule: int, key: FlowKey, inbound: bool, flags: int) -> None:
        fam = key.family
        ts = time.monotonic_ns()
        if not flags:
            self.claim_ts[cid] = ts
        raw = EVENT.pack(ts, cid, rule, 0, 0, fam, key.local_port, key.remote_port,
                         FB_DIR_INBOUND if inbound else FB_DIR_OUTBOUND, flags,
                         key.local_addr.packed.ljust(16, b"\0"),
                         key.remote_addr.packed.ljust(16, b"\0"), b"")
        with self._records_lock:
            self.records.append(raw)


class FakeLinkWatch:
    """``kernel/linkwatch.LinkWatch`` in memory: ``push(*names)`` queues link events of those
    devices and makes its descriptor readable, as the kernel's would be."""

    def __init__(self):
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._queued: set = set()
        self._lock = threading.Lock()
        self.closed = False

    def push(self, *names: str) -> None:
        with self._lock:
            self._queued.update(names)
        os.write(self._w, b"x")

    def fileno(self) -> int:
        return self._r

    def drain(self) -> set:
        try:
            os.read(self._r, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            out, self._queued = self._queued, set()
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._r)
            os.close(self._w)


@contextlib.contextmanager
def inprocess_daemon(tmp_path, ruleset, *, factory=None, sockdiag=None, tracer=None,
                     notify=None, tracer_enabled: bool = True, rescan_s: float = 0.05,
                     backoff_s=(0.01, 0.05), firstbyte=None, router=None,
                     interface=None, link_watch=None):
    """A real ``Daemon`` wired to fakes, its main loop in a thread; stopped and shut down on
    exit. Yields the daemon (``d.supervisor.backend`` is the FakeBackend)."""
    from flowpacer.daemon.app import Daemon, Options
    opts = Options(rules_path=str(tmp_path / "rules.yaml"), socket_path=str(tmp_path / "ctl.sock"),
                   rescan_s=rescan_s, tracer=tracer_enabled, metrics_listen=None,
                   interface=interface)
    d = Daemon(opts, backend_factory=factory or FakeFactory(),
               sockdiag=sockdiag or FakeSockDiag(), tracer_factory=lambda: tracer or FakeTracer(),
               load=lambda path: ruleset() if callable(ruleset) else ruleset,
               notify=notify or (lambda s: None), stage_backoff_s=backoff_s,
               firstbyte_factory=(lambda: firstbyte) if firstbyte is not None else None,
               router=router, link_watch=(lambda: link_watch) if link_watch is not None else None)
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


def mixed_key(i: int, fam) -> FlowKey:
    """The ``i``-th flow key of a family for in-process tests: 4 (IPv4), 6 (IPv6), or anything
    else for an IPv4-mapped one (a dual-stack ``[::]`` socket talking IPv4: the kernel reports
    v4-mapped addresses). Distinct for every ``i`` below 25 000 in each family."""
    if fam == 4:
        return FlowKey(ipaddress.ip_address("10.1.0.1"), 80,
                       ipaddress.ip_address(f"10.2.{i // 250}.{i % 250 + 1}"), 40000 + i)
    if fam == 6:
        return FlowKey(ipaddress.ip_address("fd00:1::1"), 80,
                       ipaddress.ip_address(f"fd00:2::{i + 1:x}"), 40000 + i)
    return FlowKey.wire(ipaddress.ip_address("::ffff:10.1.0.1"), 8080,
                        ipaddress.ip_address(f"::ffff:10.3.{i // 250}.{i % 250 + 1}"), 41000 + i)
