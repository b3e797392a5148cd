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
from dataclasses import dataclass, field, fields
from typing import ClassVar, Dict, FrozenSet, Mapping, NamedTuple, Optional, Tuple, Union

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
        return _PROTO_NUMBER[self]


_PROTO_NUMBER = {Protocol.TCP: 6, Protocol.UDP: 17, Protocol.ANY: 0}


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
    This is the one place that rule is written (``wire_address``, ``wire``): the tracer,
    sock_diag and the metrics' address labels call it; the first-byte BPF program's own
    reading of mapped addresses is documented and tested against it.

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
    # the hash, computed once (a key is hashed a dozen times on its way to the kernel); not a
    # part of the key: no __init__ argument, not compared, not shown
    _hash: Optional[int] = field(default=None, init=False, repr=False, compare=False)
    # what __eq__ compares, as plain values, made once (``_identity``)
    _ident: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    @staticmethod
    def wire_address(addr) -> IPAddress:
        """An address (object or text) as it is on the wire: IPv4-mapped IPv6 becomes IPv4."""
        a = addr if isinstance(addr, (ipaddress.IPv4Address, ipaddress.IPv6Address)) \
            else ipaddress.ip_address(addr)
        if a.version == 6 and a.ipv4_mapped is not None:
            return a.ipv4_mapped
        return a

    @classmethod
    def wire(cls, local_addr, local_port: int, remote_addr, remote_port: int,
             protocol: "Protocol" = Protocol.TCP) -> "FlowKey":
        """The key of a socket whose addresses the kernel reported (either family, or mapped)."""
        la, ra = cls.wire_address(local_addr), cls.wire_address(remote_addr)
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
        """(local version, address, port, remote version, address, port, protocol number)."""
        return self._identity()[:7]

    def __hash__(self) -> int:
        # over what __eq__ compares; ``ipaddress``' own hash formats the address as hex text
        # each time, so the addresses' integers are hashed, once per key (integers only: the
        # same in every process, so a copied key's cached hash stays right)
        h = self._hash
        if h is None:
            h = hash((int(self.local_addr), self.local_port, int(self.remote_addr),
                      self.remote_port, _PROTO_NUMBER[self.protocol]))
            object.__setattr__(self, "_hash", h)
        return h

    def _identity(self) -> tuple:
        """The fields as the generated __eq__ compared them, in plain values: each address'
        version and integer, the ports, the protocol's number (in ``sort_key``'s order: it is
        the first seven), then the addresses' IPv6 scopes (what ``ipaddress`` compares too).
        Keys of two sources (the tracer's, sock_diag's) meet in the flow table's dicts, where
        every lookup compared them field by field through ``ipaddress``' Python-level __eq__
        (issue 26's profile: ~2 us a lookup, 20 000 at each reconcile pass of 10 000 flows); a
        tuple of integers compares in C, and a plan's sort reads it too."""
        i = self._ident
        if i is None:
            la, ra = self.local_addr, self.remote_addr
            i = (la.version, int(la), self.local_port, ra.version, int(ra), self.remote_port,
                 _PROTO_NUMBER[self.protocol], getattr(la, "scope_id", None),
                 getattr(ra, "scope_id", None))
            object.__setattr__(self, "_ident", i)
        return i

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._identity() == other._identity()

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

    @property
    def local_endpoint(self) -> str:
        return endpoint(self.local_addr, self.local_port)

    @property
    def remote_endpoint(self) -> str:
        return endpoint(self.remote_addr, self.remote_port)

    def endpoints(self) -> Tuple[str, str]:
        """The two halves of ``str(key)``: the local endpoint, and the remote one with
        ``/udp`` after it for a UDP flow (what ``top`` shows in its LOCAL and REMOTE columns)."""
        udp = "/udp" if self.protocol is Protocol.UDP else ""
        return self.local_endpoint, self.remote_endpoint + udp

    def __str__(self) -> str:
        return "->".join(self.endpoints())

    @classmethod
    def parse(cls, local: str, remote: str, protocol: str = "tcp") -> "FlowKey":
        """The key of a flow as the status answer gives it (``endpoint`` texts and the protocol's
        name); ValueError for anything else."""
        la, lp = parse_endpoint(local)
        ra, rp = parse_endpoint(remote)
        proto = Protocol(protocol)
        if proto is Protocol.ANY:
            raise ValueError(f"not a flow's protocol: {protocol}")
        return cls(la, lp, ra, rp, proto)


