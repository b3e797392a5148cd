"""The rules as the first-byte program reads them: which rule a TCP flow gets, decided in the
kernel at the end of its handshake (issue 16), only where the engine would decide the same.

The engine (``engine.first_match``) is the one place that says which rule a flow gets; this
module belongs to it (policy side: it imports ``model`` and ``engine`` only, no kernel code).
It compiles a rule set into the bit masks that ``first_rule()`` in ``flowpacer/sources/bpf/firstbyte.c``
reads, from what each ``Match`` field declares the kernel can decide (``model.Handshake``,
the field's ``handshake`` metadata):

* a field declared ``YES`` or ``PARTIAL`` has a compiler here (``FIELD_COMPILERS``): it turns
  the field's value into masks, and for a value the kernel cannot decide (``PARTIAL``) says
  why; it may also exclude the rule (the kernel knows it never matches a TCP handshake);
* a field declared ``NO`` has none: a rule that sets it (a value other than the field's
  default) stays a candidate the kernel cannot decide, so the walk stops there and the flow
  is left to user space, never given a later rule's class.

A rule is decided wholly in the kernel (``Compiled.kernel``: it may claim a pool class) when
every field of its match is, and it has a send rate without aggregates. The import fails when
a ``Match`` field declares nothing, or when the compilers here and the declarations disagree.
"""
from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from flowpacer.policy import engine
from flowpacer.policy.engine import is_glob
from flowpacer.model import (Direction, Flow, Handshake, Match, PortSet, Protocol, Rule, RuleSet,
                             handshake_of)

# firstbyte.h (flowpacer/sources/bpf; firstbyte.py mirrors them too): FB_COMM_LEN, FB_MAX_RULES (one
# bit per rule in a u64)
COMM_LEN = 16
MAX_RULES = 64
PORTS = 65536


@dataclass
class Compiled:
    """The rules as the program reads them (bit i = rule i)."""
    kernel: Dict[int, Rule] = field(default_factory=dict)      # index -> rule that may claim
    not_kernel: Dict[str, str] = field(default_factory=dict)      # rule name -> why not
    never: int = 0              # rules no TCP handshake matches (udp, ...): never candidates
    live: int = 0
    kernel_mask: int = 0
    inbound: int = 0
    outbound: int = 0
    any_comm: int = 0
    any_uid: int = 0
    any_remote: int = 0
    lport: List[int] = field(default_factory=list)                # 65536 masks
    rport: List[int] = field(default_factory=list)
    comms: Dict[bytes, int] = field(default_factory=dict)         # 16-byte comm -> mask
    uids: Dict[int, int] = field(default_factory=dict)
    remote: Dict[Tuple[int, bytes, int], int] = field(default_factory=dict)  # (4|6, addr, plen)

    def summary(self) -> str:
        yes = [r.name for _i, r in sorted(self.kernel.items())]
        no = [f"{n} ({why})" for n, why in self.not_kernel.items()]
        return (f"rules shaped from the first byte: {', '.join(yes) or 'none'}"
                + (f"; after the handshake: {', '.join(no)}" if no else ""))


@dataclass
class _Build:
    """What the compilers collect besides ``Compiled``'s own fields."""
    c: Compiled
    excluded: Dict[int, str] = field(default_factory=dict)       # bit -> why it never matches
    any_lport: int = 0
    any_rport: int = 0
    lport: List[Tuple[int, PortSet]] = field(default_factory=list)
    rport: List[Tuple[int, PortSet]] = field(default_factory=list)


# A field compiler: (build, the rule's bit, the field's value) -> None when the kernel decides
# this value, else why it cannot (the rule is then a candidate that leaves the flow to user
# space, so its masks must let through every flow the value might match).
FieldCompiler = Callable[[_Build, int, Any], Optional[str]]


