"""One contract suite for every backend (``flowpacer.kernel.backend.contract.Backend``).

The cases take a *bed*: where a backend of one kind lives, how to make a new instance of it on
the same interface (a restart), how to look at what is left in the "kernel", and how to make
the kernel refuse one flow. Thin runners call every case with their bed:

- tests/test_backend_contract.py: ``FakeBed`` (harness/fakes.py, pure, fast) and ``TcBed`` with
  htb in a host testbed (marked ``kernel``);
- tests/guest/test_backend_contract.py: ``TcBed`` with psp in the VM (tests/test_vm.py boots it).

Cases: setup/teardown leaves nothing; apply is idempotent (add, change, remove each twice);
installed()/shape_of() agree with the plan; statistics are keyed by FlowKey (groups by GroupKey,
the default class by ClassRole.DEFAULT; no class id); a new instance on the same interface
adopts what the old one made; groups (client/total) where ``capabilities.groups`` says so, none
where it does not; a refused flow comes back as one line with the kernel's text and the other
flows of the plan still apply.
"""
from __future__ import annotations

import contextlib
import ipaddress
from typing import Callable, Dict, List, Optional, Tuple

from flowpacer.kernel.backend.contract import Backend, Pools, missing_members
from flowpacer.model import (ClassRole, ClassStats, FlowKey, Group, GroupKey, GroupKind, Op,
                             OpKind, Shape, SpareOp)

MBIT = 1_000_000 // 8
LINK_RATE_BPS = 1000 * MBIT
RULE = "contract"


# ------------------------------------------------------------------------------ beds

class FakeBed:
    """FakeBackends; the "kernel" that a new instance adopts is what the last one had (its flows
    and spares). ``spare_max``: spare classes kept, as htb's (issue 26)."""
    name = "fake"

    def __init__(self, spare_max: int = 0):
        from harness.fakes import FakeBackend
        self._cls = FakeBackend
        self.spare_max = spare_max
        self.last = None
        self.local = ipaddress.ip_address("10.0.0.1")
        self.remote = ipaddress.ip_address("10.0.0.2")
        self.remote_v6 = ipaddress.ip_address("fd00::2")
        self.local_v6 = ipaddress.ip_address("fd00::1")

    def ctx(self):
        return contextlib.nullcontext()

    def make(self) -> Backend:
        alive = self.last is not None and not self.last.torn_down
        left = self.last.installed() if alive else None
        b = self._cls("htb", "fake0", LINK_RATE_BPS, installed=left, spare_max=self.spare_max,
                      spares=self.last.spares if alive else ())
        b.setup()
        self.last = b
        return b

    def leftovers(self) -> List[str]:
        b = self.last
        return [] if b is None or b.torn_down else \
            [f"flow {k}" for k in b.flows] + [f"spare {h}" for h in b.spare_handles()]

    def objects(self, b) -> Tuple[int, int]:
        """(flow classes, filters) as ``harness.capture.kernel_objects`` counts them."""
        return len(b.flows), len(b.flows)

    def refuse(self, b, key: FlowKey) -> str:
        b.refuse.add(key)
        return "refused (test)"

    def unrefuse(self, b, key: FlowKey) -> None:
        b.refuse.discard(key)

    def make_busy(self, b, key: FlowKey) -> str:
        b.busy.add(key)
        return "busy (test)"

    def unbusy(self, b, key: FlowKey) -> None:
        b.busy.discard(key)

    def close(self) -> None:
        pass


