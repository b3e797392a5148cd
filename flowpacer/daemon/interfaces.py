"""Several interfaces (issue 29): one ``BackendSupervisor`` per managed interface, and which
interface each flow leaves by.

    rules' interfaces: [eth0, {name: eth1, link_rate: 10gbit}, "vs*"]
        │ resolved at start, on reload and at every reconcile pass (a device that appears)
        v
    InterfaceSet ── ports: {eth0: BackendSupervisor, eth1: ..., vs1: ...}  (first: primary)
        │ egress(flows): RTM_GETROUTE per flow (kernel/route.py: tuple, uid, the socket's
        │ mark and bound device), cached; the reconcile pass re-checks every live flow, so a
        │ route change moves a live flow (and a socket whose mark changed, at its snapshot)
        v
    Reconciler: each port's backend gets the flows that leave by its interface

Without ``interfaces:`` in the rules (``interface:``, or the CLI's ``--interface``, which
overrides the file) there is one port and no route lookup: every flow is shaped on that one
interface, as before. Each port keeps its own health (a qdisc removed on one interface does not
disturb the others), rebuild and fall-back. What the surfaces read of a single backend
(``backend``, ``health``, ``rx``, ...) is the first port's; ``backends()``, ``check()``,
``class_stats()`` and ``shutdown()`` cover them all. Every port has its own receive side while
a rule has a ``receive_rate`` (its ifb ``fpi-<interface>``, ingress.py): a flow's receive class
is on the ifb of the interface its route leaves by, which is the one its packets arrive by when
routing is symmetric (docs/rules.md says what happens when it is not).

A flow that a rule shapes but whose egress is an interface not managed (or that has no route) is
counted (``unmanaged``: by flow, its interface's name, "" without a route) for status and the
``flowpacer_flows_unmanaged_interface`` metric; the reconciler keeps it there.
"""
from __future__ import annotations

import fnmatch
import logging
import time
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from flowpacer.daemon.supervisor import BackendSupervisor, Recheck, StatsChannels
from flowpacer.kernel.route import RouteQuery
from flowpacer.errors import BackendError, FlowpacerError
from flowpacer.model import BackendKind, ClassStats, FlowKey, RuleSet, StatsKey

log = logging.getLogger(__name__)


class Router:
    """The real route lookup and device list (kernel/route.py); fakes give their own."""

    def __init__(self):
        from flowpacer.kernel.route import RouteLookup
        self._lookup = RouteLookup()

    def egress(self, items: Iterable[RouteQuery]) -> Dict[FlowKey, Optional[str]]:
        """Each flow's output interface name (None: no route)."""
        from flowpacer.kernel.route import ifname
        names: Dict[int, Optional[str]] = {}
        out = {}
        for key, index in self._lookup.egress(items).items():
            if index not in names:
                names[index] = ifname(index)
            out[key] = names[index]
        return out

    def links(self) -> List[str]:
        from flowpacer.kernel.route import link_names
        return link_names()

    def close(self) -> None:
        self._lookup.close()


def _primary_field(name: str) -> property:
    """A read-only attribute of InterfaceSet that is its first port's ``name``."""
    def get(self):
        p = self.primary
        if p is None:
            raise AttributeError(f"{name}: no interface is managed yet")
        return getattr(p, name)
    return property(get, doc=f"The first interface's ``{name}``.")


