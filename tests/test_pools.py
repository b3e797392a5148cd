"""First-byte pools with one writer (issue 25 item 2): the engine plans the pool ops (pure), the
backend applies them in the flows' batch, and the first-byte source never sleeps, sweeps
sockets or writes its maps while the reconciler's lock is held (in-process, with fakes)."""
import ipaddress
import threading
import time
import types

import pytest

from flowpacer.policy import engine
from flowpacer.sources import firstbyte
from flowpacer.daemon import reconciler
from flowpacer.model import (BackendHealth, BackendKind, ClaimEvent, Direction, EventKind, Flow,
                             FlowEvent, FlowKey, FlowSource, Match, Op, OpKind, PoolHolding,
                             PoolReport, ProcessInfo, Rule, RuleSet, Shape)
from harness.testbed import wait_for
from harness.fakes import FakeFirstByte, FakeSockDiag, FakeTracer, inprocess_daemon

RATE = 2_500_000
BURST = Rule("burst", Match(process=("fp-burst",), direction=Direction.INBOUND), RATE)
UP = Rule("up", Match(process=("fp-up",), direction=Direction.OUTBOUND), 2 * RATE)
LATE = Rule("late", Match(exe=("/nonexistent/*",)), RATE)
RULES = RuleSet("fake0", BackendKind.HTB, 125_000_000, (BURST, UP, LATE))
C = lambda m: 0xF1F00000 | m      # noqa: E731  (a pool class id)


def key(i: int) -> FlowKey:
    return FlowKey(ipaddress.ip_address("10.1.0.1"), 7100,
                   ipaddress.ip_address(f"10.2.0.{i + 1}"), 40000 + i)


def flow(k: FlowKey, comm="fp-burst", pid=100) -> Flow:
    return Flow(k, Direction.INBOUND, ProcessInfo(pid=pid, comm=comm), FlowSource.TRACER,
                seen_ns=time.monotonic_ns())


# ------------------------------------------------------------------ pure: engine.plan_pools

def _plan(report, holding, flows=(), classed=(), now_ns=10**12):
    return engine.plan_pools(report, holding, {f.key: f for f in flows}, set(classed), RULES,
                             now_ns)


def test_pools_are_topped_up_to_their_target():
    pp = _plan(PoolReport(7, ((BURST, 40), (UP, 48)), 48), PoolHolding(7))
    assert pp.first == [] and len(pp.fills) == 1
    op = pp.fills[0]
    assert (op.kind, op.rule, op.count) == (OpKind.POOL_FILL, "burst", 8)
    assert op.shape == engine.shape_of(BURST)


def test_a_reload_reuses_the_classes_taken_back_and_deletes_the_rest():
    ready = frozenset(C(0xC000 + i) for i in range(8))
    returned = tuple(sorted(ready)) + (C(0xC0FF),)        # the last: not ready any more
    pp = _plan(PoolReport(7, ((BURST, 0), (UP, 0)), 3, returned=returned, replan=True),
               PoolHolding(7, ready))
    kinds = [(o.kind, o.rule, o.classids, o.count) for o in pp.fills]
    assert kinds == [
        (OpKind.POOL_CHANGE, "burst", returned[0:3], 0),
        (OpKind.POOL_CHANGE, "up", returned[3:6], 0),
    ]
    assert pp.fills[1].shape.rate_bps == 2 * RATE         # changed to the new rule's shape
    assert [(o.kind, o.classids) for o in pp.first] == [(OpKind.POOL_DELETE, returned[6:8])]
    # fewer taken back than wanted: the rest is made
    pp = _plan(PoolReport(7, ((BURST, 0),), 3, returned=returned[:1]), PoolHolding(7, ready))
    assert [(o.kind, o.count) for o in pp.fills] == [(OpKind.POOL_CHANGE, 0),
                                                      (OpKind.POOL_FILL, 2)]
    # the program detached: every ready class goes, also ones no ring held
    pp = _plan(PoolReport(7, (), 3, returned=returned[:1], closing=True), PoolHolding(7, ready))
    assert not pp.fills and [(o.kind, o.classids) for o in pp.first] == \
        [(OpKind.POOL_DELETE, tuple(sorted(ready)))]