class TcBed:
    """``TcBackend``s of one codec on a testbed's server interface (host: htb; VM: psp)."""

    def __init__(self, tb, codec_factory: Callable[[], object], name: str, spare_max: int = 0,
                 spare_from: Optional[int] = None):
        """``spare_max``/``spare_from``: TcBackend's spare classes (issue 26): at most
        ``spare_max``, kept once flows and spares number ``spare_from``."""
        from flowpacer.kernel.backend.handles import SPARE_FROM
        self.tb = tb
        self.codec_factory = codec_factory
        self.name = name
        self.spare_max = spare_max
        self.spare_from = SPARE_FROM if spare_from is None else spare_from
        self.local, self.remote = tb.server_v4, tb.client_v4
        self.local_v6, self.remote_v6 = tb.server_v6, tb.client_v6
        self.made: List[Backend] = []

    def ctx(self):
        from harness.testbed import in_netns
        return in_netns(self.tb.server_ns)

    def make(self) -> Backend:
        from flowpacer.kernel.backend.tc import TcBackend
        with self.ctx():
            b = TcBackend(self.codec_factory(), self.tb.server_if, LINK_RATE_BPS,
                          spare_max=self.spare_max, spare_from=self.spare_from)
            b.setup()
        self.made.append(b)
        return b

    def _tc(self, *what: str) -> str:
        return self.tb.run(self.tb.server_ns, ["tc", *what, "show", "dev", self.tb.server_if]).stdout

    def leftovers(self) -> List[str]:
        """flowpacer's objects on the interface: a root qdisc of handle f1f0:, its classes and
        filters."""
        out = [ln for ln in self._tc("qdisc").splitlines() if " f1f0: " in ln]
        out += [ln for ln in self._tc("class").splitlines() if " f1f0:" in ln]
        out += [ln for ln in self._tc("filter").splitlines() if "flowid f1f0:" in ln]
        return out

    def objects(self, b) -> Tuple[int, int]:
        """(flow classes, filters) in the kernel; a class without a filter counts unless ``b``
        keeps it as a spare (harness/capture.py; read over netlink: no tc process, which costs
        seconds under TCG)."""
        from harness.capture import NlProbe
        with self.ctx():
            spares = b.spare_handles()
        with NlProbe(self.tb) as probe:
            return probe.objects(spares)

    def refuse(self, b, key: FlowKey) -> str:
        """A class of someone else's at the id the backend gives ``key``'s class next: the
        kernel refuses the add (EEXIST, the generic layer gives no extack: its strerror is the
        kernel's text). Knows the tc backend's ids: this is the tc bed."""
        from flowpacer.kernel.backend.handles import MAJOR
        assert not b.spare_count(), "refuse: the next flow would get a spare, not a new id"
        minor = b.class_ids.peek()
        kind = self.codec_factory().qdisc_kind
        if kind == "htb":
            argv = ["htb", "rate", "3mbit"]
            parent = f"{MAJOR:x}:1"
        else:                       # psp: the guest's tc may not know psp: make it over netlink
            return self._refuse_psp(b, minor)
        self.tb.run(self.tb.server_ns, ["tc", "class", "add", "dev", self.tb.server_if,
                                        "parent", parent, "classid", f"{MAJOR:x}:{minor:x}",
                                        *argv])
        return "File exists"

    def _refuse_psp(self, b, minor: int) -> str:
        from flowpacer.kernel.backend.handles import MAJOR, QDISC_HANDLE
        from flowpacer.kernel.tc import nl, psp as enc
        from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, RTM_NEWTCLASS, Request,
                                            RtnlSocket)
        with self.ctx(), RtnlSocket() as rt:
            rt.request(Request(RTM_NEWTCLASS, NLM_F_CREATE | NLM_F_EXCL,
                               nl.tcmsg(b.ifindex, nl.tc_handle(MAJOR, minor), QDISC_HANDLE)
                               + enc.class_options(3 * MBIT, 3 * MBIT), "foreign psp class"))
        return "File exists"

    def unrefuse(self, b, key: FlowKey) -> None:
        """Nothing to undo: the backend does not use the refused id again (it is not ours)."""

    BUSY_PRIO = 7           # not one of flowpacer's filter prefs (backend/filters.py PRIO)

    def make_busy(self, b, key: FlowKey) -> str:
        """Someone else's filter pointing at ``key``'s class: the kernel refuses to delete the
        class (EBUSY) and says why in its extack; returns that text."""
        handle = next(h for k, h, _s in b.flows_snapshot() if k == key)
        self.tb.run(self.tb.server_ns, [
            "tc", "filter", "add", "dev", self.tb.server_if, "parent", "f1f0:", "protocol", "ip",
            "prio", str(self.BUSY_PRIO), "u32", "match", "ip", "dst", "192.0.2.99/32",
            "flowid", handle])
        return {"htb": "HTB class in use",
                "psp": "class is used by filters: delete them first"}[self.name]

    def unbusy(self, b, key: FlowKey) -> None:
        self.tb.run(self.tb.server_ns, ["tc", "filter", "del", "dev", self.tb.server_if,
                                        "parent", "f1f0:", "protocol", "ip", "prio",
                                        str(self.BUSY_PRIO)])

    def close(self) -> None:
        for b in self.made:
            with self.ctx():
                b.teardown()
                b.close()
        self.made.clear()