def endpoint(addr: IPAddress, port: int) -> str:
    """``1.2.3.4:80`` or ``[2001:db8::1]:80``."""
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def parse_endpoint(text: str) -> Tuple[IPAddress, int]:
    """``endpoint``'s text back to (address, port); ValueError for anything else."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not an endpoint: {text!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"not an endpoint: {text!r}")
        addr = ipaddress.IPv6Address(host[1:-1])
    else:
        addr = ipaddress.IPv4Address(host)
    return addr, int(port)


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
    # what the kernel's output route lookup of its socket uses besides the tuple and the uid
    # (issue 29: which interface it leaves by): the socket's mark (SO_MARK, policy routing by
    # fwmark) and the device it is bound to (SO_BINDTODEVICE, or the VRF of an l3mdev
    # socket); 0 when none, or not known yet (a tracer flow until a sock_diag pass saw it)
    mark: int = 0
    bound_if: int = 0


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
    """What the first-byte program (``flowpacer/sources/bpf/firstbyte.c``) can decide of a ``Match``
    field at the end of a TCP handshake. Every field of ``Match`` declares one (its
    ``handshake`` metadata, ``handshake_of``); ``flowpacer/policy/handshake.py`` compiles the
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
class InterfaceSpec:
    """One entry of the rules' ``interfaces:`` (issue 29): a device name or a glob (``eth*``)
    and its own link rate (None: the top-level ``link_rate``, else the device's speed)."""
    name: str
    link_rate_bps: Optional[int] = None

    @property
    def is_glob(self) -> bool:
        return any(c in self.name for c in "*?[")


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
    # issue 29: several interfaces (``interfaces:``), each flow shaped on the one it leaves by;
    # empty: the single ``interface`` (or the CLI's --interface) shapes every flow, as before
    interfaces: Tuple[InterfaceSpec, ...] = ()
    # issue 26: spare flow classes a backend that keeps spares (htb) makes ahead of a burst, per
    # shaped interface (``ready_classes:``); 0: only closed flows' classes become spares
    ready_classes: int = 0

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


class GroupKey(NamedTuple):
    """A group class by what it caps: its level and ``Group.id`` (kind None and id "" for a
    group adopted after a restart that no plan has named yet)."""
    kind: Optional[GroupKind]
    id: str


class ClassRole(str, enum.Enum):
    """Classes that are neither a flow's nor a group's."""
    DEFAULT = "default"    # unmatched traffic


class StatsKey(NamedTuple):
    """Where one class's counters belong: the shaped interface (the send side's, also for its
    receive side's ifb), the side, and what the class shapes (a flow, a group, the default
    class). The backend's own class ids never appear in a key (issue 25)."""
    interface: str
    side: "Side"
    key: Union[FlowKey, GroupKey, ClassRole]


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
    # first-byte pools (issue 16): the class ids made ready (POOL_FILL, POOL_CHANGE) per rule
    # name, in the order they were made, and how many awaited ids a POOL_SWEEP freed
    pool_made: Dict[str, list] = field(default_factory=dict)
    pool_freed_by_sweep: int = 0
    # ready spare classes (issue 26, ``SpareOp``): how many were made, and each refusal's line
    spares_made: int = 0
    spare_errors: list = field(default_factory=list)   # list[str]


class OpKind(str, enum.Enum):
    ADD = "add"
    CHANGE = "change"
    REMOVE = "remove"
    RELABEL = "relabel"      # same rates, another rule: bookkeeping only, nothing to the kernel
    # first-byte pools (issue 16), carried by a ``PoolOp``: the backend's pool of ready classes
    POOL_FILL = "pool_fill"        # make ``count`` ready classes of ``shape`` for ``rule``
    POOL_CHANGE = "pool_change"    # give the ready classes ``classids`` ``shape`` (a reload
    #                                reuses them for ``rule``)
    POOL_DELETE = "pool_delete"    # delete the ready (unclaimed) classes ``classids``
    POOL_CLAIM = "pool_claim"      # the socket of flow ``key`` took ready class ``classids[0]``:
    #                                the flow's ADD takes that class
    POOL_RELEASE = "pool_release"  # the claim of ``key`` is not used: its class goes, its id
    #                                waits for the socket's close
    POOL_CLOSED = "pool_closed"    # the sockets that claimed ``classids`` are closed
    POOL_SWEEP = "pool_sweep"      # a sweep found ``priorities`` on the namespace's open sockets
    # ready spare classes (issue 26), carried by a ``SpareOp``
    SPARE_FILL = "spare_fill"      # make ``count`` spare classes (no filter) of ``shape``

    @property
    def is_pool(self) -> bool:
        return self.value.startswith("pool_")


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


