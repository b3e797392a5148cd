"""The backend contract: exactly what the daemon calls on a backend and on a tc codec.

``Backend`` names every member the daemon uses (reconciler, supervisor, view, app);
what a backend can do is declared in its ``capabilities`` (a frozen ``Capabilities``), never
probed with ``getattr``. First-byte pools are a separate ``Pools`` protocol: only a backend whose
``capabilities.pools`` is true has them. ``Codec`` is what ``TcBackend`` asks of an htb or psp
encoder, with its own declared attributes.

Keys: the daemon knows a flow's class by its ``FlowKey``, a group's by its ``GroupKey`` and the
default class by ``ClassRole.DEFAULT``; a backend's own class ids stay inside it (a display
string, ``handle``, is all it gives out, for the status' class column, and how many it has,
``capabilities.class_ids``, for the metrics' limit).

``missing_members(obj, protocol)`` lists what ``obj`` lacks of a protocol, attributes included
(``isinstance`` on a runtime-checkable protocol checks methods only by name, and not the
attributes' presence on every Python version): the contract tests use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import (Dict, List, Optional, Protocol, Sequence, Tuple, Union,
                    runtime_checkable)

from flowpacer.model import (ApplyResult, BackendHealth, BackendKind, ClassRole, ClassStats,
                             FlowKey, GroupKey, GroupView, Op, PoolOp, Shape, Side,
                             SpareOp)
from flowpacer.kernel.backend.pool import Pool

ClassKey = Union[FlowKey, GroupKey, ClassRole]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by it."""
    has_classes: bool        # one kernel class per flow, with counters (class_stats)
    groups: bool             # client_rate/total_rate enforced by group classes above the flows
    kernel_shares: bool      # the kernel shares a group's rate among its members (psp)
    pools: bool              # first-byte pool classes (the ``Pools`` protocol)
    side: Side               # which way it shapes (RECEIVE: an ifb backend, issue 17)
    # closed flows' classes are kept as spares for new flows, and ``SpareOp``s make ready ones
    # ahead of a burst (issue 26: htb, whose kernel walks every class for each class made)
    spares: bool
    class_ids: int           # ids it has for flow and group classes: one more flow is refused


class StatsChannel(Protocol):
    """A thread's own way to a backend's counters (a netlink socket for the tc backends)."""

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """One backend on one interface and side. Every method the daemon calls, no other."""
    kind: BackendKind
    name: str                    # shown in status and logs ("htb", "psp")
    interface: str               # the device it shapes (the ifb on the receive side)
    link_rate_bps: int
    link_rate_source: str        # "rules", "speed", or a bond and its sending members (bond.py)
    capabilities: Capabilities

    # life cycle (supervisor)
    def setup(self) -> None:
        """Create the skeleton or adopt the one a previous run left. Raises FlowpacerError."""

    def check(self) -> BackendHealth: ...

    def audit(self) -> List[FlowKey]:
        """Flows whose class someone else removed: forgotten and returned (re-planned)."""

    def forget(self) -> None:
        """Drop the bookkeeping (its kernel objects are gone or not its own any more)."""

    def resync(self) -> None:
        """Rebuild the bookkeeping from the kernel after a transport error."""

    def teardown(self) -> None: ...

    def close(self) -> None: ...

    # flows (reconciler)
    def apply(self, plan: Sequence[Union[Op, SpareOp]]) -> ApplyResult:
        """Idempotent; a refused op is an ``OpError`` (one line, the kernel's extack text) and
        the others still apply. A ``SpareOp`` (only with ``capabilities.spares``) makes ready
        spare classes: ``ApplyResult.spares_made``, a refusal in ``spare_errors``."""

    def installed(self) -> Dict[FlowKey, Shape]: ...

    def shape_of(self, key: FlowKey) -> Optional[Shape]: ...

    # views (status, metrics, top)
    def flows_snapshot(self) -> List[Tuple[FlowKey, str, Shape]]:
        """[(key, handle, shape)]: every installed flow, its class' display name."""

    def group_views(self) -> Tuple[GroupView, ...]:
        """The group classes as the kernel has them (() without ``capabilities.groups``)."""

    def spare_count(self) -> int:
        """Spare classes kept (issue 26: a closed flow's class, no filter, kept for the next new
        flow; 0 for a backend that deletes them)."""

    def spare_handles(self) -> Tuple[str, ...]:
        """The spare classes' display names (sorted): what a check of the kernel may find without
        a filter and not count as leaked."""

    def open_stats_channel(self) -> StatsChannel:
        """A channel for ``class_stats`` from a thread other than the reconciler's."""

    def class_stats(self, channel: Optional[StatsChannel] = None) -> Dict[ClassKey, ClassStats]:
        """The counters of its classes now, by flow, group and role (one read)."""

    def stats(self) -> Dict[FlowKey, ClassStats]:
        """The flows' counters (``class_stats`` restricted to flows)."""


@runtime_checkable
class Pools(Protocol):
    """First-byte pool classes (issue 16): a backend whose ``capabilities.pools`` is true keeps
    the pools' bookkeeping in ``pool`` (backend/pool.py ``Pool``: what the engine plans from,
    ``Pool.holding()``) and applies the engine's ``PoolOp``s in ``apply``, in the same batch as
    the flows' ops. The reconciler alone calls them (``Reconciler.on_claims``)."""
    pool: "Pool"

    def apply(self, plan: Sequence[Union[Op, PoolOp, SpareOp]]) -> ApplyResult: ...


@runtime_checkable
class Codec(Protocol):
    """What ``TcBackend`` asks of a qdisc kind's encoder (backend/htb.py, backend/psp.py)."""
    kind: BackendKind
    qdisc_kind: str              # the kernel's name of the root qdisc ("htb", "psp")
    has_link_class: bool         # a link class :1 carries the link rate (htb)
    makes_default_class: bool    # the qdisc makes its default class itself (psp)
    supports_groups: bool        # group classes above the flows (issue 15)
    kernel_shares: bool          # the kernel shares a group's rate (groups.targets: nominal rates)

    def qdisc_options(self, link_rate_bps: int, default_minor: int) -> bytes: ...

    def link_class_options(self, link_rate_bps: int) -> bytes: ...

    def default_class_options(self, link_rate_bps: int) -> bytes: ...

    def group_class_options(self, rate_bps: int, ceil_bps: int, link_rate_bps: int) -> bytes: ...

    def flow_class_options(self, shape: Shape, link_rate_bps: int) -> bytes: ...

    def parse_rates(self, options: dict) -> Tuple[int, int]: ...


def members(protocol) -> List[str]:
    """The names a protocol declares: its annotated attributes and its methods."""
    names = set()
    for klass in protocol.__mro__:
        if klass in (object, Protocol) or klass.__name__ in ("Generic",):
            continue
        names.update(getattr(klass, "__annotations__", {}))
        names.update(n for n, v in vars(klass).items()
                     if callable(v) and not n.startswith("_"))
    return sorted(names)


def missing_members(obj, protocol) -> List[str]:
    """The members of ``protocol`` that ``obj`` lacks (empty: it keeps the contract)."""
    return [n for n in members(protocol) if not hasattr(obj, n)]