# ------------------------------------------------------------------------------ helpers

def keys(bed, n: int, first_port: int = 40000) -> List[FlowKey]:
    """``n`` flows: IPv4 and IPv6 alternately, one local port, remote ports from
    ``first_port``."""
    out = []
    for i in range(n):
        if i % 2:
            out.append(FlowKey(bed.local_v6, 443, bed.remote_v6, first_port + i))
        else:
            out.append(FlowKey(bed.local, 443, bed.remote, first_port + i))
    return out


def shape(rate_mbit: int, ceil_mbit: Optional[int] = None, groups=()) -> Shape:
    return Shape(RULE, rate_mbit * MBIT, (ceil_mbit or rate_mbit) * MBIT, tuple(groups))


def run(bed, b, plan):
    with bed.ctx():
        return b.apply(plan)


def call(bed, fn, *args):
    with bed.ctx():
        return fn(*args)


def _agree(bed, b, want: Dict[FlowKey, Shape]) -> None:
    with bed.ctx():
        got = b.installed()
        assert got == want, f"installed() {got} != plan {want}"
        for k, s in want.items():
            assert b.shape_of(k) == s
        snap = b.flows_snapshot()
    assert {k for k, _h, _s in snap} == set(want)
    assert all(isinstance(h, str) and h for _k, h, _s in snap), snap


# ------------------------------------------------------------------------------ cases

def case_keeps_the_protocol(bed):
    b = bed.make()
    assert missing_members(b, Backend) == [], missing_members(b, Backend)
    assert isinstance(b, Backend)
    caps = b.capabilities
    assert caps.has_classes in (True, False) and caps.groups in (True, False)
    assert b.link_rate_bps == LINK_RATE_BPS and b.kind.value == b.name
    if caps.pools:           # first-byte pools declared: their protocol is kept too
        assert missing_members(b, Pools) == [], missing_members(b, Pools)


def case_setup_teardown_leaves_nothing(bed):
    b = bed.make()
    ks = keys(bed, 4)
    res = run(bed, b, [Op(OpKind.ADD, k, shape(2 + i)) for i, k in enumerate(ks)])
    assert (res.added, res.errors) == (4, [])
    assert bed.leftovers(), "set up and with flows, the backend left nothing to see"
    call(bed, b.teardown)
    assert bed.leftovers() == []
    with bed.ctx():
        assert b.installed() == {}


def case_apply_is_idempotent(bed):
    b = bed.make()
    ks = keys(bed, 3)
    want = {k: shape(2 + i, 4 + i) for i, k in enumerate(ks)}
    plan = [Op(OpKind.ADD, k, s) for k, s in want.items()]
    res = run(bed, b, plan)
    assert (res.added, res.changed, res.removed, res.errors) == (3, 0, 0, [])
    res = run(bed, b, plan)                       # the same adds again: nothing to do
    assert (res.added, res.changed, res.removed, res.errors) == (0, 0, 0, [])
    _agree(bed, b, want)
    want[ks[0]] = shape(7, 9)
    change = [Op(OpKind.CHANGE, ks[0], want[ks[0]])]
    assert (run(bed, b, change).changed, run(bed, b, change).changed) == (1, 0)
    _agree(bed, b, want)
    remove = [Op(OpKind.REMOVE, ks[1])]
    del want[ks[1]]
    r1, r2 = run(bed, b, remove), run(bed, b, remove)
    assert (r1.removed, r1.errors, r2.removed, r2.errors) == (1, [], 0, [])
    _agree(bed, b, want)
    # a change of a flow it does not have is an error of that op alone
    res = run(bed, b, [Op(OpKind.CHANGE, ks[1], shape(3)), Op(OpKind.REMOVE, ks[2])])
    assert res.removed == 1 and len(res.errors) == 1 and res.errors[0].op.key == ks[1]
    del want[ks[2]]
    _agree(bed, b, want)