def test_claims_of_another_bookkeeping_are_stale_and_nothing_is_planned():
    rep = PoolReport(6, ((BURST, 0),), 48, claims=(ClaimEvent(key(1), C(0xC000), "burst"),),
                     closed=(C(0xC001),), returned=(C(0xC002),), priorities=frozenset({1}))
    pp = _plan(rep, PoolHolding(7, frozenset({C(0xC000), C(0xC002)})))
    assert pp.stale == 1 and not pp.first and not pp.fills and not pp.dirty


def test_a_claim_is_bound_and_its_flow_planned_or_rebound():
    cls = frozenset({C(0xC000), C(0xC001), C(0xC002)})
    claims = (ClaimEvent(key(1), C(0xC000), "burst"),       # flow known, no class yet
              ClaimEvent(key(2), C(0xC001), "burst"),       # flow has its own class already
              ClaimEvent(key(3), C(0xC005), "burst"),       # not a ready class: stale
              ClaimEvent(key(4), C(0xC002), "burst"))       # flow not seen yet: waits
    pp = _plan(PoolReport(7, ((BURST, 45),), 48, claims=claims, priorities=frozenset({9})),
               PoolHolding(7, cls), flows=[flow(key(1)), flow(key(2))], classed=[key(2)])
    assert pp.first[0].kind is OpKind.POOL_SWEEP and pp.first[0].priorities == {9}
    assert [(o.kind, o.key, o.classids) for o in pp.first[1:]] == [
        (OpKind.POOL_CLAIM, key(1), (C(0xC000),)), (OpKind.POOL_CLAIM, key(2), (C(0xC001),)),
        (OpKind.POOL_CLAIM, key(4), (C(0xC002),))]
    assert pp.dirty == {key(1), key(2)} and pp.rebind == {key(2)}
    assert (pp.stale, pp.bound, pp.released, dict(pp.bound_by_rule)) == (1, 3, 0, {"burst": 3})
    assert [(o.kind, o.count) for o in pp.fills] == [(OpKind.POOL_FILL, 3)]


def test_claims_no_flow_takes_are_given_back():
    now = 10**12
    wait = engine.CLAIM_WAIT_NS
    pending = {key(1): (C(0xC001), now - 1),              # its flow is planned: not shaped
               key(2): (C(0xC002), now - 1),              # its socket closed
               key(3): (C(0xC003), now - wait - 1),       # its flow never came
               key(4): (C(0xC004), now - 1),              # still waiting for its flow
               key(5): (C(0xC005), now - 1)}              # sock_diag's flow, no owner yet
    claims = (ClaimEvent(key(6), C(0xC006), "burst"),)  # a process no rule names: not shaped
    pp = _plan(PoolReport(7, (), 48, claims=claims, closed=(C(0xC002),)),
               PoolHolding(7, frozenset({C(0xC006)}), pending),
               flows=[flow(key(1)), flow(key(5), pid=0), flow(key(6), comm="other")],
               now_ns=now)
    released = [o.key for o in pp.first if o.kind is OpKind.POOL_RELEASE]
    assert released == [key(1), key(2), key(3), key(6)]
    assert pp.first[-1].kind is OpKind.POOL_CLOSED and pp.first[-1].classids == (C(0xC002),)
    assert (pp.released, pp.closed, pp.dirty) == (4, 1, set())


def test_a_rebound_flow_is_removed_then_added_in_one_plan():
    s = Shape("burst", RATE, RATE)
    ops = engine.plan({key(1): s, key(2): s}, {key(1): s, key(2): s, key(3): s},
                      rebind={key(1), key(9)})
    assert [(o.kind, o.key) for o in ops] == [(OpKind.REMOVE, key(1)), (OpKind.REMOVE, key(3)),
                                              (OpKind.ADD, key(1))]
    assert Op(OpKind.ADD, key(1), s) in ops


# ------------------------------------------- in-process: one writer, no I/O under the lock

