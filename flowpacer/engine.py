"""The engine: pure functions from (live flows, rules) to a plan of backend operations.

No I/O, no clock, no kernel: everything here is decided from its arguments, so it is tested with
plain values.
"""
from __future__ import annotations

import fnmatch
import ipaddress
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from .model import (DEFAULT_IDLE_TIMEOUT_NS, Direction, Flow, FlowKey, Group, GroupKind,
                    IPAddress, Op, OpKind, Protocol, Rule, RuleSet, Shape)

COMM_LEN = 15      # TASK_COMM_LEN - 1: what the kernel reports of a process name

_GLOB_CHARS = set("*?[")


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` may match more than itself (fnmatch's special characters)."""
    return bool(_GLOB_CHARS & set(pattern))


def rule_matches(rule: Rule, flow: Flow) -> bool:
    m = rule.match
    if m.protocol is not Protocol.ANY and m.protocol is not flow.key.protocol:
        return False
    if m.direction is not Direction.ANY and m.direction is not flow.direction:
        return False
    if m.process and not any(fnmatch.fnmatchcase(flow.proc.comm, p) for p in m.process):
        return False
    if m.exe and not (flow.proc.exe and any(fnmatch.fnmatchcase(flow.proc.exe, p) for p in m.exe)):
        return False
    if m.user and flow.proc.uid not in m.user:
        return False
    k = flow.key
    if k.local_port not in m.local_port or k.remote_port not in m.remote_port:
        return False
    if m.remote and not any(k.remote_addr.version == n.version and k.remote_addr in n
                            for n in m.remote):
        return False
    return True


def first_match(rules: Iterable[Rule], flow: Flow) -> Optional[Rule]:
    for r in rules:
        if rule_matches(r, flow):
            return r
    return None


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
    for key, flow in flows.items():
        r = first_match(ruleset.rules, flow)
        if r is not None and r.sends:
            out[key] = shape_of(r, key)
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


def plan(want: Mapping[FlowKey, Shape], have: Mapping[FlowKey, Shape]) -> List[Op]:
    """Operations that turn ``have`` into ``want``: removals first (they free room), then rate
    changes (in place, the class and its queue stay), then additions; each group in key order
    (``FlowKey``'s total order: IPv4 and IPv6 keys mix). A flow whose rates are right but whose
    rule is not (adopted after a restart, or a rule renamed) is relabelled: nothing for the
    kernel, but status and metrics name the rule that shapes it. The same goes for a flow whose
    groups have the kernel's rates but other names (``Shape.rates`` is what the kernel sees).
    Flows of rules with aggregates change when their groups' rates or levels change: the backend
    moves them under their new parents."""
    removes = [Op(OpKind.REMOVE, k) for k in sorted(have.keys() - want.keys())]
    changes, relabels, adds = [], [], []
    for k in sorted(want):
        s = want[k]
        cur = have.get(k)
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