@dataclass(frozen=True, slots=True)
class PoolOp:
    """One step of a plan on the first-byte pools (issue 16); ``kind`` is a ``POOL_*`` OpKind.
    Planned by ``engine.plan_pools`` and applied by the send side's backend in the same batch
    as the flows' ops (``ApplyResult.pool_made`` says what was made)."""
    kind: OpKind
    rule: str = ""                                  # FILL, CHANGE: the rule the pool is for
    shape: Optional["Shape"] = None                 # FILL, CHANGE
    count: int = 0                                  # FILL
    classids: Tuple[int, ...] = ()                  # CHANGE, DELETE, CLAIM, CLOSED
    key: Optional[FlowKey] = None                   # CLAIM, RELEASE
    priorities: FrozenSet[int] = frozenset()        # SWEEP
    at_ns: int = 0                                  # CLAIM: when it was bound (monotonic)


@dataclass(frozen=True, slots=True)
class SpareOp:
    """Make spare flow classes ahead of a burst (issue 26, ``ready_classes``): ``count`` classes
    without a filter, of ``shape``'s rates (a new flow's class is one of them changed to its
    own), on a backend whose ``capabilities.spares`` is true. ``target``: how many spares the
    rules want there; a closed flow's class is kept as a spare while there are fewer (below
    that the backend would delete it only for the next fill to make it again). Planned by
    ``engine.plan_spares``."""
    count: int
    shape: "Shape"
    target: int
    kind: OpKind = OpKind.SPARE_FILL


@dataclass(frozen=True, slots=True)
class ClaimEvent:
    """The first-byte program gave flow ``key``'s socket the ready class ``classid`` of the
    pool of rule ``rule`` at the end of its handshake (issue 16)."""
    key: FlowKey
    classid: int
    rule: str = ""
    ts_ns: int = 0          # the claim's moment (CLOCK_MONOTONIC): names it in fb_placed


@dataclass(frozen=True, slots=True)
class PoolReport:
    """What the first-byte source hands the reconciler each round (``Reconciler.on_claims``):
    its claims, and what its rings need. Built outside the reconciler's lock."""
    epoch: int                                      # the pool bookkeeping its ids belong to
    #                                                 (``PoolHolding.epoch``; -1: none yet)
    pools: Tuple[Tuple["Rule", int], ...] = ()      # (kernel rule, classes ready in its ring)
    target: int = 0                                 # ready classes wanted per pool
    claims: Tuple[ClaimEvent, ...] = ()
    closed: Tuple[int, ...] = ()                    # class ids whose claiming socket closed
    returned: Tuple[int, ...] = ()                  # ready classes taken back from the rings
    priorities: Optional[FrozenSet[int]] = None     # a sweep of the sockets' priorities
    replan: bool = False                            # the pools were made anew this round
    closing: bool = False                           # the program is detached: no pool stays
    # guarded claims (several interfaces, issue 29): flows whose socket is also paced by TCP
    # until their class is on the interface they leave by (``PoolGrant.placed`` says when)
    guarded: Tuple[FlowKey, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolHolding:
    """The send backend's pool as the engine plans from it (a copy)."""
    epoch: int                                      # changes when the bookkeeping is dropped
    ready: FrozenSet[int] = frozenset()             # class ids made and not claimed
    claims: Mapping[FlowKey, Tuple[int, int]] = field(default_factory=dict)
    #                                                 key -> (class id, bound at ns): no ADD yet


@dataclass(frozen=True, slots=True)
class PoolGrant:
    """The reconciler's answer to a ``PoolReport``: the ids to write into the rings and what
    became of the claims. ``applied`` False: no usable backend, nothing was done."""
    applied: bool
    epoch: int
    rules: Optional["RuleSet"] = None               # the rules the pools must follow now
    made: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)   # rule -> class ids
    stale: int = 0
    bound: int = 0
    bound_by_rule: Mapping[str, int] = field(default_factory=dict)
    released: int = 0
    rebound: int = 0
    closed: int = 0
    freed_by_sweep: int = 0
    ready_classes: int = 0                          # the backend's ready classes after it
    ids_held: int = 0
    ids_awaiting: int = 0
    oldest_wait_s: float = 0.0                      # the longest an awaited id has waited
    guard: bool = False                             # several interfaces: claims are guarded
    placed: FrozenSet[FlowKey] = frozenset()        # guarded flows whose class is where they leave


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
    handle: str                          # the backend's name for its class, shown only ("f1f0:12")
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
    interface: str = ""                  # the interface it is shaped on (issue 29)

    def stats_key(self, interface: str = "") -> StatsKey:
        """Its class's key in a statistics map: on its own interface, else on ``interface``
        (the daemon's one interface)."""
        return StatsKey(self.interface or interface, self.side, self.key)


