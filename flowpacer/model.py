"""Shared models: the only types that cross stage boundaries.

Data flows one way: tracer/sockdiag -> flows -> engine -> backend -> kernel.
Every stage imports this module (and ``errors``) but never another stage.

Units are named and fixed here: rates are ``*_bps`` in **bytes per second**
(what the kernel's tc structures carry), times are ``*_ns``, sizes ``*_bytes``.
Unit strings ("8mbit") never get past the rules loader.
"""
from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


class Direction(str, enum.Enum):
    INBOUND = "inbound"    # the target accepted the connection
    OUTBOUND = "outbound"  # the target connected
    ANY = "any"            # only used in rule matches


class Protocol(str, enum.Enum):
    """A flow's transport protocol (``ANY`` only in rule matches); ``number`` is IP's."""
    TCP = "tcp"
    UDP = "udp"
    ANY = "any"

    @property
    def number(self) -> int:
        return {"tcp": 6, "udp": 17}.get(self.value, 0)


class Side(str, enum.Enum):
    """Which way a flow class shapes: what the server sends (the interface's egress) or what it
    receives (the interface's ingress, redirected to flowpacer's ifb device; issue 17)."""
    SEND = "send"
    RECEIVE = "receive"


class FlowSource(str, enum.Enum):
    TRACER = "tracer"      # eBPF tracepoints, as it happens
    RECONCILE = "reconcile"  # sock_diag snapshot / periodic re-scan


@dataclass(frozen=True, slots=True)
class FlowKey:
    """The egress 4-tuple of a TCP or UDP flow as seen from this host, and its protocol.

    ``local`` is the packet's source on egress, ``remote`` its destination. Both addresses are of
    the same family, and an IPv4-mapped IPv6 address (a dual-stack socket talking IPv4) is the
    IPv4 address it carries, as on the wire: build keys from kernel addresses with ``wire()``.

    Keys of both families are totally ordered (IPv4 before IPv6, then by address and port, then
    protocol), so that any mix of them can be sorted; ``ipaddress`` itself refuses to compare
    across families.

    A UDP flow of an unconnected socket bound to the wildcard address (a QUIC server answering
    many peers) has no fixed local address: its ``local_addr`` is the unspecified address of the
    packets' family (0.0.0.0 or ::), and its filter matches the local port and the remote only.
    """
    local_addr: IPAddress
    local_port: int
    remote_addr: IPAddress
    remote_port: int
    protocol: "Protocol" = Protocol.TCP

    @classmethod
    def wire(cls, local_addr, local_port: int, remote_addr, remote_port: int,
             protocol: "Protocol" = Protocol.TCP) -> "FlowKey":
        """The key of a socket whose addresses the kernel reported (either family, or mapped)."""
        la, ra = wire_address(local_addr), wire_address(remote_addr)
        if la.version != ra.version:
            if la.version == 6 and la.is_unspecified:   # dual-stack wildcard socket to IPv4
                la = ipaddress.IPv4Address(0)
            else:   # one side v4-mapped, the other not: keep both IPv6
                la, ra = ipaddress.IPv6Address(local_addr), ipaddress.IPv6Address(remote_addr)
        return cls(la, local_port, ra, remote_port, protocol)

    @property
    def family(self) -> int:
        return self.local_addr.version  # 4 or 6

    @property
    def sort_key(self) -> Tuple[int, int, int, int, int, int, int]:
        return (self.local_addr.version, int(self.local_addr), self.local_port,
                self.remote_addr.version, int(self.remote_addr), self.remote_port,
                self.protocol.number)

    def __lt__(self, other: "FlowKey") -> bool:
        if not isinstance(other, FlowKey):
            return NotImplemented
        return self.sort_key < other.sort_key

    def __le__(self, other: "FlowKey") -> bool:
        if not isinstance(other, FlowKey):
            return NotImplemented
        return self.sort_key <= other.sort_key

    def __gt__(self, other: "FlowKey") -> bool:
        if not isinstance(other, FlowKey):
            return NotImplemented
        return self.sort_key > other.sort_key

    def __ge__(self, other: "FlowKey") -> bool:
        if not isinstance(other, FlowKey):
            return NotImplemented
        return self.sort_key >= other.sort_key

    def __str__(self) -> str:
        udp = "/udp" if self.protocol is Protocol.UDP else ""
        return f"{endpoint(self.local_addr, self.local_port)}->" \
               f"{endpoint(self.remote_addr, self.remote_port)}{udp}"