class TrackedRLock:
    """The reconciler's lock, knowing which thread holds it."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner = None
        self._depth = 0

    def acquire(self, *a, **kw):
        got = self._lock.acquire(*a, **kw)
        if got:
            self._owner = threading.get_ident()
            self._depth += 1
        return got

    def release(self):
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()


@pytest.fixture
def watched(monkeypatch):
    """Every Reconciler's lock is tracked; the first-byte source's sleeps, sweeps and map
    accesses record a violation when the calling thread holds one."""
    locks, seen, bad = [], {"sleep": 0, "sweep": 0, "map": 0}, []

    def rlock():
        lk = TrackedRLock()
        locks.append(lk)
        return lk

    def check(what):
        if any(lk.held_here() for lk in locks):
            bad.append(what)

    def sleep(s):
        seen["sleep"] += 1
        check("sleep")
        time.sleep(s)

    def sweep():
        seen["sweep"] += 1
        check("socket_priorities")
        return {C(0xC000), 7}           # an open socket still carries pool id 0xc000

    def access(what):
        seen["map"] += 1
        check(f"map {what}")

    monkeypatch.setattr(reconciler, "threading", types.SimpleNamespace(RLock=rlock))
    monkeypatch.setattr(firstbyte, "time", types.SimpleNamespace(sleep=sleep,
                                                                 monotonic=time.monotonic))
    monkeypatch.setattr(firstbyte, "socket_priorities", sweep)
    return FakeFirstByte(pool_target=8, on_kernel_access=access), seen, bad


def test_claims_reach_the_flows_through_the_reconciler_with_no_io_under_its_lock(tmp_path,
                                                                                 watched):
    fb, seen, bad = watched
    tr, sd = FakeTracer(), FakeSockDiag()
    flows = {1: flow(key(1)), 2: flow(key(2)), 3: flow(key(3), comm="other")}
    rules = {"rs": RULES}

    def opened(i):
        sd.flows[flows[i].key] = flows[i]
        tr.push([FlowEvent(EventKind.OPEN, flows[i])])
    with inprocess_daemon(tmp_path, lambda: rules["rs"], tracer=tr, sockdiag=sd,
                          firstbyte=fb) as d:
        b = d.supervisor.backend
        wait_for(lambda: fb.live and fb.ready(0) == 8 and fb.ready(1) == 8, 5,
                 what="both kernel rules' pools filled, claims on")
        assert seen["sweep"] >= 1 and 0xC000 not in {c & 0xFFFF for c in fb.ring(0)}, \
            "the id an open socket carries is not handed out"
        # a claim, then its flow: the flow's ADD takes the claimed class; the pool is refilled
        cid = fb.claim(0, key(1))
        wait_for(lambda: key(1) in b.pool.claims, 5, what="the claim bound in the backend")
        opened(1)
        wait_for(lambda: b.flows.get(key(1), (0,))[0] == cid and fb.ready(0) == 8, 5,
                 what="the claimed class is the flow's, the pool refilled")
        # a flow that got its own class first: rebound to the class its socket sends into
        opened(2)
        wait_for(lambda: key(2) in b.flows, 5, what="flow 2 shaped")
        assert b.flows[key(2)][0] & 0xFFFF < 0xC000
        cid2 = fb.claim(0, key(2))
        wait_for(lambda: b.flows[key(2)][0] == cid2, 5, what="flow 2 rebound to its claim")
        # a claim of a flow no rule shapes is given back; its id waits for the socket
        opened(3)
        wait_for(lambda: d.reconciler.table.flows.get(key(3)) is not None, 5, what="flow 3 seen")
        cid3 = fb.claim(0, key(3))
        wait_for(lambda: fb.view().counters.released == 1 and not b.pool.claims, 5,
                 what="the unused claim released")
        assert key(3) not in b.flows and cid3 & 0xFFFF in b.pool.awaiting
        fb.close_socket(cid3, key(3))
        wait_for(lambda: cid3 & 0xFFFF not in b.pool.awaiting, 5, what="its id free again")
        c = fb.view().counters
        assert (c.bound, c.rebound, c.closed) == (3, 1, 1), c
        # a reload: the rings are drained and the ready classes reused with the new rates
        before = set(fb.ring(0)) | set(fb.ring(1))
        rules["rs"] = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                              (Rule("burst", BURST.match, 3 * RATE), UP, LATE))
        written = fb.rules_written
        assert d.reload().ok
        wait_for(lambda: fb.rules_written > written and fb.live and fb.ready(0) == 8, 5,
                 what="the pools remade for the new rules")
        assert set(fb.ring(0)) | set(fb.ring(1)) == before
        assert all(b.pool.classes[cid] in ("burst", "up") for cid in before)
        # a rebuild (a new bookkeeping): swept before the new pools are made, then remade
        sweeps, epoch = seen["sweep"], b.pool.epoch
        b.health = BackendHealth.LOST
        wait_for(lambda: b.pool.epoch != epoch, 5, what="the backend rebuilt")
        b.health = BackendHealth.OK
        wait_for(lambda: fb.live and fb.ready(0) == 8 and fb.ready(1) == 8
                 and set(b.pool.classes) == set(fb.ring(0)) | set(fb.ring(1)), 5,
                 what="the pools made anew")
        assert seen["sweep"] > sweeps and fb.view().ids_held == 1
        assert key(1) in b.flows and key(2) in b.flows     # the flows re-applied
    assert d.firstbyte_stage.firstbyte is fb and not fb.live      # shut down: drained
    assert not b.pool.classes, "a clean stop deletes the ready classes"
    assert seen["sleep"] >= 3 and seen["map"] > 50
    assert bad == [], f"done while holding the reconciler's lock: {sorted(set(bad))}"


# ------------------------------------------------ kernel: pool ops in one batch on real htb

@pytest.mark.kernel
def test_pool_ops_and_a_rebound_flow_go_to_the_kernel_in_one_batch(testbed):
    from flowpacer.kernel.backend import tc as tcb
    from flowpacer.kernel.backend.htb import HtbCodec
    from flowpacer.kernel.backend.pool import POOL_FIRST_MINOR
    from flowpacer.model import PoolOp
    from harness.testbed import in_netns
    tb = testbed

    def tc_lines(what):
        return tb.run(tb.server_ns, ["tc", what, "show", "dev", tb.server_if]).stdout.splitlines()

    def classes(_tb):
        return {ln.split()[2] for ln in tc_lines("class") if ln.startswith("class ")}

    def n_filters(_tb):
        return sum("flowid" in ln for ln in tc_lines("filter"))

    def hkey(_tb, lport, rport):
        return FlowKey(tb.server_v4, lport, tb.client_v4, rport)

    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, 125_000_000)
        b.setup()
    s = Shape("burst", RATE, RATE)
    name = lambda cid: f"f1f0:{cid & 0xFFFF:x}"       # noqa: E731
    with in_netns(tb.server_ns):
        res = b.apply([PoolOp(OpKind.POOL_FILL, "burst", s, count=3)])
        made = res.pool_made["burst"]
        assert len(made) == 3 and all(c & 0xFFFF >= POOL_FIRST_MINOR for c in made)
        assert {name(c) for c in made} <= classes(tb) and n_filters(tb) == 0
        k1, k2 = hkey(tb, 7100, 40001), hkey(tb, 7100, 40002)
        assert b.apply([Op(OpKind.ADD, k1, s)]).added == 1
        own = b.classid_of(k1)
        # the socket of k1 claimed made[0] after k1 got its own class: one plan rebinds it
        plan = [PoolOp(OpKind.POOL_CLAIM, classids=(made[0],), key=k1, at_ns=1)] \
            + engine.plan({k1: s}, {k1: s}, rebind={k1}) \
            + [PoolOp(OpKind.POOL_FILL, "burst", s, count=1)]
        res = b.apply(plan)
        assert not res.errors and (res.removed, res.added) == (1, 1)
        assert b.classid_of(k1) == made[0] and name(own) not in classes(tb)
        assert n_filters(tb) == 1 and len(res.pool_made["burst"]) == 1
        # a claim no flow takes is given back: its class goes, its id waits for the socket
        res = b.apply([PoolOp(OpKind.POOL_CLAIM, classids=(made[1],), key=k2, at_ns=1),
                       PoolOp(OpKind.POOL_RELEASE, key=k2)])
        assert name(made[1]) not in classes(tb) and made[1] & 0xFFFF in b.pool.awaiting
        # reuse with another rate, then delete the rest: nothing of the pool is left
        ready = sorted(b.pool.classes)
        res = b.apply([PoolOp(OpKind.POOL_CHANGE, "up", Shape("up", 2 * RATE, 2 * RATE),
                              classids=tuple(ready))])
        assert res.pool_made["up"] == ready and set(b.pool.classes.values()) == {"up"}
        b.apply([PoolOp(OpKind.POOL_DELETE, classids=tuple(ready))])
        assert not {name(c) for c in ready} & classes(tb) and not b.pool.classes
        assert b.apply([Op(OpKind.REMOVE, k1)]).removed == 1
        assert n_filters(tb) == 0
        b.teardown()