@dataclass(frozen=True, slots=True)
class InterfaceView:
    """One shaped interface's backend as status shows it (issue 29)."""
    name: str
    backend: str
    health: BackendHealth
    problem: str
    link_rate_bps: int
    flows: int                           # flow classes on it (send side)
    # where the link rate comes from: "rules", "speed", or a bond with its sending members
    # ("bond0 balance-xor: v0+v1", "via bond0 active-backup: v1"; kernel/bond.py)
    link_rate_source: str = ""
    spares: int = 0                      # spare classes kept for new flows (htb, issue 26)
    ready_classes: int = 0               # the rules' ready_classes where spares are kept, else 0
    groups: int = 0                      # group classes on it (send side: class ids in use)
    rebuild_failures: int = 0            # failed rebuilds of its lost root qdisc, ever
    class_id_limit: int = 0              # ids each side has for flow and group classes (its
    #                                      backend's capabilities.class_ids; 0: no backend now)
    # its receive side (issue 29: one per shaped interface while a rule has a receive_rate):
    # the ifb's name ("" when there is none), its state and why it cannot be set up
    receive_interface: str = ""
    receive_health: BackendHealth = BackendHealth.OK
    receive_problem: str = ""
    fallback: str = ""                   # why backend auto runs another kind here ("": it
    #                                      does not; BackendSupervisor.fallback)
    wanted: str = ""                     # the kind the rules or the command line ask for


@dataclass(frozen=True, slots=True)
class GroupView:
    """One group class (a rule's total or one client's share of a rule) as the kernel has it."""
    kind: Optional[GroupKind]            # None: adopted after a restart, not named by a plan yet
    id: str                              # Group.id ("" until named)
    handle: str                          # the backend's name for its class, shown only
    rate_bps: int                        # its kernel rate (its share when its parent is full)
    ceil_bps: int                        # its cap
    interface: str = ""                  # the interface its class is on (issue 29; the view's)

    @property
    def group_key(self) -> GroupKey:
        return GroupKey(self.kind, self.id)

    def stats_key(self, interface: str = "") -> StatsKey:
        """Its class's key in a statistics map (groups are on the send side): on its own
        interface, else on ``interface`` (the daemon's one interface)."""
        return StatsKey(self.interface or interface, Side.SEND, self.group_key)


@dataclass(frozen=True, slots=True)
class FirstBytePool:
    """One kernel-decided rule's pool of ready classes (issue 16)."""
    rule: str
    ready: int                           # classes ready for the next handshakes now
    claims: int                          # claims of this rule reported since start


@dataclass(frozen=True, slots=True)
class FirstByteCounters:
    """First-byte shaping's counters (issue 16), totals since start, a fixed set: claims (by the
    program), refilled (classes made to top pools up), returned (ready classes taken back
    unclaimed at a reload or stop), released (claims no flow took), exhausted (a rule matched and
    its pool was empty), and why a flow was left to user space or lost. Metrics label each by its
    field name (``flowpacer_first_byte_events{kind}``); status shows them under the same names.
    Issue 26: every flow the kernel decided is counted once in ``claimed`` (paced by a pool
    class), ``stopgap`` (no class ready: paced by TCP at the rule's rate) or ``missed``
    (neither); ``lifted``: stopgaps lifted after their rule changed or, for a guarded claim,
    once its class was placed. Issue 29: ``guarded`` counts claims (in ``claimed``) also paced
    by the stopgap because the daemon shapes several interfaces and the pools are on the first;
    ``placed``, those whose class user space saw on the interface they leave by."""
    claimed: int = 0
    stopgap: int = 0
    missed: int = 0
    lifted: int = 0
    guarded: int = 0
    placed: int = 0
    bound: int = 0
    refilled: int = 0
    returned: int = 0
    released: int = 0
    exhausted: int = 0
    undecided: int = 0
    unattributed: int = 0
    no_match: int = 0
    setsockopt_failed: int = 0
    lost: int = 0
    stale: int = 0
    rebound: int = 0
    closed: int = 0
    sweeps: int = 0
    freed_by_sweep: int = 0
    bad_records: int = 0

    NAMES: ClassVar[Tuple[str, ...]] = ()     # the field names, in order (set below)

    def items(self) -> Tuple[Tuple[str, int], ...]:
        return tuple((n, getattr(self, n)) for n in self.NAMES)