def wire_address(addr) -> IPAddress:
    """An address as it is on the wire: IPv4-mapped IPv6 addresses become IPv4."""
    a = addr if isinstance(addr, (ipaddress.IPv4Address, ipaddress.IPv6Address)) \
        else ipaddress.ip_address(addr)
    if a.version == 6 and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def endpoint(addr: IPAddress, port: int) -> str:
    """``1.2.3.4:80`` or ``[2001:db8::1]:80``."""
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """Who owns a flow. Strings come from the kernel: treat them as untrusted."""
    pid: int                 # thread group id (what ps calls PID)
    comm: str = ""
    exe: str = ""            # absolute path, "" when unknown
    uid: int = -1            # -1 when unknown
    tid: int = 0             # the thread that made the call, 0 when unknown
    cgroup_id: int = 0


@dataclass(frozen=True, slots=True)
class Flow:
    key: FlowKey
    direction: Direction
    proc: ProcessInfo
    source: FlowSource = FlowSource.RECONCILE
    netns_ino: int = 0       # network namespace inode, 0 when unknown
    seen_ns: int = 0         # CLOCK_MONOTONIC time it was first seen


class EventKind(str, enum.Enum):
    OPEN = "open"
    CLOSE = "close"
    IDLE = "idle"      # a UDP flow sent nothing since ``flow.seen_ns`` (its last datagram)


@dataclass(frozen=True, slots=True)
class FlowEvent:
    kind: EventKind
    flow: Flow


# --------------------------------------------------------------------- rules

@dataclass(frozen=True, slots=True)
class PortSet:
    """Inclusive port ranges; an empty set means "any port"."""
    ranges: Tuple[Tuple[int, int], ...] = ()

    def __contains__(self, port: int) -> bool:
        return not self.ranges or any(lo <= port <= hi for lo, hi in self.ranges)


class Handshake(str, enum.Enum):
    """What the first-byte program (``flowpacer/bpf/firstbyte.c``) can decide of a ``Match``
    field at the end of a TCP handshake. Every field of ``Match`` declares one (its
    ``handshake`` metadata, ``handshake_of``); ``flowpacer/handshake.py`` compiles the
    program's masks from these declarations, and a test fails for a field without one."""
    YES = "yes"            # every value: the kernel sees it and decides it as the engine does
    PARTIAL = "partial"    # some values (the declaration says which); a rule with another is
    #                        left to user space
    NO = "no"              # the kernel does not see it: a rule that sets it (a value other
    #                        than the field's default, "any") is left to user space


@dataclass(frozen=True, slots=True)
class HandshakeDecl:
    decides: Handshake
    why: str               # what the kernel sees of the field, or why it cannot


def _match_field(default, decides: Handshake, why: str):
    return field(default=default, metadata={"handshake": HandshakeDecl(decides, why)})


@dataclass(frozen=True, slots=True)
class Match:
    """All given fields must match; an empty tuple / None means "any".

    Each field declares what the kernel can decide of it at the handshake (``Handshake``);
    a new field needs that answer (docs/firstbyte.md, "Adding a match field")."""
    process: Tuple[str, ...] = _match_field(      # comm globs
        (), Handshake.PARTIAL,
        "names without a glob are compared with the owner's comm (the kernel's 15 bytes); a "
        "glob, or a name holding U+FFFD (what user space shows for a comm byte that is not "
        "UTF-8), is matched in user space")
    exe: Tuple[str, ...] = _match_field(          # absolute path globs
        (), Handshake.NO, "exe patterns are matched in user space (the kernel has no path of "
        "the owner's executable at the handshake)")
    user: Tuple[int, ...] = _match_field(         # uids (names resolved by the loader)
        (), Handshake.YES, "the owner's uid")
    direction: Direction = _match_field(
        Direction.ANY, Handshake.YES, "passive (inbound) or active (outbound) end of the handshake")
    local_port: PortSet = _match_field(PortSet(), Handshake.YES, "the socket's local port")
    remote_port: PortSet = _match_field(PortSet(), Handshake.YES, "the socket's remote port")
    remote: Tuple[IPNetwork, ...] = _match_field(
        (), Handshake.YES, "prefixes in an LPM trie of (family, address); an IPv4-mapped socket "
        "is IPv4, as FlowKey.wire says")
    protocol: Protocol = _match_field(            # TCP unless the rule says udp or any
        Protocol.TCP, Handshake.PARTIAL,
        "sock_ops sees TCP handshakes only: a tcp or any rule is a candidate, a udp rule never")


