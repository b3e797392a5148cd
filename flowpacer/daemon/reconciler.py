"""The reconciler: flow table + engine + apply + retry, under one lock.

    tracer events ─┐
    sock_diag ─────┼─> FlowTable ─dirty keys─> engine.plan ─┬─> backend.apply
    first-byte ────┘    (claims) ──> engine.plan_pools ─────┘        │
    claims                 ^                                          │
                           └──────── failed keys (retried) ───────────┘

Every flow source calls in here (the tracer and the first-byte stage from their threads, the
reconcile pass from the main loop); every change to the table or the backend happens under
``lock``, and nothing else does: no sleep, no sock_diag dump, no BPF map write is done while
it is held (the first-byte source does those before and after ``on_claims``). A dirty key is only
forgotten once its plan was applied: an exception part-way through puts the batch back, an op
the kernel refused is retried at the next pass, and a backend that is not usable (interface
gone, qdisc lost or foreign) keeps them dirty until it is.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from flowpacer.policy import engine
from flowpacer.errors import FlowpacerError
from flowpacer.daemon.flows import FlowTable
from flowpacer.daemon.latency import LatencyHistogram
from flowpacer.model import (FlowKey, FlowSource, OpKind, PoolGrant, PoolOp, PoolReport,
                             ReloadResult, RuleSet)
from flowpacer.daemon.supervisor import BackendSupervisor

log = logging.getLogger(__name__)


@dataclass
class Counters:
    applies: int = 0
    op_errors: int = 0
    reloads_ok: int = 0
    reloads_failed: int = 0
    apply_latency_ns: deque = field(default_factory=lambda: deque(maxlen=4096))
    apply_hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    shape_latency_ns: deque = field(default_factory=lambda: deque(maxlen=4096))
    # issue 29: flows claimed at their handshake (pools are on the first interface) whose route
    # leaves by another interface: their class was made there after the handshake
    first_byte_elsewhere: int = 0
    # issue 26: ready spare classes made ahead of a burst (``ready_classes``), and refused
    spares_made: int = 0
    spare_errors: int = 0


# A batch of ready spare classes holds the lock about this long at most (sized from the last
# batch's cost a class: htb's kernel walks every class for each one made), so that a burst's
# flows arriving meanwhile wait no longer; between batches the lock is free.
SPARE_SLICE_NS = 30_000_000
SPARE_BATCH = (1, 1024)           # fewest and most classes a batch
SPARE_FIRST_BATCH = 64            # before a batch's cost is known
SPARE_PAUSE_NS = 30_000_000_000   # after a refused batch: the next try (the error logged once)


@dataclass
class _SpareFill:
    """One send backend's ready spares as the reconciler planned them."""
    told: int = 0                 # the target the backend last got (a new one has 0)
    ns_per_class: float = 0.0     # the last batch's time a class made
    last_batch: int = 0           # how many it made
    mid_then: float = 0.0         # flows and spares half-way through it
    pause_until_ns: int = 0
    last_error: str = ""