def case_installed_and_shape_of_agree_with_the_plan(bed):
    from flowpacer.policy import engine
    b = bed.make()
    ks = keys(bed, 6)
    want = {k: shape(1 + i, 2 + i) for i, k in enumerate(ks)}
    for step in (want, {k: want[k] for k in ks[::2]},
                 {**{k: want[k] for k in ks[::2]}, ks[1]: shape(5)}, {}):
        with bed.ctx():
            res = b.apply(engine.plan(step, b.installed()))
        assert res.errors == []
        _agree(bed, b, step)


def case_stats_are_keyed_by_flow(bed):
    b = bed.make()
    ks = keys(bed, 3)
    assert run(bed, b, [Op(OpKind.ADD, k, shape(2)) for k in ks]).errors == []
    with bed.ctx():
        ch = b.open_stats_channel()
    try:
        with bed.ctx():
            st = b.class_stats(ch)
            flows = b.stats()
    finally:
        ch.close()
    assert set(flows) == set(ks)
    assert all(isinstance(v, ClassStats) for v in st.values())
    assert {k for k in st if isinstance(k, FlowKey)} == set(ks)
    bad = [k for k in st if not isinstance(k, (FlowKey, GroupKey, ClassRole))]
    assert bad == [], f"statistics keyed by something else than flows, groups, roles: {bad}"
    assert ClassRole.DEFAULT in st


def case_a_new_instance_adopts(bed):
    b1 = bed.make()
    ks = keys(bed, 4)
    want = {k: shape(2 + i, 6) for i, k in enumerate(ks)}
    assert run(bed, b1, [Op(OpKind.ADD, k, s) for k, s in want.items()]).errors == []
    b2 = bed.make()                 # a restart: a new instance on the same interface
    with bed.ctx():
        got = b2.installed()
    assert set(got) == set(ks)
    assert {k: (s.rate_bps, s.ceil_bps) for k, s in got.items()} == \
        {k: (s.rate_bps, s.ceil_bps) for k, s in want.items()}
    # the adopted flows are b2's: planned again (relabelled) and removed without leftovers
    from flowpacer.policy import engine
    with bed.ctx():
        res = b2.apply(engine.plan(want, got))
    assert res.errors == [] and res.added == 0
    _agree(bed, b2, want)
    res = run(bed, b2, [Op(OpKind.REMOVE, k) for k in ks])
    assert (res.removed, res.errors) == (4, [])
    call(bed, b2.teardown)
    assert bed.leftovers() == []


def case_groups_where_declared(bed):
    b = bed.make()
    ks = keys(bed, 4)
    client = f"{RULE}/{bed.remote}/32"
    g = (Group(GroupKind.RULE, RULE, 30 * MBIT, 30 * MBIT),
         Group(GroupKind.CLIENT, client, 20 * MBIT, 20 * MBIT))
    v4 = [k for k in ks if k.family == 4]
    want = {k: shape(8, 16, g) for k in v4}
    res = run(bed, b, [Op(OpKind.ADD, k, s) for k, s in want.items()])
    assert (res.added, res.errors) == (len(v4), [])
    _agree(bed, b, want)
    with bed.ctx():
        views = b.group_views()
        st = b.class_stats()
    if not b.capabilities.groups:
        assert views == () and not any(isinstance(k, GroupKey) for k in st)
        return
    assert {(v.kind, v.id) for v in views} == {(GroupKind.RULE, RULE), (GroupKind.CLIENT, client)}
    assert all(isinstance(v.handle, str) and v.handle for v in views)
    assert {GroupKey(GroupKind.RULE, RULE), GroupKey(GroupKind.CLIENT, client)} <= set(st)
    rule_view = next(v for v in views if v.kind is GroupKind.RULE)
    assert 0 < rule_view.rate_bps <= rule_view.ceil_bps <= 30 * MBIT, rule_view
    # the last flows go, and their groups with them
    res = run(bed, b, [Op(OpKind.REMOVE, k) for k in v4])
    assert (res.removed, res.errors) == (len(v4), [])
    with bed.ctx():
        assert b.group_views() == ()