FirstByteCounters.NAMES = tuple(f.name for f in fields(FirstByteCounters))


@dataclass(frozen=True, slots=True)
class FirstByteView:
    """First-byte shaping's pools and counters (issue 16)."""
    pools: Tuple[FirstBytePool, ...]
    counters: FirstByteCounters
    ids_held: int                        # pool ids open sockets carry, not handed out
    ids_awaiting: int                    # claimed ids whose class went, waiting for the socket
    # several interfaces (issue 29): the pools are on the first one (``interface``); a flow
    # claimed at its handshake whose route leaves by another gets its class there after the
    # handshake (``elsewhere`` counts them; ``note`` says so in one line)
    interface: str = ""
    elsewhere: int = 0
    note: str = ""


@dataclass(frozen=True, slots=True)
class UdpTracerCounts:
    """The tracer's UDP counters (issue 17), totals since start, and its live peer/socket maps."""
    idle: int = 0            # flows reported silent for the shortest idle_timeout
    released: int = 0        # sockets with flows closed
    forgotten: int = 0       # silent peers dropped from the kernel map
    woken: int = 0           # connected sockets sending again after a silence
    adopted: int = 0         # connected sockets adopted from a sock_diag snapshot
    peers: int = 0           # unconnected sockets' peers known now
    connected: int = 0       # connected sockets known now


@dataclass(frozen=True, slots=True)
class ProgramStats:
    """One BPF program of the tracer, as the kernel counts it (None: the kernel did not say)."""
    tracepoint: str
    run_time_ns: Optional[int] = None     # with kernel.bpf_stats_enabled
    run_cnt: Optional[int] = None
    recursion_misses: Optional[int] = None


@dataclass(frozen=True, slots=True)
class TracerStats:
    """The tracer's counters, totals since start (``Tracer.stats()`` made typed)."""
    hooks: str = ""
    opens: int = 0                       # OPEN events reported
    closes: int = 0                      # CLOSE events reported
    lost: int = 0                        # events the ring buffer could not take
    unattributed: int = 0                # events without a process
    filtered: int = 0
    accept_untracked: int = 0
    missed: int = 0                      # tracepoint hits the kernel skipped (recursion guard)
    late_open_dropped: int = 0
    udp: UdpTracerCounts = UdpTracerCounts()
    bad_records: int = 0
    programs: Tuple[ProgramStats, ...] = ()

    # the counters ``Tracer.stats()`` gives at its top level under these same names
    COUNTS: ClassVar[Tuple[str, ...]] = ("lost", "unattributed", "filtered", "accept_untracked",
                                         "missed", "late_open_dropped", "bad_records")

    @classmethod
    def from_stats(cls, d: dict) -> "TracerStats":
        """From ``Tracer.stats()``'s dict (a stand-in may give only some of its fields)."""
        ev = d.get("events") or {}
        udp = d.get("udp") or {}
        return cls(
            # the whole-number counters under their own names (a new one needs no line here)
            **{f: int(d.get(f, 0)) for f in cls.COUNTS},
            hooks=str(d.get("hooks", "")), opens=int(ev.get("open", 0)),
            closes=int(ev.get("close", 0)),
            udp=UdpTracerCounts(**{f: int(udp.get(f, 0)) for f in UdpTracerCounts.__slots__}),
            programs=tuple(ProgramStats(tp, info.get("run_time_ns"), info.get("run_cnt"),
                                        info.get("recursion_misses"))
                           for tp, info in (d.get("programs") or {}).items()))


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Latency percentiles in microseconds over the last samples (n == 0: no sample yet)."""
    n: int = 0
    p50_us: float = 0.0
    p90_us: float = 0.0
    p99_us: float = 0.0
    max_us: float = 0.0


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram: (upper bound as text, count at or below it), "+Inf" last."""
    buckets: Tuple[Tuple[str, int], ...] = ()
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DaemonCounters:
    """The reconciler's and supervisor's counters, totals since start."""
    applies: int = 0
    op_errors: int = 0                   # operations the kernel refused (and failed applies)
    reloads_ok: int = 0
    reloads_failed: int = 0
    backend_rebuild_failures: int = 0
    shape_latency: Percentiles = Percentiles()   # tracer event -> class installed
    apply_latency: Percentiles = Percentiles()   # one plan's apply
    reconcile_added: int = 0             # flows a sock_diag pass found that the tracer had not
    reconcile_removed: int = 0
    spares_made: int = 0                 # ready spare classes made (issue 26, ready_classes)
    spare_errors: int = 0                # and refused
    apply_hist: Histogram = Histogram()