def handshake_of(f) -> Optional[HandshakeDecl]:
    """The declaration of a ``dataclasses.fields(Match)`` field, None when it has none."""
    return f.metadata.get("handshake")


DEFAULT_IDLE_TIMEOUT_NS = 30_000_000_000


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    match: Match
    rate_bps: Optional[int]              # bytes/s per flow; None: a receive-only rule (what
    #                                      its flows send is not shaped, they get no send class)
    ceil_bps: Optional[int] = None       # bytes/s, >= rate_bps
    line: int = field(default=0, compare=False)   # where it was declared (for messages)
    # aggregates (issue 15): all flows of this rule from one client / all flows of this rule
    client_rate_bps: Optional[int] = None     # bytes/s, rate <= client_rate <= total_rate
    total_rate_bps: Optional[int] = None      # bytes/s
    client_prefix: Tuple[int, int] = (32, 64)  # (IPv4, IPv6) prefix lengths that make a client
    # issue 17: a UDP flow without a datagram for this long is over (TCP flows end at close)
    idle_timeout_ns: int = DEFAULT_IDLE_TIMEOUT_NS
    # uploads (issue 17): what the server accepts from each flow, shaped on the ingress ifb
    receive_rate_bps: Optional[int] = None   # bytes/s per flow; None: receiving is not shaped
    receive_ceil_bps: Optional[int] = None   # bytes/s, >= receive_rate_bps

    @property
    def has_groups(self) -> bool:
        return self.client_rate_bps is not None or self.total_rate_bps is not None

    @property
    def sends(self) -> bool:
        """Whether the rule shapes what the server sends (False: receive_rate only)."""
        return self.rate_bps is not None


class BackendKind(str, enum.Enum):
    AUTO = "auto"
    PSP = "psp"
    HTB = "htb"


@dataclass(frozen=True, slots=True)
class RuleSet:
    interface: str
    backend: BackendKind = BackendKind.AUTO
    link_rate_bps: Optional[int] = None  # None: ask the interface
    rules: Tuple[Rule, ...] = ()
    path: str = field(default="", compare=False)
    # problems that do not stop the file from loading (e.g. total rates oversubscribing the link),
    # as errors.RuleProblem: FILE:LINE:COL lines like the errors
    warnings: tuple = field(default=(), compare=False)

    @property
    def receives(self) -> bool:
        """Whether a rule shapes what the server receives (the receive side is needed)."""
        return any(r.receive_rate_bps is not None for r in self.rules)

    def rule(self, name: str) -> Optional[Rule]:
        for r in self.rules:
            if r.name == name:
                return r
        return None


# ------------------------------------------------------------ engine/backend

class GroupKind(str, enum.Enum):
    """The levels of aggregate rates above a flow (issue 15)."""
    RULE = "rule"          # all flows of one rule (total_rate)
    CLIENT = "client"      # all flows of one rule from one client (client_rate)


@dataclass(frozen=True, slots=True)
class Group:
    """A cap shared by several flows: a rule's total or one client's flows of a rule.

    ``id`` names it across flows (``"downloads"``, ``"downloads/192.0.2.7/32"``); ``ceil_bps`` is
    how far the group may borrow from its parent (== rate_bps: a group never exceeds its rate)."""
    kind: GroupKind
    id: str
    rate_bps: int
    ceil_bps: int


@dataclass(frozen=True, slots=True)
class Shape:
    """What one flow should get from the backend."""
    rule: str
    rate_bps: int
    ceil_bps: int                        # == rate_bps when the rule has no ceil
    groups: Tuple[Group, ...] = ()       # outermost first (rule, then client); () without aggregates

    @property
    def rates(self) -> tuple:
        """What the kernel sees: the flow's rates and its groups' levels and rates (not names)."""
        return (self.rate_bps, self.ceil_bps,
                tuple((g.kind, g.rate_bps, g.ceil_bps) for g in self.groups))

    def group(self, kind: "GroupKind") -> Optional[Group]:
        for g in self.groups:
            if g.kind is kind:
                return g
        return None


@dataclass(frozen=True, slots=True)
class ClassStats:
    bytes: int = 0
    packets: int = 0
    drops: int = 0
    overlimits: int = 0
    backlog_bytes: int = 0
    qlen: int = 0
    rate_est_bps: int = 0                # bytes/s, 0 when the kernel has none


@dataclass(frozen=True, slots=True)
class LinkConfig:
    interface: str
    link_rate_bps: int


@dataclass
class ApplyResult:
    """What a backend did with one plan."""
    added: int = 0
    changed: int = 0
    removed: int = 0
    errors: list = field(default_factory=list)   # list[OpError]