def case_a_refusal_is_one_line_and_the_rest_applies(bed):
    b = bed.make()
    ks = keys(bed, 3)
    text = bed.refuse(b, ks[0])
    res = run(bed, b, [Op(OpKind.ADD, k, shape(2)) for k in ks])
    assert res.added == 2, res
    assert [e.op.key for e in res.errors] == [ks[0]]
    reason = res.errors[0].reason
    assert "\n" not in reason and text in reason, reason
    with bed.ctx():
        assert set(b.installed()) == set(ks[1:])
    # the refused flow is retried by the next pass; the others are untouched by it
    bed.unrefuse(b, ks[0])
    res = run(bed, b, [Op(OpKind.ADD, ks[0], shape(2))])
    assert res.errors == [] and res.added == 1
    _agree(bed, b, {k: shape(2) for k in ks})


def case_a_refused_remove_carries_the_kernels_extack(bed):
    b = bed.make()
    ks = keys(bed, 4)
    assert run(bed, b, [Op(OpKind.ADD, k, shape(2)) for k in ks[:2]]).errors == []
    text = bed.make_busy(b, ks[0])
    res = run(bed, b, [Op(OpKind.REMOVE, ks[0]), Op(OpKind.REMOVE, ks[1]),
                       Op(OpKind.ADD, ks[2], shape(3)), Op(OpKind.ADD, ks[3], shape(3))])
    assert (res.removed, res.added) == (1, 2), res
    assert [e.op.key for e in res.errors] == [ks[0]]
    reason = res.errors[0].reason
    assert "\n" not in reason and text in reason, reason
    with bed.ctx():
        assert set(b.installed()) == {ks[0], ks[2], ks[3]}
    bed.unbusy(b, ks[0])
    res = run(bed, b, [Op(OpKind.REMOVE, ks[0])])
    assert (res.removed, res.errors) == (1, [])
    _agree(bed, b, {k: shape(3) for k in ks[2:]})


def case_closed_flows_classes_are_spares_or_gone(bed):
    """A closed flow's class is deleted or kept as a spare (issue 26), never left otherwise: the
    kernel holds a class per installed flow plus the spares the backend lists, which new flows
    get; a new instance adopts the spares; teardown leaves nothing."""
    b = bed.make()
    ks = keys(bed, 10)
    assert run(bed, b, [Op(OpKind.ADD, k, shape(2)) for k in ks[:6]]).errors == []
    with bed.ctx():
        before = {h for _k, h, _s in b.flows_snapshot()}
    res = run(bed, b, [Op(OpKind.REMOVE, k) for k in ks[:4]])
    assert (res.removed, res.errors) == (4, [])

    def accounted(flows):
        with bed.ctx():
            n, handles = b.spare_count(), b.spare_handles()
            live = {h for _k, h, _s in b.flows_snapshot()}
        assert n == len(handles) and set(handles).isdisjoint(live), (handles, live)
        assert bed.objects(b) == (flows, flows), (bed.objects(b), handles, bed.leftovers())
        return set(handles)
    spares = accounted(2)
    assert spares <= before and len(spares) == min(4, bed.spare_max), (spares, bed.spare_max)
    # new flows get the spares first (changed to their rates), then new classes
    res = run(bed, b, [Op(OpKind.ADD, k, shape(3, 5)) for k in ks[6:10]])
    assert (res.added, res.errors) == (4, [])
    with bed.ctx():
        got = {h for k, h, _s in b.flows_snapshot() if k in ks[6:10]}
    assert spares <= got and accounted(6) == set()
    _agree(bed, b, {**{k: shape(2) for k in ks[4:6]}, **{k: shape(3, 5) for k in ks[6:10]}})
    assert run(bed, b, [Op(OpKind.REMOVE, k) for k in ks[4:6]]).removed == 2
    spares = accounted(4)
    b2 = bed.make()                 # a restart adopts the flows and the spares
    with bed.ctx():
        assert set(b2.installed()) == set(ks[6:10]) and set(b2.spare_handles()) == spares
    b = b2
    res = run(bed, b, [Op(OpKind.ADD, ks[0], shape(4))])
    assert (res.added, res.errors) == (1, [])
    with bed.ctx():
        assert b.spare_count() == max(0, len(spares) - 1)
    accounted(5)
    call(bed, b.teardown)
    assert bed.leftovers() == []
    with bed.ctx():
        assert b.installed() == {} and b.spare_count() == 0 and b.spare_handles() == ()