class Reconciler:
    def __init__(self, supervisor: BackendSupervisor, rules: RuleSet, *,
                 clock_ns: Callable[[], int] = time.monotonic_ns):
        self.supervisor = supervisor
        self.rules = rules
        self.clock_ns = clock_ns
        self.table = FlowTable()
        self.counters = Counters()
        self.lock = threading.RLock()
        self._retry: set = set()         # keys whose last operation failed
        self.resync_requested = False    # the transport failed: the next pass re-reads the kernel
        # the tracer's ``adopt_udp_connected`` (issue 17), None without a tracer that has it
        self.udp_adopter: Optional[Callable[[dict], None]] = None
        self._spares: dict = {}          # send backend -> _SpareFill (issue 26)

    # -------------------------------------------------------------- inputs
    def adopt(self) -> None:
        """After start: what the backend found in the kernel is planned again (kept only where
        the flow is still live)."""
        with self.lock:
            for b in self.supervisor.backends():
                self.table.dirty.update(b.installed())

    def on_events(self, events) -> None:
        """Tracer events, applied at once (called in the tracer's thread)."""
        with self.lock:
            for ev in events:
                self.table.on_event(ev)
            self.expire_idle()
            self.apply_dirty()

    def on_claims(self, report: PoolReport) -> PoolGrant:
        """A first-byte round (issue 16): its claims bound, the flows they are for planned, the
        pools topped up, all in one apply on the send backend. The answer carries the class ids
        made for each rule's pool (the source writes them into its rings, after this returns)."""
        with self.lock:
            sup = self.supervisor
            b = sup.backend
            # several interfaces (issue 29): the pools are the first interface's. A socket's
            # priority names a pool-range class id (pool.py), which no other interface ever
            # has (they allocate from the flow range only): a claimed flow that leaves by
            # another interface falls to the filters there, gets its class there after the
            # handshake (``_apply``), and its claim here is released at the next round
            if sup.routed:
                self._drop_stray_pools(sup)
            if b is None or not sup.usable or not b.capabilities.pools:
                return PoolGrant(False, report.epoch, self.rules)
            pool = b.pool
            flows = self.table.flows
            classed = {c.key for c in report.claims if b.shape_of(c.key) is not None}
            pp = engine.plan_pools(report, pool.holding(), flows, classed, self.rules,
                                   self.clock_ns())
            self.table.dirty.update(pp.dirty)
            res = self.apply_dirty(before=pp.first, after=pp.fills, rebind=pp.rebind)
            made = {r: tuple(ids) for r, ids in res.pool_made.items()} if res else {}
            # guarded claims (several interfaces): lifted once their class is where they
            # leave; with one interface none is guarded any more, every one is let go
            placed = (sup.placed(report.guarded) if sup.routed else frozenset(report.guarded)) \
                if report.guarded else frozenset()
            return PoolGrant(True, pool.epoch, self.rules, made, stale=pp.stale, bound=pp.bound,
                             bound_by_rule=dict(pp.bound_by_rule), released=pp.released,
                             rebound=len(pp.rebind), closed=pp.closed,
                             freed_by_sweep=res.pool_freed_by_sweep if res else 0,
                             ready_classes=len(pool.classes), ids_held=pool.ids_held(),
                             ids_awaiting=pool.ids_waiting(),
                             oldest_wait_s=pool.oldest_wait_s(),
                             guard=sup.routed and len(sup.ports()) > 1,
                             placed=placed)

    def _drop_stray_pools(self, sup) -> None:
        """Pools live on the first interface only: a port that holds ready or claimed pool
        classes without being the first (a reload made another interface the first) has them
        deleted, so that no id the first interface's pool hands out is a class elsewhere."""
        for p in sup.ports()[1:]:
            b = p.backend
            if b is None or not p.usable or not b.capabilities.pools:
                continue
            pool = b.pool
            if not pool.classes and not pool.claims:
                continue
            ops = [PoolOp(OpKind.POOL_RELEASE, key=k) for k in sorted(pool.claims)]
            if pool.classes:
                ops.append(PoolOp(OpKind.POOL_DELETE, classids=tuple(sorted(pool.classes))))
            log.info("%s: no longer the first interface: its %d pool classes are deleted",
                     b.interface, len(pool.classes) + len(pool.claims))
            try:
                b.apply(ops)
            except (OSError, FlowpacerError) as e:
                log.warning("%s: pool classes not deleted: %s; tried again next round",
                            b.interface, e)

    def expire_idle(self) -> None:
        """UDP flows idle for their rule's idle_timeout end (the caller holds the lock)."""
        if self.table.idle_since:
            self.table.expire(engine.idle_expired(self.table.flows, self.table.idle_since,
                                                  self.rules, self.clock_ns()))

    def reconcile(self, snap, started_ns: int) -> None:
        """One reconcile pass: the backend's health, the sock_diag snapshot (None when the scan
        failed), every shaped flow's route (issue 29: looked up outside the lock), the keys to
        retry, then one apply."""
        fresh = self._fresh_routes()
        with self.lock:
            if fresh is not None:
                self.table.dirty.update(self.supervisor.moved(fresh, self.table.flows.keys()))
            r = self.supervisor.check()
            if r.gone:
                self.counters.op_errors += len(r.gone)
                self.table.dirty.update(r.gone)
            if r.mark_all:
                self.table.mark_all(r.installed)
            if snap is not None:
                self.table.on_snapshot(snap, started_ns)
                if self.table.rerouted:     # a socket's mark or bound device changed
                    self.supervisor.recheck_routes(self.table.rerouted)
                    self.table.rerouted = set()
            self.expire_idle()
            self.table.dirty.update(self._retry)
            self._retry.clear()
            self.apply_dirty()
        self._adopt_udp(snap)       # outside the lock: it writes the tracer's kernel maps

    def _adopt_udp(self, snap) -> None:
        """The connected UDP sockets of the snapshot that a rule shapes, by cookie, to the
        tracer: one opened before it (a restart) ends by idleness too (issue 17)."""
        adopt = self.udp_adopter
        cookies = snap.udp_cookies
        if adopt is None or not cookies:
            return
        shaped = engine.desired({k: snap[k] for k in cookies}, self.rules)
        adopt({cookies[k]: snap[k] for k in shaped})

    # --------------------------------------------------------------- apply
    def apply_dirty(self, before=(), after=(), rebind=()):
        """Plan and apply every dirty key (the caller holds the lock); ``before``/``after``:
        first-byte pool ops for the send side's batch, ``rebind``: keys whose class is replaced
        by the one their socket claimed (``engine.plan_pools``)."""
        keys = self.table.take_dirty()
        if not keys and not before and not after:
            return None
        try:
            return self._apply(keys, before, after, rebind)
        except BaseException:
            self.table.dirty.update(keys)      # nothing is lost: planned again next time
            raise

    def _apply(self, keys, before=(), after=(), rebind=()):
        """Per interface (issue 29: each flow on the one it leaves by), the send side's plan,
        then the receive side's (issue 17), each on its backend."""
        sup = self.supervisor
        flows = self.table.flows
        live = {k: flows[k] for k in keys if k in flows}
        ports = sup.ports()
        if not sup.routed:               # one interface shapes every flow
            return self._apply_port(ports[0], keys, live, flows, before, after, rebind)
        # a flow a rule shapes either way has a route (a receive-only one too: its receive
        # class is on the ifb of the interface it leaves by)
        want = engine.desired(live, self.rules).keys() | engine.desired_receive(live,
                                                                               self.rules).keys()
        where = sup.egress({k: live[k] for k in want})
        names = {p.interface_of(self.rules) for p in ports}
        for k in keys:
            name = where.get(k, "")
            if k in want and name not in names:
                sup.unmanaged[k] = name or ""
            else:
                sup.unmanaged.pop(k, None)
        self._count_elsewhere(ports, keys, where, before)
        res = None
        for i, p in enumerate(ports):
            ifname = p.interface_of(self.rules)
            mine = {k: f for k, f in live.items() if where.get(k) == ifname}
            pres = self._apply_port(p, keys, mine, flows, *((before, after, rebind) if i == 0
                                                            else ((), (), ())),
                                    requeue=[k for k in keys if where.get(k) == ifname])
            res = _merge(res, pres)
        return res

    def _count_elsewhere(self, ports, keys, where, before=()) -> None:
        """Flows whose socket claimed a pool class on the first interface and whose route
        leaves by another, counted once: when their class there is about to be made (the claim
        came first), or when the claim is bound (``before``'s POOL_CLAIMs) after their class
        there was made (the tracer's OPEN came first; the claim is released next round)."""
        b = ports[0].backend
        if b is None or not b.capabilities.pools:
            return
        binding = {op.key for op in before if op.kind is OpKind.POOL_CLAIM}
        if not b.pool.claims and not binding:
            return
        first = ports[0].interface_of(self.rules)
        others = {p.interface_of(self.rules): p.backend for p in ports[1:] if p.usable}
        for k in keys:
            name = where.get(k)
            if not name or name == first or others.get(name) is None:
                continue
            classed = others[name].shape_of(k) is not None
            if (k in b.pool.claims and not classed) or (k in binding and classed):
                self.counters.first_byte_elsewhere += 1

    def _apply_port(self, sup, keys, live, flows, before, after, rebind, requeue=None):
        """One interface's backends: ``live`` the flows that leave by it, ``keys`` every key
        planned (one that left for another interface has its class here removed);
        ``requeue``: the keys kept dirty while this backend is not usable (default all)."""
        b = sup.backend
        if b is None or not sup.usable:
            self.table.dirty.update(keys if requeue is None else requeue)
            return None
        res = self._apply_side(b, engine.desired(live, self.rules), keys, flows,
                               before=before, after=after, rebind=rebind)
        rx = sup.rx
        if rx is not None and sup.rx_usable:
            res = _merge(res, self._apply_side(rx, engine.desired_receive(live, self.rules),
                                               keys, flows, latency=False))
        return res

    def _apply_side(self, b, want, keys, flows, latency: bool = True, before=(), after=(),
                    rebind=()):
        """``latency``: count the time from a flow's event to its class (the send side's);
        ``before``/``after``: pool ops around the flows' ones, in the same batch."""
        have = {}
        for k in keys:
            s = b.shape_of(k)
            if s is not None:
                have[k] = s
        ops = list(before) + engine.plan(want, have, rebind) + list(after)
        if not ops:
            return None
        t0 = self.clock_ns()
        try:
            res = b.apply(ops)
        except (OSError, FlowpacerError) as e:
            # the transport failed (e.g. ENOBUFS): what went in is uncertain, so rebuild the
            # bookkeeping from the kernel and re-plan every flow at the next pass
            self.counters.op_errors += 1
            log.error("apply failed on %s: %s; resynchronising with the kernel", b.interface, e)
            self._resync(b)
            return None
        t1 = self.clock_ns()
        self.counters.applies += 1
        self.counters.apply_latency_ns.append(t1 - t0)
        self.counters.apply_hist.observe((t1 - t0) / 1e9)
        for op in ops if latency else ():
            f = flows.get(op.key)
            if op.kind is OpKind.ADD and f is not None and f.source is FlowSource.TRACER:
                self.counters.shape_latency_ns.append(t1 - f.seen_ns)
        for err in res.errors:
            self.counters.op_errors += 1
            self._retry.add(err.op.key)     # planned again at the next reconcile pass
            fields = {"FLOWPACER_FLOW": str(err.op.key), "FLOWPACER_OP": err.op.kind.value}
            if err.op.shape is not None:
                fields["FLOWPACER_RULE"] = err.op.shape.rule
            log.warning("%s", err.reason, extra=fields)     # journal fields (surfaces/logs.py)
        if res.added or res.removed or res.changed:
            log.debug("applied on %s: +%d ~%d -%d", b.interface, res.added, res.changed,
                      res.removed)
        return res

    # ------------------------------------------------------- ready spares
    def fill_spares(self) -> bool:
        """Issue 26 (``ready_classes``): one batch of ready spare classes on every interface
        whose send backend keeps spares and has fewer flows and spares than the rules want;
        True while more are to be made (the main loop calls again soon, the lock free in
        between). A refused batch is logged and counted, and tried again SPARE_PAUSE_NS later."""
        more = False
        with self.lock:
            now = self.clock_ns()
            live = set()
            for p in self.supervisor.ports():
                b = p.backend
                if b is None or not p.usable or not b.capabilities.spares:
                    continue
                live.add(b)
                st = self._spares.get(b)
                if st is None:
                    st = self._spares[b] = _SpareFill()
                if now < st.pause_until_ns or (st.told == 0 and not self.rules.ready_classes):
                    continue
                lo, hi = SPARE_BATCH
                flows = len(b.installed())          # a SpareOp does not change it
                have = flows + b.spare_count()
                batch = SPARE_FIRST_BATCH if not st.ns_per_class else \
                    max(lo, min(hi, 2 * st.last_batch, _batch_for(st, have)))
                op = engine.plan_spares(self.rules, flows, b.spare_count(), batch, st.told)
                if op is None:
                    continue
                t0 = self.clock_ns()
                try:
                    res = b.apply([op])
                except (OSError, FlowpacerError) as e:
                    # the transport failed: as for the flows' apply, rebuild from the kernel
                    self._spare_refused(b, st, str(e), t0)
                    self._resync(b)
                    continue
                st.told = op.target
                self.counters.spares_made += res.spares_made
                if res.spares_made:
                    t1 = self.clock_ns()
                    st.ns_per_class = (t1 - t0) / res.spares_made
                    st.last_batch = res.spares_made
                    st.mid_then = have + res.spares_made / 2
                    log.debug("%s: %d ready spare classes made in %.1f ms (%d spares)",
                              b.interface, res.spares_made, (t1 - t0) / 1e6, b.spare_count())
                if res.spare_errors:
                    self._spare_refused(b, st, res.spare_errors[0], t0,
                                        len(res.spare_errors))
                elif res.spares_made and flows + b.spare_count() < op.target:
                    more = True
            for b in [b for b in self._spares if b not in live]:
                del self._spares[b]          # a backend replaced (switch, interface made again)
        return more

    def _resync(self, b) -> None:
        """After a failed transport: ``b``'s bookkeeping rebuilt from the kernel, its flows
        planned again, and the next pass soon (it re-reads the kernel)."""
        try:
            b.resync()
        except (OSError, FlowpacerError) as e:
            log.error("resync failed: %s", e)
        self.table.mark_all(b.installed().keys())
        self.resync_requested = True

    def _spare_refused(self, b, st: _SpareFill, reason: str, now_ns: int, n: int = 1) -> None:
        self.counters.spare_errors += n
        st.pause_until_ns = now_ns + SPARE_PAUSE_NS
        if reason != st.last_error:
            log.warning("%s: ready spare classes: %s; tried again in %.0f s", b.interface,
                        reason, SPARE_PAUSE_NS / 1e9)
        st.last_error = reason

    # -------------------------------------------------------------- reload
    def reload(self, load: Callable[[], RuleSet],
               on_rules: Callable[[RuleSet], None]) -> ReloadResult:
        """Load new rules with ``load`` (raises RulesError/FlowpacerError: nothing changes),
        switch the backend if the new rules ask for another one, re-plan every flow."""
        from flowpacer.errors import RulesError
        # the file is read and parsed before the lock: no I/O while the passes wait for it
        try:
            new = load()
        except RulesError as e:
            with self.lock:
                self.counters.reloads_failed += 1
            for p in e.problems:
                log.error("reload refused: %s", p)
            return ReloadResult(False, tuple(str(p) for p in e.problems))
        except FlowpacerError as e:
            with self.lock:
                self.counters.reloads_failed += 1
            log.error("reload refused: %s", e)
            return ReloadResult(False, (str(e),))
        with self.lock:
            old = self.rules
            sup = self.supervisor
            switch = sup.needs_switch(new)
            if switch:
                try:
                    sup.switch(new)
                except FlowpacerError as e:
                    self.counters.reloads_failed += 1
                    log.error("reload refused: %s", e)
                    self.table.mark_all()
                    self.apply_dirty()
                    return ReloadResult(False, (str(e),))
            else:
                sup.adopt_rules(new)
            self.rules = new
            for b in sup.backends():
                self.table.mark_all(b.installed().keys())
            res = self.apply_dirty()
            self.counters.reloads_ok += 1
            out = ReloadResult(True, tuple(e.reason for e in res.errors) if res else (),
                               rules_changed=new != old, switched_backend=bool(switch),
                               added=res.added if res else 0,
                               changed=res.changed if res else 0,
                               removed=res.removed if res else 0)
        # after the lock: what the sources watch follows the new rules (the tracer's BPF maps;
        # an event judged meanwhile by the new rules under the old filter is only early or late)
        on_rules(new)
        return out

    def _fresh_routes(self):
        """Issue 29: the route of every flow whose interface matters, looked up again (called
        without the lock; None with a single interface). A flow that now leaves by another
        interface is re-planned by the pass: its class moves."""
        sup = self.supervisor
        if not sup.routed:
            return None
        with self.lock:
            flows = sup.routed_flows(self.table.flows)
        return sup.reroute(flows)

    def mark_all(self, keys: Iterable[FlowKey] = ()) -> None:
        with self.lock:
            self.table.mark_all(keys)


def _batch_for(st: _SpareFill, have: int) -> int:
    """How many classes fill about SPARE_SLICE_NS with ``have`` flow and spare classes there. The
    cost a class grows with the classes there (htb's kernel walks them all), so it is taken as
    proportional to them: ``k`` a class there from the last batch (its cost a class at its
    half-way count), and x classes from ``have`` cost k * x * (have + x / 2)."""
    k = st.ns_per_class / max(st.mid_then, 1.0)
    return int(math.sqrt(have * have + 2 * SPARE_SLICE_NS / k) - have)


def _merge(a, b):
    """Two ApplyResults as one (either may be None)."""
    if a is None:
        return b
    if b is not None:
        a.added += b.added
        a.changed += b.changed
        a.removed += b.removed
        a.errors.extend(b.errors)
    return a