class OpKind(str, enum.Enum):
    ADD = "add"
    CHANGE = "change"
    REMOVE = "remove"
    RELABEL = "relabel"      # same rates, another rule: bookkeeping only, nothing to the kernel


@dataclass(frozen=True, slots=True)
class Op:
    """One step of a plan: give a flow its class, change its rate, or take it away."""
    kind: OpKind
    key: FlowKey
    shape: Optional[Shape] = None      # None for REMOVE


@dataclass(frozen=True, slots=True)
class OpError:
    op: Op
    reason: str                        # one line, with the kernel's extack text when it gave one


# ------------------------------------------------------------ health/status

class BackendHealth(str, enum.Enum):
    """What became of the backend's kernel objects (``TcBackend.check``)."""
    OK = "ok"
    GONE = "gone"          # the interface is missing
    LOST = "lost"          # our root qdisc is not there (interface re-created, qdisc deleted)
    FOREIGN = "foreign"    # someone else's root qdisc is there: not ours to fight
    SPEED = "speed"        # no configured link rate and the interface's speed changed


class StageState(str, enum.Enum):
    """A supervised stage (a thread or the main loop) as status and metrics show it."""
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"    # failed, waiting out its back-off before the next start
    STALLED = "stalled"          # running but has not reported for too long
    DEGRADED = "degraded"        # gave up; the daemon carries on without it (said how)
    FAILED = "failed"            # gave up; the daemon exits non-zero so that systemd restarts it
    DISABLED = "disabled"        # not configured to run (--no-tracer, --no-metrics)
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class StageView:
    name: str
    state: StageState
    failures: int = 0
    last_error: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class FlowView:
    """One shaped flow as status, top and metrics show it."""
    key: FlowKey
    classid: int
    rule: str
    rate_bps: int
    ceil_bps: int
    pid: int = 0
    process: str = ""
    uid: int = -1
    direction: Optional[Direction] = None
    source: Optional[FlowSource] = None
    groups: Tuple[Group, ...] = ()       # its rule and client groups (issue 15), outermost first
    side: Side = Side.SEND               # which way its class shapes (issue 17)

    @property
    def stats_key(self):
        """Its class's key in a class-statistics map: the classid on the send side,
        (Side.RECEIVE, classid) on the receive side (its classes have the same ids, on the ifb)."""
        return self.classid if self.side is Side.SEND else (Side.RECEIVE, self.classid)


@dataclass(frozen=True, slots=True)
class GroupView:
    """One group class (a rule's total or one client's share of a rule) as the kernel has it."""
    kind: Optional[GroupKind]            # None: adopted after a restart, not named by a plan yet
    id: str                              # Group.id ("" until named)
    classid: int
    rate_bps: int                        # its kernel rate (its share when its parent is full)
    ceil_bps: int                        # its cap


@dataclass(frozen=True, slots=True)
class FirstBytePool:
    """One kernel-decided rule's pool of ready classes (issue 16)."""
    rule: str
    ready: int                           # classes ready for the next handshakes now
    claims: int                          # claims of this rule reported since start


@dataclass(frozen=True, slots=True)
class FirstByteView:
    """First-byte shaping's pools and counters (issue 16): ``counters`` has the fixed names of
    ``firstbyte.VIEW_COUNTERS`` (claims, refills, exhausted, ...), all totals since start."""
    pools: Tuple[FirstBytePool, ...]
    counters: dict                       # name -> count
    ids_held: int                        # pool ids open sockets carry, not handed out
    ids_awaiting: int                    # claimed ids whose class went, waiting for the socket


@dataclass(frozen=True, slots=True)
class DaemonView:
    """The daemon's state at one moment: the one thing status, control, top and metrics read."""
    backend: Optional[str]
    backend_reason: str
    interface: Optional[str]
    backend_health: BackendHealth
    backend_problem: str
    link_rate_bps: int
    rules_path: str
    rule_names: Tuple[str, ...]
    flow_source: str
    tracer: Optional[dict]
    live_flows: int
    flows: Tuple[FlowView, ...]
    stages: Tuple[StageView, ...]
    counters: dict
    events: dict
    groups: Tuple[GroupView, ...] = ()   # group classes (issue 15)
    # the receive side (issue 17): its ifb (None: no rule receives), health and problem
    receive_interface: Optional[str] = None
    receive_health: BackendHealth = BackendHealth.OK
    receive_problem: str = ""
    first_byte: Optional[FirstByteView] = None   # issue 16; None when the stage is off
