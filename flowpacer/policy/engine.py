"""The engine: pure functions from (live flows, rules) to a plan of backend operations.

No I/O, no clock, no kernel: everything here is decided from its arguments, so it is tested with
plain values.
"""
from __future__ import annotations

import fnmatch
import ipaddress
from dataclasses import dataclass, field
from typing import (Collection, Dict, FrozenSet, Iterable, List, Mapping, Optional, Set, Tuple)

from flowpacer.model import (DEFAULT_IDLE_TIMEOUT_NS, Direction, Flow, FlowKey, Group, GroupKind,
                             IPAddress, Op, OpKind, PoolHolding, PoolOp, PoolReport, Protocol,
                             Rule, RuleSet, Shape, SpareOp)

COMM_LEN = 15      # TASK_COMM_LEN - 1: what the kernel reports of a process name

_GLOB_CHARS = set("*?[")


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` may match more than itself (fnmatch's special characters)."""
    return bool(_GLOB_CHARS & set(pattern))


_NAMES_MATCHED: Dict[Tuple[str, Tuple[str, ...]], bool] = {}


def names_match(name: str, patterns: Tuple[str, ...]) -> bool:
    """Whether ``name`` matches one of the globs ``patterns`` (``fnmatch.fnmatchcase``),
    remembered: a burst's thousands of flows are a few processes, and each flow's rule is
    asked again at every plan (issue 26's profile: the globs' matching was most of the
    engine's time). A pure function's memo, bounded."""
    k = (name, patterns)
    hit = _NAMES_MATCHED.get(k)
    if hit is None:
        hit = any(fnmatch.fnmatchcase(name, p) for p in patterns)
        if len(_NAMES_MATCHED) >= 4096:
            _NAMES_MATCHED.clear()
        _NAMES_MATCHED[k] = hit
    return hit


def mismatches(rule: Rule, flow: Flow, every: bool = False) -> Tuple[str, ...]:
    """The fields of ``rule``'s match that ``flow`` fails, () when the rule matches it. The one
    matcher: ``rule_matches`` (which flow gets which rule) and ``explain`` (why) both ask it.
    ``every``: all failing fields (explain), else the first one found (matching)."""
    m = rule.match
    out: Tuple[str, ...] = ()
    if m.protocol is not Protocol.ANY and m.protocol is not flow.key.protocol:
        if not every:
            return ("protocol",)
        out += ("protocol",)
    if m.direction is not Direction.ANY and m.direction is not flow.direction:
        if not every:
            return ("direction",)
        out += ("direction",)
    if m.process and not names_match(flow.proc.comm, m.process):
        if not every:
            return ("process",)
        out += ("process",)
    if m.exe and not (flow.proc.exe and names_match(flow.proc.exe, m.exe)):
        if not every:
            return ("exe",)
        out += ("exe",)
    if m.user and flow.proc.uid not in m.user:
        if not every:
            return ("user",)
        out += ("user",)
    k = flow.key
    if k.local_port not in m.local_port:
        if not every:
            return ("local_port",)
        out += ("local_port",)
    if k.remote_port not in m.remote_port:
        if not every:
            return ("remote_port",)
        out += ("remote_port",)
    if m.remote and not any(k.remote_addr.version == n.version and k.remote_addr in n
                            for n in m.remote):
        out += ("remote",)
    return out


def rule_matches(rule: Rule, flow: Flow) -> bool:
    return not mismatches(rule, flow)


def first_match(rules: Iterable[Rule], flow: Flow) -> Optional[Rule]:
    for r in rules:
        if rule_matches(r, flow):
            return r
    return None


@dataclass(frozen=True)
class Explanation:
    """Why ``flow`` gets the rule it gets (``explain``): the rules before the winner that do
    not match it, each with every field it fails; ``unknown``: fields of a described flow that
    were not given (a rule failing only those may or may not match, and the walk goes on)."""
    flow: Flow
    rule: Optional[Rule]                                   # the winner, None: no rule matches
    index: int                                             # the winner's position, -1: none
    passed: Tuple[Tuple[Rule, Tuple[str, ...]], ...]       # (rule, failing fields), in order
    unknown: FrozenSet[str] = frozenset()

    def undecided(self, fails: Tuple[str, ...]) -> bool:
        """Whether a rule that fails ``fails`` fails only on fields that were not given."""
        return bool(fails) and set(fails) <= self.unknown


def explain(rules: Iterable[Rule], flow: Flow, unknown: Collection[str] = ()) -> Explanation:
    """``first_match`` with its reasons: the same walk over the same matcher (``mismatches``),
    keeping what each rule before the winner fails."""
    passed = []
    for i, r in enumerate(rules):
        fails = mismatches(r, flow, every=True)
        if not fails:
            return Explanation(flow, r, i, tuple(passed), frozenset(unknown))
        passed.append((r, fails))
    return Explanation(flow, None, -1, tuple(passed), frozenset(unknown))


def _names_cover(outer: Tuple[str, ...], inner: Tuple[str, ...]) -> bool:
    """Whether every name the globs ``inner`` match is matched by one of ``outer`` (only when
    certain: a glob of ``inner`` must be one of ``outer`` itself, or ``outer`` holds '*')."""
    if not outer:
        return True
    if not inner:
        return False
    if "*" in outer:
        return True
    return all(p in outer or (not is_glob(p) and any(fnmatch.fnmatchcase(p, o) for o in outer))
               for p in inner)


def _ports_cover(outer, inner) -> bool:
    if not outer.ranges:
        return True
    if not inner.ranges:
        return False
    return all(all(p in outer for p in range(lo, hi + 1)) if hi - lo < 4096 else
               any(o_lo <= lo and hi <= o_hi for o_lo, o_hi in outer.ranges)
               for lo, hi in inner.ranges)


def covers(outer: Rule, inner: Rule) -> bool:
    """Whether every flow ``inner`` matches is matched by ``outer`` too (field by field, only
    when certain): ``outer`` before ``inner`` shadows it, ``inner`` can never win."""
    a, b = outer.match, inner.match
    if a.protocol is not Protocol.ANY and a.protocol is not b.protocol:
        return False
    if a.direction is not Direction.ANY and a.direction is not b.direction:
        return False
    if not (_names_cover(a.process, b.process) and _names_cover(a.exe, b.exe)):
        return False
    if a.user and not (b.user and set(b.user) <= set(a.user)):
        return False
    if not (_ports_cover(a.local_port, b.local_port) and _ports_cover(a.remote_port, b.remote_port)):
        return False
    if a.remote and not (b.remote and all(
            any(n.version == o.version and n.subnet_of(o) for o in a.remote) for n in b.remote)):
        return False
    return True


def client_of(rule: Rule, remote: IPAddress) -> str:
    """The client a remote address is for ``rule``'s client_rate: the address masked to the
    rule's prefix for its family (``FlowKey.wire`` already made IPv4-mapped addresses IPv4)."""
    bits = rule.client_prefix[0] if remote.version == 4 else rule.client_prefix[1]
    return str(ipaddress.ip_network((remote, bits), strict=False))


def groups_of(rule: Rule, key: Optional[FlowKey]) -> Tuple[Group, ...]:
    """A flow's groups, outermost first: its rule's total, then its client's share of the rule.
    A group is a cap: its ceil is its rate."""
    out = []
    if rule.total_rate_bps is not None:
        out.append(Group(GroupKind.RULE, rule.name, rule.total_rate_bps, rule.total_rate_bps))
    if rule.client_rate_bps is not None and key is not None:
        out.append(Group(GroupKind.CLIENT, f"{rule.name}/{client_of(rule, key.remote_addr)}",
                         rule.client_rate_bps, rule.client_rate_bps))
    return tuple(out)


def shape_of(rule: Rule, key: Optional[FlowKey] = None) -> Shape:
    """The send shape of a flow of ``rule``; with aggregates, ``key`` says which client it is.
    Only for a rule that ``sends`` (a receive-only rule has no send shape)."""
    if rule.rate_bps is None:
        raise ValueError(f"rule {rule.name!r} is receive-only: it has no send shape")
    return Shape(rule.name, rule.rate_bps, max(rule.ceil_bps or rule.rate_bps, rule.rate_bps),
                 groups_of(rule, key) if rule.has_groups else ())


def desired(flows: Mapping[FlowKey, Flow], ruleset: RuleSet) -> Dict[FlowKey, Shape]:
    """Each live flow that a rule matches, with its rule's shape (first match wins). A flow whose
    first matching rule is receive-only gets none: its send side is not shaped, no class at all
    (it does not fall through to a later rule)."""
    out = {}
    plain: Dict[int, Shape] = {}     # a rule without aggregates gives all its flows one shape
    for key, flow in flows.items():
        r = first_match(ruleset.rules, flow)
        if r is not None and r.sends:
            if r.has_groups:
                out[key] = shape_of(r, key)
                continue
            s = plain.get(id(r))
            if s is None:
                s = plain[id(r)] = shape_of(r)
            out[key] = s
    return out


def receive_shape_of(rule: Rule) -> Optional[Shape]:
    """What a flow of ``rule`` should get on the receive side (issue 17), None when the rule
    does not shape receiving. Aggregates cover the send side only."""
    if rule.receive_rate_bps is None:
        return None
    rate = rule.receive_rate_bps
    return Shape(rule.name, rate, max(rule.receive_ceil_bps or rate, rate))


def desired_receive(flows: Mapping[FlowKey, Flow], ruleset: RuleSet) -> Dict[FlowKey, Shape]:
    """Each live flow whose first matching rule has a receive_rate, with its receive shape
    (keyed by the flow's own key: the receive backend reverses it for its filters)."""
    out = {}
    for key, flow in flows.items():
        r = first_match(ruleset.rules, flow)
        if r is not None and r.receive_rate_bps is not None:
            out[key] = receive_shape_of(r)
    return out


# FlowKey's total order as a sort key: one tuple per key instead of two per comparison
_ORDER = FlowKey.sort_key.fget


def plan(want: Mapping[FlowKey, Shape], have: Mapping[FlowKey, Shape],
         rebind: Collection[FlowKey] = ()) -> List[Op]:
    """Operations that turn ``have`` into ``want``: removals first (they free room), then rate
    changes (in place, the class and its queue stay), then additions; each group in key order
    (``FlowKey``'s total order: IPv4 and IPv6 keys mix). A flow whose rates are right but whose
    rule is not (adopted after a restart, or a rule renamed) is relabelled: nothing for the
    kernel, but status and metrics name the rule that shapes it. The same goes for a flow whose
    groups have the kernel's rates but other names (``Shape.rates`` is what the kernel sees).
    Flows of rules with aggregates change when their groups' rates or levels change: the backend
    moves them under their new parents.

    ``rebind``: flows whose socket claimed a first-byte class after they got a class of their
    own (issue 16): their class goes (REMOVE) and their ADD takes the claimed one."""
    rebind = {k for k in rebind if k in have and k in want}
    removes = [Op(OpKind.REMOVE, k) for k in sorted((have.keys() - want.keys()) | rebind,
                                                    key=_ORDER)]
    changes, relabels, adds = [], [], []
    for k in sorted(want, key=_ORDER):
        s = want[k]
        cur = None if k in rebind else have.get(k)
        if cur is None:
            adds.append(Op(OpKind.ADD, k, s))
        elif cur.rates != s.rates:
            changes.append(Op(OpKind.CHANGE, k, s))
        elif cur != s:
            relabels.append(Op(OpKind.RELABEL, k, s))
    return removes + changes + relabels + adds


def idle_expired(flows: Mapping[FlowKey, Flow], idle_since: Mapping[FlowKey, int],
                 ruleset: RuleSet, now_ns: int) -> List[FlowKey]:
    """The UDP flows that sent nothing for their rule's ``idle_timeout``: ``idle_since`` is the
    last datagram's time of the flows the tracer reported idle. A flow no rule matches goes after
    the default timeout (it has no class; this only keeps the table small)."""
    out = []
    for key, last_ns in idle_since.items():
        flow = flows.get(key)
        if flow is None or key.protocol is not Protocol.UDP:
            continue
        r = first_match(ruleset.rules, flow)
        timeout = r.idle_timeout_ns if r is not None else DEFAULT_IDLE_TIMEOUT_NS
        if now_ns - last_ns >= timeout:
            out.append(key)
    return sorted(out)


def udp_idle_timeouts(ruleset: RuleSet) -> Tuple[int, int]:
    """(shortest, longest) idle timeout a UDP flow can have under ``ruleset``: the tracer reports
    a flow idle after the shortest, and forgets it after the longest (``idle_expired`` decides
    in between, per rule)."""
    ts = [r.idle_timeout_ns for r in ruleset.rules
          if r.match.protocol in (Protocol.UDP, Protocol.ANY)]
    ts.append(DEFAULT_IDLE_TIMEOUT_NS)     # flows no rule matches
    return min(ts), max(ts)


def watch_filter(ruleset: RuleSet) -> Tuple[Optional[FrozenSet[str]], Optional[FrozenSet[int]]]:
    """What the tracer can filter on in the kernel: (comms, uids), or (None, None) for "all".

    A flow of a process passes the kernel filter if its comm is in ``comms`` or its uid in
    ``uids``; this must let through every flow some rule could match. A rule naming literal
    process names is covered by them, one naming users by the uids; any other rule (exe only,
    globs, ports only) needs every process watched.
    """
    comms, uids = set(), set()
    for r in ruleset.rules:
        m = r.match
        literal = m.process and not any(is_glob(p) for p in m.process)
        if literal:
            comms.update(p[:COMM_LEN] for p in m.process)
        elif m.user:
            uids.update(m.user)
        else:
            return None, None
    return frozenset(comms), frozenset(uids)


# ------------------------------------------------------------ first-byte pools (issue 16)

CLAIM_WAIT_NS = 5_000_000_000   # a claim whose flow has not shown up by then is given back


@dataclass
class PoolPlan:
    """``engine.plan_pools``'s answer: pool ops to apply before the flows' ops (``first``:
    sweep, claims, releases, closes, deletes) and after them (``fills``), the flows to plan
    now (``dirty``: their ADD takes their claim; ``rebind``: they had a class already), and
    what became of the claims."""
    first: List[PoolOp] = field(default_factory=list)
    fills: List[PoolOp] = field(default_factory=list)
    dirty: Set[FlowKey] = field(default_factory=set)
    rebind: Set[FlowKey] = field(default_factory=set)
    stale: int = 0
    bound: int = 0
    bound_by_rule: Dict[str, int] = field(default_factory=dict)
    released: int = 0
    closed: int = 0


def _sends_by(flow: Flow, ruleset: RuleSet) -> bool:
    r = first_match(ruleset.rules, flow)
    return r is not None and r.sends


def plan_pools(report: PoolReport, holding: PoolHolding, flows: Mapping[FlowKey, Flow],
               classed: Collection[FlowKey], ruleset: RuleSet, now_ns: int,
               claim_wait_ns: int = CLAIM_WAIT_NS) -> PoolPlan:
    """The pool ops of one first-byte round, from the source's ``report`` (claims, closed
    sockets, a sweep, each kernel rule's ready count, classes taken back), the backend's pool
    (``holding``), the live flows, the claim keys that have a class of their own (``classed``)
    and the rules. Pure.

    A claim counts only when its class is one of the pool's ready ones (else it is stale: the
    pool was remade since). A claimed flow the rules shape is planned now and its ADD takes
    the class; a claim is given back when its flow is planned and not shaped by it (no rule
    wants it, or its ADD failed), when its socket closed, or after ``claim_wait_ns`` without
    its flow. Each pool is topped up to ``report.target``: classes taken back at a reload are
    reused first (their rates changed), the rest made; unused ones deleted."""
    pp = PoolPlan()
    if report.epoch != holding.epoch:
        pp.stale = len(report.claims)     # ids of another bookkeeping: nothing to do with them
        return pp
    if report.priorities is not None:
        pp.first.append(PoolOp(OpKind.POOL_SWEEP, priorities=frozenset(report.priorities)))
    ready = set(holding.ready)
    pending = dict(holding.claims)
    new: Dict[FlowKey, int] = {}
    for c in report.claims:
        if c.classid not in ready:
            pp.stale += 1
            continue
        ready.discard(c.classid)
        pp.bound += 1
        pp.bound_by_rule[c.rule] = pp.bound_by_rule.get(c.rule, 0) + 1
        pp.first.append(PoolOp(OpKind.POOL_CLAIM, classids=(c.classid,), key=c.key,
                               at_ns=now_ns))
        pending[c.key] = (c.classid, now_ns)
        new[c.key] = c.classid
    closed = set(report.closed)
    for key in sorted(pending):
        cid, since = pending[key]
        f = flows.get(key)
        # a flow sock_diag found before its accept() has no owner yet: the rules cannot be
        # judged on it, the tracer's OPEN will tell
        planned = f is not None and f.proc.pid != 0
        if key in new and f is not None:
            if _sends_by(f, ruleset):
                pp.dirty.add(key)
                if key in classed:
                    pp.rebind.add(key)
                continue
        if planned or cid in closed or now_ns - since > claim_wait_ns:
            pp.first.append(PoolOp(OpKind.POOL_RELEASE, key=key))
            pp.released += 1
    if closed:
        pp.first.append(PoolOp(OpKind.POOL_CLOSED, classids=tuple(sorted(closed))))
        pp.closed = len(closed)
    # a detached program takes nothing any more: every ready class goes (also ones a grant
    # that never reached the rings made)
    spare = sorted(ready) if report.closing else [c for c in report.returned if c in ready]
    for rule, n_ready in report.pools:
        need = report.target - n_ready
        if need <= 0:
            continue
        shape = shape_of(rule)
        reuse, spare = spare[:need], spare[need:]
        if reuse:
            pp.fills.append(PoolOp(OpKind.POOL_CHANGE, rule.name, shape,
                                   classids=tuple(reuse)))
        if need > len(reuse):
            pp.fills.append(PoolOp(OpKind.POOL_FILL, rule.name, shape, count=need - len(reuse)))
    if spare:
        pp.first.append(PoolOp(OpKind.POOL_DELETE, classids=tuple(spare)))
    return pp


# a ready spare's rates when no rule sends (changed to a flow's when one takes it)
SPARE_RATE_BPS = 125_000


def spare_shape(ruleset: RuleSet) -> Shape:
    """The rates ready spare classes are made with: the first sending rule's (a burst's flows
    most likely get it; a spare's rates are changed to its flow's whatever they were)."""
    for r in ruleset.rules:
        if r.rate_bps is not None:
            return Shape("", r.rate_bps, max(r.ceil_bps or r.rate_bps, r.rate_bps))
    return Shape("", SPARE_RATE_BPS, SPARE_RATE_BPS)


def plan_spares(ruleset: RuleSet, flows: int, spares: int, batch: int,
                told: int) -> Optional[SpareOp]:
    """Issue 26: the next batch of ready spare classes for one interface's send backend, or
    None. ``ready_classes: N`` asks for classes for N flows made ahead: while ``flows`` (shaped
    there) and ``spares`` number fewer than N, at most ``batch`` more are made. ``told``: the
    target the backend last got (0 at first, as a backend starts): a changed target is said
    even when nothing is to be made (the backend keeps closed flows' classes below it)."""
    want = ruleset.ready_classes
    need = min(want - flows - spares, batch)
    if need <= 0 and told == want:
        return None
    return SpareOp(max(need, 0), spare_shape(ruleset), want)