@dataclass(frozen=True, slots=True)
class EventCounts:
    """Flow events by source and kind, totals since start (``FlowTable.events``)."""
    tracer_open: int = 0
    tracer_close: int = 0
    reconcile_open: int = 0
    reconcile_close: int = 0
    idle_close: int = 0

    def items(self):
        """(source, kind, count) of every counter, in a fixed order."""
        for name in self.__slots__:
            source, kind = name.split("_", 1)
            yield source, kind, getattr(self, name)


class FlowSourceMode(str, enum.Enum):
    """How the daemon finds flows now."""
    NOT_STARTED = "not started"
    TRACER = "tracer"                    # eBPF tracer, sock_diag reconciles
    NO_TRACER = "--no-tracer"            # sock_diag polling only: configured so
    TRACER_CANNOT_LOAD = "tracer cannot load"   # ... bcc missing
    TRACER_UNAVAILABLE = "tracer unavailable"   # ... the kernel refused it
    TRACER_FAILED = "tracer failed"      # ... its stage was given up


@dataclass(frozen=True, slots=True)
class FlowSourceStatus:
    """The flow source: ``mode`` and its ``detail`` (the tracer's hooks, or why it is not
    running); ``first_byte``: first-byte shaping's one-line summary when it runs (issue 16)."""
    mode: FlowSourceMode = FlowSourceMode.NOT_STARTED
    detail: str = ""
    first_byte: str = ""

    @property
    def polling(self) -> bool:
        return self.mode not in (FlowSourceMode.TRACER, FlowSourceMode.NOT_STARTED)

    @property
    def text(self) -> str:
        """The one line status, metrics and the log show."""
        m = self.mode
        if m is FlowSourceMode.NOT_STARTED:
            out = m.value
        elif m is FlowSourceMode.TRACER:
            out = f"tracer ({self.detail or 'tracepoints'}) + sock_diag reconcile"
        elif m is FlowSourceMode.NO_TRACER:
            out = f"sock_diag polling only ({m.value})"
        else:
            out = f"sock_diag polling only ({m.value}: {self.detail})"
        return f"{out}; {self.first_byte}" if self.first_byte else out


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What a rules reload did (the control socket's ``reload`` answer, ``view.reload_json``)."""
    ok: bool
    errors: Tuple[str, ...] = ()         # the problems (refused) or the refused operations
    rules_changed: bool = False
    switched_backend: bool = False
    added: int = 0
    changed: int = 0
    removed: int = 0


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
    flow_source: FlowSourceStatus
    tracer: Optional[TracerStats]        # None when the tracer is not running
    live_flows: int
    flows: Tuple[FlowView, ...]
    stages: Tuple[StageView, ...]
    counters: DaemonCounters
    events: EventCounts
    groups: Tuple[GroupView, ...] = ()   # group classes (issue 15) of every shaped interface
    # the receive side (issue 17): its ifb (None: no rule receives), health and problem
    receive_interface: Optional[str] = None
    receive_health: BackendHealth = BackendHealth.OK
    receive_problem: str = ""
    first_byte: Optional[FirstByteView] = None   # issue 16; None when the stage is off
    backend_fell_back: bool = False      # a lost psp replaced by htb (BackendSupervisor.fell_back)
    # issue 27.5: the kind the rules ask for ("auto", "psp", "htb"), and why auto's preferred
    # kind is not the one in use (e.g. the kernel refused the unsigned module), "" when it is
    backend_wanted: str = ""
    backend_fallback: str = ""
    # issue 29: every shaped interface (the first is ``interface`` above), and the flows a rule
    # shapes that leave by an interface not managed (or by none), by that interface's name
    interfaces: Tuple["InterfaceView", ...] = ()
    unmanaged: Tuple[Tuple[FlowKey, str], ...] = ()
    routed: bool = False                 # flows are shaped on the interface they leave by

    @property
    def healthy(self) -> bool:
        """Every stage that should run is running."""
        return all(s.state in (StageState.RUNNING, StageState.DISABLED) for s in self.stages)