class InterfaceSet:
    """The supervisors of every managed interface, for the reconciler and the surfaces."""

    def __init__(self, factory, *, interface: Optional[str] = None,
                 kind: Optional[BackendKind] = None, clock: Callable[[], float] = time.monotonic,
                 router=None):
        self.factory = factory
        self.interface_override = interface
        self.kind_override = kind
        self.clock = clock
        self._router = router
        self.routed = False              # several interfaces: flows go where their route says
        self._ports: Dict[str, BackendSupervisor] = {}
        self._rules: Optional[RuleSet] = None
        self._egress: Dict[FlowKey, Optional[str]] = {}    # route cache (under the rec. lock)
        self._was: Dict[FlowKey, Optional[str]] = {}       # routes to look up again (recheck)
        self.unmanaged: Dict[FlowKey, str] = {}            # shaped by a rule, egress not ours
        self.route_checks = 0            # flows whose route was looked up, ever
        self.route_moves = 0             # flows that moved to another interface, ever
        self._port_problems: Dict[str, str] = {}           # glob matches that could not start

    # ------------------------------------------------------ single-backend view
    @property
    def primary(self) -> Optional[BackendSupervisor]:
        return next(iter(self._ports.values()), None)

    # What the surfaces read of "the" backend, declared one by one: the first interface's
    # (status' top-level backend fields; every interface's are in ``ports()``).
    backend = _primary_field("backend")
    rx = _primary_field("rx")
    health = _primary_field("health")
    problem = _primary_field("problem")
    reason = _primary_field("reason")
    fell_back = _primary_field("fell_back")
    fallback = _primary_field("fallback")
    rx_health = _primary_field("rx_health")
    rx_problem = _primary_field("rx_problem")
    rx_usable = _primary_field("rx_usable")

    def kind_of(self, rs: RuleSet) -> BackendKind:
        """The backend kind the rules (or the command line) ask for."""
        p = self.primary
        if p is None:
            raise AttributeError("kind_of: no interface is managed yet")
        return p.kind_of(rs)

    def ports(self) -> List[BackendSupervisor]:
        return list(self._ports.values())

    def port(self, ifname: str) -> Optional[BackendSupervisor]:
        """The supervisor of interface ``ifname`` (None: not managed)."""
        p = self._ports.get(ifname)
        if p is None and self._rules is not None and not self.routed:
            p = next((q for q in self._ports.values()
                      if q.interface_of(self._rules) == ifname), None)
        return p

    def backends(self) -> list:
        return [b for p in self._ports.values() for b in p.backends()]

    @property
    def usable(self) -> bool:
        p = self.primary
        return p is not None and p.usable

    # ------------------------------------------------------------- set-up
    def _multi(self, rs: RuleSet) -> bool:
        return bool(rs.interfaces) and not self.interface_override

    def _router_(self):
        if self._router is None:
            self._router = Router()
        return self._router

    def wanted(self, rs: RuleSet) -> List[str]:
        """The interfaces ``rs`` names, in its order: plain names as given, globs expanded
        over the devices there are now (sorted)."""
        if not self._multi(rs):
            return [""]                  # one port, named by the rules or --interface
        out: List[str] = []
        links = None
        for spec in rs.interfaces:
            if not spec.is_glob:
                names = [spec.name]
            else:
                if links is None:
                    try:
                        links = sorted(self._router_().links())
                    except OSError as e:
                        raise BackendError(f"interfaces: cannot list the devices: {e}") from None
                names = [n for n in links if fnmatch.fnmatchcase(n, spec.name)]
            out.extend(n for n in names if n not in out)
        return out

    def _make_port(self, name: str, rs: RuleSet) -> BackendSupervisor:
        p = BackendSupervisor(self.factory, interface=name or self.interface_override,
                              kind=self.kind_override, clock=self.clock)
        p.start(rs)
        return p

    def start(self, rs: RuleSet) -> None:
        """Set up a backend on every interface of ``rs``. Raises FlowpacerError (and leaves
        nothing behind) when one cannot be set up or nothing matches."""
        names = self.wanted(rs)
        if not names:
            raise BackendError("interfaces: no device matches " + ", ".join(
                repr(s.name) for s in rs.interfaces))
        made: Dict[str, BackendSupervisor] = {}
        try:
            for n in names:
                made[n] = self._make_port(n, rs)
        except FlowpacerError:
            for p in made.values():
                p.shutdown()
            raise
        self._ports = made
        self._rules = rs
        self.routed = self._multi(rs)
        self._egress.clear()
        self._was.clear()
        self.unmanaged.clear()
        if self.routed:
            log.info("shaping on %s; each flow on the interface it leaves by",
                     ", ".join(self._ports))

    # ------------------------------------------------------------- routes
    def egress(self, flows: Dict[FlowKey, object]) -> Dict[FlowKey, Optional[str]]:
        """The interface each flow leaves by, from the cache or looked up now (the caller holds
        the reconciler's lock)."""
        missing = [k for k in flows if k not in self._egress]
        if missing:
            got = self._lookup({k: flows[k] for k in missing})
            self._egress.update(got)
            for k, name in got.items():
                if k in self._was:
                    old = self._was.pop(k)
                    if old != name:
                        self.route_moves += 1
                        log.info("%s now leaves by %s (was %s): its socket's mark or bound "
                                 "device changed", k, name or "no route", old or "no route")
        return {k: self._egress.get(k) for k in flows}

    def _lookup(self, flows: Dict[FlowKey, object]) -> Dict[FlowKey, Optional[str]]:
        try:
            got = self._router_().egress(_query(k, f) for k, f in flows.items())
        except OSError as e:
            log.warning("route lookups failed: %s; retried at the next pass", e)
            return {}
        self.route_checks += len(got)
        return got

    def placed(self, keys: Iterable[FlowKey]) -> FrozenSet[FlowKey]:
        """Of ``keys``, the flows whose send-side class is on the interface their route leaves
        by (the caller holds the reconciler's lock; routes from the cache only)."""
        out = []
        for k in keys:
            p = self._ports.get(self._egress.get(k) or "")
            if p is not None and p.usable and p.backend is not None \
                    and p.backend.shape_of(k) is not None:
                out.append(k)
        return frozenset(out)

    def routed_flows(self, flows: Dict[FlowKey, object]) -> Dict[FlowKey, object]:
        """The live flows whose route matters: those looked up before (a rule shapes them)
        and those counted unmanaged (the caller holds the lock)."""
        return {k: flows[k] for k in (*self._egress, *self.unmanaged) if k in flows}

    def reroute(self, flows: Dict[FlowKey, object]) -> Dict[FlowKey, Optional[str]]:
        """Look every flow's route up again (the reconcile pass, outside the lock); the answer
        goes to ``moved`` under the lock."""
        if not self.routed or not flows:
            return {}
        return self._lookup(flows)

    def moved(self, fresh: Dict[FlowKey, Optional[str]], live: Iterable[FlowKey]) -> List[FlowKey]:
        """Take a ``reroute`` answer (under the lock): the flows whose interface changed (to be
        re-planned: their class leaves the old interface, a new one is made on the new);
        flows no longer live leave the cache."""
        live = set(live)
        for k in [k for k in self._egress if k not in live]:
            del self._egress[k]
        for k in [k for k in self.unmanaged if k not in live]:
            del self.unmanaged[k]
        for k in [k for k in self._was if k not in live]:
            del self._was[k]
        out = []
        for k, name in fresh.items():
            if k not in live:
                continue
            if k not in self._egress:           # its first lookup had failed
                self._egress[k] = name
                out.append(k)
            elif self._egress[k] != name:
                log.info("%s now leaves by %s (was %s)", k, name or "no route",
                         self._egress[k] or "no route")
                self._egress[k] = name
                out.append(k)
        self.route_moves += len(out)
        return out

    def recheck_routes(self, keys: Iterable[FlowKey]) -> None:
        """The sockets of ``keys`` have a new mark or bound device (a snapshot saw it, under
        the lock): their route is looked up again when they are planned (they are dirty), and
        one that changed counts as a move."""
        for k in keys:
            if k in self._egress:
                self._was[k] = self._egress.pop(k)

    def forget_routes(self, keys: Iterable[FlowKey]) -> None:
        for k in keys:
            self._egress.pop(k, None)
            self._was.pop(k, None)
            self.unmanaged.pop(k, None)

    # ------------------------------------------------------------- health
    def watched_links(self) -> set:
        """The devices whose RTNL link events matter (the main loop's ``watched``): every
        shaped interface and the devices below it (a VLAN's bond, the bond's members), whose
        state the link rate follows (kernel/bond.py)."""
        from flowpacer.kernel.bond import below
        names = set()
        for p in list(self._ports.values()):     # (a reload may replace the dict meanwhile)
            b = p.backend
            if b is not None:
                names.add(b.interface)
                names.update(below(b.interface))
        return names

    def check(self) -> Recheck:
        """Every port's health; with globs, devices that appeared since get a port."""
        out = Recheck()
        if self.routed and any(s.is_glob for s in self._rules.interfaces):
            if self._add_new_matches():
                out.mark_all = True
        for p in self._ports.values():
            r = p.check()
            out.mark_all |= r.mark_all
            out.installed.extend(r.installed)
            out.gone.extend(r.gone)
            out.audited |= r.audited
        return out

    def _add_new_matches(self) -> bool:
        try:
            names = self.wanted(self._rules)
        except FlowpacerError as e:
            log.debug("%s", e)
            return False
        added = False
        for n in names:
            if n in self._ports:
                continue
            try:
                self._ports[n] = self._make_port(n, self._rules)
            except FlowpacerError as e:
                if self._port_problems.get(n) != str(e):
                    log.warning("%s: matches the rules' interfaces but cannot be shaped: %s; "
                                "retrying at every pass", n, e)
                self._port_problems[n] = str(e)
                continue
            self._port_problems.pop(n, None)
            log.info("%s appeared: shaping on it too", n)
            added = True
        if added:      # flows counted unmanaged may leave by it: look them up again
            self.forget_routes(list(self.unmanaged))
        return added

    # -------------------------------------------------------------- reload
    def needs_switch(self, new: RuleSet) -> bool:
        if self._multi(new) != self.routed:
            return True
        if list(self._ports) != self.wanted(new):
            return True
        return any(p.needs_switch(new) for p in self._ports.values())

    def switch(self, new: RuleSet) -> None:
        """Ports no longer named go (their objects removed), new ones are set up, the others
        switch as a single interface's supervisor does (which puts its old configuration back
        when the new one fails). On failure FlowpacerError is raised: a new port that failed is
        not added, the ports handled before it keep the new rules; the caller re-applies every
        flow either way."""
        old_rules = self._rules
        if self._multi(new) != self.routed or not self.routed:
            for p in self._ports.values():
                p.shutdown()
            self._ports = {}
            try:
                self.start(new)
            except FlowpacerError:
                self.start(old_rules)
                raise
            return
        names = self.wanted(new)
        if not names:
            raise BackendError("interfaces: no device matches " + ", ".join(
                repr(s.name) for s in new.interfaces))
        kept: Dict[str, BackendSupervisor] = {}
        for n, p in list(self._ports.items()):
            if n not in names:
                log.info("%s: no longer in the rules' interfaces; its classes are removed", n)
                p.shutdown()
                del self._ports[n]
        try:
            for n in names:
                p = self._ports.get(n)
                if p is None:
                    p = self._make_port(n, new)
                    kept[n] = p
                    continue
                if p.needs_switch(new):
                    p.switch(new)
                else:
                    p.adopt_rules(new)
                kept[n] = p
        except FlowpacerError:
            for n, p in kept.items():
                if n not in self._ports:
                    p.shutdown()
            raise
        self._ports = kept
        self._rules = new
        self._egress.clear()             # re-planned with fresh routes
        self._was.clear()

    def adopt_rules(self, rs: RuleSet) -> None:
        self._rules = rs
        for p in self._ports.values():
            p.adopt_rules(rs)

    # ---------------------------------------------------------- statistics
    def open_stats_channel(self) -> StatsChannels:
        return StatsChannels()

    def class_stats(self, channels: StatsChannels) -> Dict[StatsKey, ClassStats]:
        """Every port's counters, each keyed with its own interface. One interface's failure
        leaves the others' counters (it is logged; with a single interface it is raised)."""
        out: Dict[StatsKey, ClassStats] = {}
        ports = list(self._ports.values())
        for p in ports:
            try:
                out.update(p.class_stats(channels, retain=False))
            except (OSError, FlowpacerError) as e:
                if len(ports) == 1:
                    raise
                log.debug("%s: class statistics: %s", p.parent_name(), e)
        channels.retain(self.backends())
        return out

    def shutdown(self, keep: bool = False) -> None:
        for p in self._ports.values():
            p.shutdown(keep=keep)
        if self._router is not None and hasattr(self._router, "close"):
            self._router.close()


def _query(key: FlowKey, flow) -> RouteQuery:
    """What the kernel's output lookup of ``flow``'s socket uses: its tuple, its owner's uid
    (``ip rule uidrange``), its mark (``ip rule fwmark``) and the device it is bound to
    (SO_BINDTODEVICE, or the VRF it is in: ``ip rule oif``, l3mdev)."""
    proc = getattr(flow, "proc", None)
    uid = getattr(proc, "uid", -1) if proc is not None else -1
    return RouteQuery(key, uid if isinstance(uid, int) else -1, getattr(flow, "mark", 0) or 0,
                      getattr(flow, "bound_if", 0) or 0)