def case_ready_spares_are_made_and_taken(bed):
    """Ready spare classes (issue 26, ``ready_classes``): a ``SpareOp`` makes classes without a
    filter, in the kernel and listed as spares, up to the spares the backend keeps (a backend
    that declares none says so in one line and makes nothing); new flows take them, changed to
    their rates; teardown leaves nothing."""
    b = bed.make()
    res = run(bed, b, [SpareOp(5, shape(1), 5)])
    with bed.ctx():
        n, handles = b.spare_count(), set(b.spare_handles())
    if not b.capabilities.spares:
        assert (res.spares_made, n, bed.objects(b)) == (0, 0, (0, 0)), res
        assert len(res.spare_errors) == 1 and "\n" not in res.spare_errors[0], res.spare_errors
    else:
        want = min(5, bed.spare_max)
        assert (res.spares_made, n, len(handles), res.spare_errors) == (want, want, want, []), res
        left = "\n".join(bed.leftovers())
        assert all(h in left for h in handles), (handles, left)   # the classes are there
        assert bed.objects(b) == (0, 0)         # and no flow's, no filter
        more = run(bed, b, [SpareOp(1, shape(1), 5)])           # none beyond spare_max
        if want == bed.spare_max:
            assert (more.spares_made, more.spare_errors) == (0, []), more
        ks = keys(bed, want + 1)
        res = run(bed, b, [Op(OpKind.ADD, k, shape(3, 5)) for k in ks])
        assert (res.added, res.errors) == (want + 1, [])
        with bed.ctx():
            got = {h for _k, h, _s in b.flows_snapshot()}
            assert handles <= got and b.spare_count() == 0
        _agree(bed, b, {k: shape(3, 5) for k in ks})
        # a closed flow's class is a spare again (the target is above the spares)
        res = run(bed, b, [Op(OpKind.REMOVE, ks[0])])
        with bed.ctx():
            assert (res.removed, b.spare_count()) == (1, 1), res
        assert bed.objects(b) == (want, want)
    call(bed, b.teardown)
    assert bed.leftovers() == []
    with bed.ctx():
        assert b.installed() == {} and b.spare_count() == 0


CASES = [case_keeps_the_protocol, case_setup_teardown_leaves_nothing, case_apply_is_idempotent,
         case_installed_and_shape_of_agree_with_the_plan, case_stats_are_keyed_by_flow,
         case_a_new_instance_adopts, case_groups_where_declared,
         case_a_refusal_is_one_line_and_the_rest_applies,
         case_a_refused_remove_carries_the_kernels_extack,
         case_closed_flows_classes_are_spares_or_gone, case_ready_spares_are_made_and_taken]


def case_ids() -> List[str]:
    return [c.__name__[len("case_"):] for c in CASES]