def kernel_comm(name: str) -> Optional[bytes]:
    """A literal process name as the kernel's comm key (16 bytes, NUL padded); None when no
    comm can equal it: longer than the kernel's 15 bytes, or not encodable."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return raw.ljust(COMM_LEN, b"\0") if len(raw) < COMM_LEN else None


def _process(b: _Build, bit: int, names: Tuple[str, ...]) -> Optional[str]:
    c = b.c
    if not names:
        c.any_comm |= bit
        return None
    if any(is_glob(p) for p in names):
        c.any_comm |= bit          # may match: a candidate that stops the walk
        return "process pattern with a glob"
    if any("\ufffd" in p for p in names):
        # user space shows a comm byte that is not UTF-8 (a name cut inside a character) as
        # U+FFFD, the kernel has the byte: only user space can compare them
        c.any_comm |= bit
        return "process name with U+FFFD (a comm byte that is not UTF-8)"
    keys = [k for k in map(kernel_comm, names) if k is not None]
    if not keys:
        b.excluded[bit] = "no process name fits in a comm"
    for k in keys:               # a name no comm can equal never matches, as in user space
        c.comms[k] = c.comms.get(k, 0) | bit
    return None


def _user(b: _Build, bit: int, uids: Tuple[int, ...]) -> Optional[str]:
    c = b.c
    if not uids:
        c.any_uid |= bit
        return None
    for u in uids:
        if 0 <= u < 2 ** 32:     # the kernel's uid is a u32: another never matches
            c.uids[u] = c.uids.get(u, 0) | bit
    return None


def _direction(b: _Build, bit: int, d: Direction) -> Optional[str]:
    if d in (Direction.ANY, Direction.INBOUND):
        b.c.inbound |= bit
    if d in (Direction.ANY, Direction.OUTBOUND):
        b.c.outbound |= bit
    return None


def _local_port(b: _Build, bit: int, ps: PortSet) -> Optional[str]:
    if ps.ranges:
        b.lport.append((bit, ps))
    else:
        b.any_lport |= bit
    return None


def _remote_port(b: _Build, bit: int, ps: PortSet) -> Optional[str]:
    if ps.ranges:
        b.rport.append((bit, ps))
    else:
        b.any_rport |= bit
    return None


def _remote(b: _Build, bit: int, nets) -> Optional[str]:
    c = b.c
    if not nets:
        c.any_remote |= bit
        return None
    for n in nets:
        k = (n.version, n.network_address.packed.ljust(16, b"\0"), n.prefixlen)
        c.remote[k] = c.remote.get(k, 0) | bit
    return None


def _protocol(b: _Build, bit: int, p: Protocol) -> Optional[str]:
    if p is Protocol.UDP:
        b.excluded[bit] = "udp: no TCP handshake matches it"
    return None


FIELD_COMPILERS: Dict[str, FieldCompiler] = {
    "process": _process, "user": _user, "direction": _direction, "local_port": _local_port,
    "remote_port": _remote_port, "remote": _remote, "protocol": _protocol,
}


def _declarations(cls=Match) -> Tuple[Tuple[dataclasses.Field, Any], ...]:
    """Every field of ``cls`` (``Match``) with its declaration; raises TypeError when one has
    none, or when a field the kernel (partly) decides has no compiler here or one it does not
    has one."""
    out = []
    for f in dataclasses.fields(cls):
        d = handshake_of(f)
        if d is None:
            raise TypeError(f"{cls.__name__}.{f.name} does not declare what the kernel can decide "
                            "of it at the handshake (model.Handshake; docs/firstbyte.md)")
        has = f.name in FIELD_COMPILERS
        if has != (d.decides is not Handshake.NO):
            raise TypeError(f"{cls.__name__}.{f.name} is declared {d.decides.value} but "
                            "handshake.py "
                            f"{'has a' if has else 'has no'} compiler for it")
        out.append((f, d))
    return tuple(out)


DECLARATIONS = _declarations()


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _port_masks(entries: List[Tuple[int, PortSet]], any_mask: int) -> List[int]:
    """Per port, the rules whose ranges hold it, and ``any_mask`` everywhere. Each rule's
    ranges are merged, then toggled at their ends: one pass over the ports in all."""
    toggle = [0] * (PORTS + 1)
    for bit, ps in entries:
        merged: List[List[int]] = []
        for lo, hi in sorted((max(0, lo), min(PORTS - 1, hi)) for lo, hi in ps.ranges):
            if lo > hi:
                continue
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            toggle[lo] ^= bit
            toggle[hi + 1] ^= bit
    masks, cur = [], 0
    for p in range(PORTS):
        cur ^= toggle[p]
        masks.append(cur | any_mask)
    return masks


def compile_rules(ruleset: RuleSet) -> Compiled:
    """What the kernel can decide of ``ruleset``, as masks (pure)."""
    c = Compiled()
    b = _Build(c)
    rules = ruleset.rules
    if len(rules) > MAX_RULES:
        # the last bit stands for every rule past the others: a candidate of every flow the
        # kernel cannot decide, so a flow one of them matches is left to user space (counted
        # undecided, not as matching no rule)
        seen = rules[:MAX_RULES - 1]
        rest = 1 << len(seen)
        c.live |= rest
        c.inbound |= rest
        c.outbound |= rest
        c.any_comm |= rest
        c.any_uid |= rest
        c.any_remote |= rest
        b.any_lport |= rest
        b.any_rport |= rest
        for r in rules[len(seen):]:
            c.not_kernel[r.name] = f"only the first {len(seen)} rules are seen in the kernel"
    else:
        seen = rules
    for i, r in enumerate(seen):
        bit = 1 << i
        c.live |= bit
        why = []
        for f, d in DECLARATIONS:
            value = getattr(r.match, f.name)
            compiler = FIELD_COMPILERS.get(f.name)
            if compiler is not None:
                reason = compiler(b, bit, value)
            else:
                reason = d.why if value != _default(f) else None
            if reason:
                why.append(reason)
        if r.has_groups:
            why.append("aggregate rates (client/total) get their class in user space")
        if not r.sends:       # its flows get no send class: the walk stops here, nothing taken
            why.append("receive only: nothing to shape on the send side")
        if bit in b.excluded:
            c.not_kernel[r.name] = b.excluded[bit]
        elif why:
            c.not_kernel[r.name] = "; ".join(why)
        else:
            c.kernel[i] = r
            c.kernel_mask |= bit
    c.never = sum(b.excluded)
    c.inbound &= ~c.never
    c.outbound &= ~c.never
    # a longer prefix holds the rules of every shorter prefix around it (LPM finds the longest)
    nets = {k: ipaddress.ip_network((k[1][:4] if k[0] == 4 else k[1], k[2])) for k in c.remote}
    nested = {}
    for k, net in nets.items():
        mask = c.remote[k]
        for k2, net2 in nets.items():
            if k2 != k and net.version == net2.version and net.subnet_of(net2):
                mask |= c.remote[k2]
        nested[k] = mask
    c.remote = nested
    c.lport = _port_masks(b.lport, b.any_lport)
    c.rport = _port_masks(b.rport, b.any_rport)
    return c


def _kernel_view(rule: Rule) -> Tuple[Dict[str, str], Optional[str]]:
    """What the kernel cannot decide of ``rule`` (field -> why) and, when it knows the rule
    never matches a TCP handshake, why: the compilers above, run on the rule alone."""
    b = _Build(Compiled())
    blind = {}
    for f, d in DECLARATIONS:
        value = getattr(rule.match, f.name)
        compiler = FIELD_COMPILERS.get(f.name)
        reason = compiler(b, 1, value) if compiler is not None else \
            (d.why if value != _default(f) else None)
        if reason:
            blind[f.name] = reason
    return blind, b.excluded.get(1)


def first_byte(ruleset: RuleSet, flow: Flow, compiled: Optional[Compiled] = None,
               unknown=frozenset()) -> Tuple[bool, str]:
    """Whether the kernel gives ``flow`` its class at the end of its handshake, and why (for
    ``flowpacer explain``). The kernel's walk as ``compile_rules`` sets it up: rules it knows
    never match a TCP handshake are skipped; a rule is a candidate when every field the kernel
    sees matches (``engine.mismatches`` says which fail, the declarations which of those the
    kernel cannot see); the first candidate decides: its class when the kernel decides it
    wholly, else the flow is left to user space. ``unknown``: fields of a described flow that
    were not given (a rule failing on one of them makes the answer depend on it)."""
    if flow.key.protocol is not Protocol.TCP:
        return False, "not TCP: the first-byte program sees TCP handshakes only"
    c = compiled if compiled is not None else compile_rules(ruleset)
    rules = ruleset.rules
    for i, r in enumerate(rules):
        if len(rules) > MAX_RULES and i >= MAX_RULES - 1:
            return False, (f"rule {r.name!r}: {c.not_kernel.get(r.name, 'not seen')}: "
                           "the flow is left to user space")
        blind, never = _kernel_view(r)
        if never:
            continue
        fails = set(engine.mismatches(r, flow, every=True))
        if fails - set(blind) - set(unknown):
            continue                     # a field the kernel sees does not match
        if (fails - set(blind)) & set(unknown):
            return False, (f"depends on {', '.join(sorted((fails - set(blind)) & set(unknown)))} "
                           "(not given): "
                           f"rule {r.name!r} (line {r.line}) may match first")
        if i in c.kernel:
            return True, (f"rule {r.name!r} is decided in the kernel: the flow takes one of its "
                          "ready classes at the end of the handshake")
        why = c.not_kernel.get(r.name, "; ".join(blind.values()))
        if fails:
            return False, (f"rule {r.name!r} (line {r.line}) comes first and the kernel cannot "
                           f"tell that it does not match, so the flow is left to user space: "
                           f"{why}")
        return False, (f"rule {r.name!r} is not decided in the kernel ({why}): the flow gets its "
                       "class once user space sees it")
    return False, "no rule matches it"
