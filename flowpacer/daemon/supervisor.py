"""The backend supervisor: which backend runs, its health, and what to do when it changes.

It owns the backend object and its life cycle: start, the health check at every reconcile
pass (``check``), rebuilding a lost root qdisc, ``backend: auto``'s fall-back from psp to htb
when the module is gone, and the clean switch-over on a reload that changes the interface,
backend kind or link rate. It never plans flows: it answers what the reconciler must re-apply
(``Recheck``), and the reconciler does it.

The backend is made by an injected ``BackendFactory``, so the whole state machine is tested
in-process against an in-memory backend (tests/fakes).
"""
from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Protocol

from flowpacer.errors import BackendError, FlowpacerError
from flowpacer.kernel.backend import registry
from flowpacer.kernel.backend.contract import Backend, StatsChannel
from flowpacer.model import (BackendHealth, BackendKind, ClassStats, FlowKey, RuleSet, Side,
                             StatsKey)

log = logging.getLogger(__name__)

AUDIT_S = 5.0          # how often the flow classes are checked against the kernel
REBUILD_LOG_S = 60.0   # a backend that cannot be rebuilt: its warning is repeated this often


class BackendFactory(Protocol):
    def make(self, kind: BackendKind, interface: str, link_rate_bps: Optional[int]):
        """A backend set up on ``interface`` (its root qdisc in place) and why this kind;
        raises FlowpacerError."""

    def fallback(self, kind: BackendKind, lost: BackendKind, interface: str,
                 link_rate_bps: Optional[int]):
        """(backend set up, reason) to replace the lost backend of kind ``lost``, or None to
        keep retrying it; raises FlowpacerError when the replacement cannot be set up."""

    def preferred_available(self) -> bool:
        """May a reload go back to auto's preferred kind (psp) after a fall-back?"""

    def make_receive(self, send_backend: Backend, interface: str, link_rate_bps: Optional[int]):
        """The receive side's backend (same kind as ``send_backend``) set up on
        ``interface``'s ingress (issue 17); raises FlowpacerError."""

    def cleanup_receive(self, interface: str) -> None:
        """Remove a receive side that a previous run left (no rule receives now)."""


class TcBackendFactory:
    """The real thing: tc backends over rtnetlink, of the kinds in backend/registry.py."""

    def __init__(self, take_over: bool = False):
        self.take_over = take_over

    def make(self, kind, interface, link_rate_bps):
        from flowpacer.kernel.backend import choose
        codec, reason = choose(kind)
        return self._set_up(codec, interface, link_rate_bps), reason

    def fallback(self, kind, lost, interface, link_rate_bps):
        from flowpacer.kernel.backend import fallback
        alt = fallback(kind, lost)
        if alt is None:
            return None
        codec, reason = alt
        return self._set_up(codec, interface, link_rate_bps), reason

    def _set_up(self, codec, interface, link_rate_bps):
        """A TcBackend with its root qdisc in place; its netlink socket closed on failure."""
        from flowpacer.kernel.backend.handles import SPARE_MAX
        from flowpacer.kernel.backend.tc import TcBackend
        # whether closed flows' classes are kept as spares is the kind's own declaration
        spares = SPARE_MAX if registry.spec(codec.kind).keeps_spares else 0
        return self._ready(TcBackend(codec, interface, link_rate_bps, self.take_over,
                                     spare_max=spares))

    @staticmethod
    def _ready(b):
        """``b`` set up, or its netlink socket closed and the error raised."""
        try:
            b.setup()
        except BaseException:
            b.close()
            raise
        return b

    def preferred_available(self) -> bool:
        from flowpacer.kernel.backend import available, registry
        return available(registry.auto_order()[0].kind)[0]

    def make_receive(self, send_backend, interface, link_rate_bps):
        from flowpacer.kernel.backend import registry
        from flowpacer.kernel.backend.ingress import IngressBackend
        codec = registry.spec(send_backend.kind).codec()
        return self._ready(IngressBackend(codec, interface, link_rate_bps))

    def cleanup_receive(self, interface):
        from flowpacer.kernel.backend.ingress import cleanup
        cleanup(interface)


@dataclass
class Recheck:
    """What a health check asks of the reconciler."""
    mark_all: bool = False                       # re-plan every live flow (rebuilt, fell back)
    installed: List[FlowKey] = field(default_factory=list)   # and these (adopted) keys
    gone: List[FlowKey] = field(default_factory=list)        # classes someone else removed
    audited: bool = False                        # this pass audited the classes (every AUDIT_S)


class BackendSupervisor:
    # one supervisor shapes every flow (no route lookups, no flow leaving by an interface it
    # does not manage): see InterfaceSet (interfaces.py)
    routed = False
    unmanaged: Mapping[FlowKey, str] = MappingProxyType({})

    def __init__(self, factory: BackendFactory, *, interface: Optional[str] = None,
                 kind: Optional[BackendKind] = None, clock: Callable[[], float] = time.monotonic):
        self.factory = factory
        self.interface_override = interface
        self.kind_override = kind
        self.clock = clock
        self.backend = None
        self.reason = ""
        self.health = BackendHealth.OK
        self.problem = ""              # why the backend cannot be rebuilt (empty when it can)
        self.fell_back = False         # auto: psp was lost and htb stands in until reload/restart
        self.fallback = ""             # why auto does not use its preferred kind ("" when it does)
        self.rebuild_failures = 0      # failed rebuild attempts, ever
        self._episode_failures = 0     # failed rebuilds since the backend last worked
        self._problem_logged_at = 0.0
        self._next_audit = 0.0
        self._rules: Optional[RuleSet] = None
        # the receive side (issue 17): an ingress backend while some rule has a receive_rate
        self.rx = None
        self.rx_health = BackendHealth.OK
        self.rx_problem = ""            # why the receive side cannot be set up or rebuilt
        self._rx_problem_logged_at = 0.0

    # ------------------------------------------------------------- set-up
    def recheck_routes(self, keys) -> None:
        """(One interface: no route is looked up, nothing to look up again.)"""

    def interface_of(self, rs: RuleSet) -> str:
        ifname = self.interface_override or rs.interface
        if not ifname:
            raise BackendError("no interface: give it in the rules file or with --interface")
        return ifname

    def kind_of(self, rs: RuleSet) -> BackendKind:
        return self.kind_override or rs.backend

    def link_rate_of(self, rs: RuleSet) -> Optional[int]:
        """The link rate for this interface: its own entry's in ``interfaces:`` (issue 29; the
        first entry, name or glob, that names it and gives one), else the top-level one."""
        if rs.interfaces:
            name = self.interface_override or rs.interface
            for spec in rs.interfaces:
                if spec.link_rate_bps is not None and name and (
                        spec.name == name or (spec.is_glob and fnmatch.fnmatchcase(name,
                                                                                   spec.name))):
                    return spec.link_rate_bps
        return rs.link_rate_bps

    def ports(self) -> list:
        """The per-interface supervisors (one here; several in an InterfaceSet)."""
        return [self]

    def start(self, rs: RuleSet) -> None:
        """Set up the backend for ``rs``. Raises FlowpacerError."""
        self.backend, self.reason = self.factory.make(self.kind_of(rs), self.interface_of(rs),
                                                      self.link_rate_of(rs))
        self._rules = rs
        self.health = BackendHealth.OK
        self.fell_back = False
        self.problem = ""
        self._episode_failures = 0
        self._note_fallback(rs)
        if self.fallback:
            log.warning("backend %s on %s instead of %s: %s", self.backend.name,
                        self.backend.interface, registry.auto_order()[0].kind.value, self.reason)
        else:
            log.info("backend %s on %s (%s)", self.backend.name, self.backend.interface,
                     self.reason)
        self._sync_receive(rs, at_start=True)

    def _note_fallback(self, rs: RuleSet) -> None:
        """``fallback``: the reason (one line) when ``auto`` runs a kind other than its
        preferred one (psp refused or lost), else ""."""
        preferred = registry.auto_order()[0].kind.value
        used = self.backend.name if self.backend is not None else ""
        self.fallback = (self.reason if self.kind_of(rs) is BackendKind.AUTO and used
                         and used != preferred else "")

    @property
    def usable(self) -> bool:
        return self.backend is not None and self.health is BackendHealth.OK

    @property
    def rx_usable(self) -> bool:
        return self.rx is not None and self.rx_health is BackendHealth.OK

    def backends(self) -> list:
        """The backends in use: the send side's, then the receive side's if there is one."""
        return [b for b in (self.backend, self.rx) if b is not None]

    # ------------------------------------------------------- receive side
    def _sync_receive(self, rs: RuleSet, at_start: bool = False) -> bool:
        """Have a receive side exactly while some rule of ``rs`` receives. True when one was
        made now (the caller re-plans every flow)."""
        if not rs.receives:
            if self.rx is not None:
                self._drop_receive()
            elif at_start:
                try:
                    self.factory.cleanup_receive(self.backend.interface)
                except (OSError, FlowpacerError) as e:
                    log.warning("%s: cannot remove a receive side left by an earlier run: %s",
                                self.backend.interface, e)
            self.rx_problem = ""
            return False
        if self.rx is not None:
            return False
        try:
            self.rx = self.factory.make_receive(self.backend, self.backend.interface,
                                                self.link_rate_of(rs))
        except (OSError, FlowpacerError) as e:
            self._rx_failed(f"cannot set up the receive side: {e}")
            return False
        self.rx_health = BackendHealth.OK
        if self.rx_problem:
            log.warning("%s: receive side set up after all", self.backend.interface)
        self.rx_problem = ""
        log.info("receive side of %s on %s (%s)", self.backend.interface, self.rx.interface,
                 self.rx.name)
        return True

    def _rx_failed(self, reason: str) -> None:
        """Logged once per reason and then every REBUILD_LOG_S; retried at every pass. The
        send side is not affected; received traffic is unshaped meanwhile."""
        now = self.clock()
        if reason != self.rx_problem or now - self._rx_problem_logged_at >= REBUILD_LOG_S:
            log.warning("%s: %s; uploads are not shaped, retrying at every pass",
                        self.backend.interface if self.backend else "?", reason)
            self._rx_problem_logged_at = now
        self.rx_problem = reason

    def _drop_receive(self) -> None:
        rx, self.rx = self.rx, None
        try:
            rx.teardown()
        finally:
            rx.close()
        self.rx_health = BackendHealth.OK

    def _check_receive(self, out: "Recheck") -> None:
        """The receive side's health, as ``check`` does for the send side: audit while OK,
        rebuild when LOST/SPEED, wait while GONE/FOREIGN, (re)make when missing."""
        if self.health is BackendHealth.GONE and self.rx is not None:
            self.rx_health = BackendHealth.GONE      # its interface's ingress went with it
            return
        if (self._rules is None or not self._rules.receives
                or self.health is not BackendHealth.OK):
            return
        rx = self.rx
        if rx is None:
            if self._sync_receive(self._rules):
                out.mark_all = True
                out.installed.extend(self.rx.installed().keys())
            return
        try:
            state = BackendHealth(rx.check())
        except (OSError, FlowpacerError) as e:
            log.warning("receive side check failed: %s", e)
            return
        prev, self.rx_health = self.rx_health, state
        if state is BackendHealth.OK:
            if out.audited:
                gone = list(rx.audit())
                if gone:
                    log.warning("%s: %d receive classes were removed by someone else; adding "
                                "them again", rx.interface, len(gone))
                    out.gone.extend(gone)
            return
        if state in (BackendHealth.GONE, BackendHealth.FOREIGN):
            if prev is not state:
                log.warning("%s: receive side %s; uploads are not shaped until it returns",
                            rx.interface, state.value)
                rx.forget()
            return
        try:
            rx.forget()
            rx.setup()
        except (OSError, FlowpacerError) as e:
            self._rx_failed(f"receive side lost, cannot rebuild: {e}")
            return
        self.rx_health = BackendHealth.OK
        self.rx_problem = ""
        log.warning("%s: receive side (%s) was lost: rebuilt, re-applying every flow",
                    self.parent_name(), rx.interface)
        out.mark_all = True
        out.installed.extend(rx.installed().keys())

    def parent_name(self) -> str:
        return self.backend.interface if self.backend is not None else "?"

    # -------------------------------------------------------------- health
    def check(self) -> Recheck:
        """Notice an interface that went away or came back, a root qdisc someone deleted or
        replaced, a changed link speed; rebuild where that is ours to do."""
        out = self._check_send()
        self._check_receive(out)
        return out

    def _check_send(self) -> "Recheck":
        out = Recheck()
        b = self.backend
        if b is None:
            return out
        try:
            state = BackendHealth(b.check())
        except (OSError, FlowpacerError) as e:
            log.warning("backend check failed: %s", e)
            return out
        prev, self.health = self.health, state
        if state is BackendHealth.OK:
            if prev is not BackendHealth.OK:
                # its bookkeeping was dropped when it went (or a rebuild failed half-way): a
                # flow left unshaped with nothing telling the reconciler is what this prevents
                self.health = BackendHealth.LOST          # until that works
                return self._set_up_again(b, f"in place again after being {prev.value}")
            now = self.clock()
            if now >= self._next_audit:
                self._next_audit = now + AUDIT_S
                out.audited = True
                out.gone = list(b.audit())
                if out.gone:
                    log.warning("%s: %d flow classes were removed by someone else; adding them "
                                "again", b.interface, len(out.gone))
            return out
        if state is BackendHealth.GONE:
            if prev is not BackendHealth.GONE:
                log.warning("%s: interface is gone; flows stay known and are shaped again when it "
                            "returns", b.interface)
                b.forget()
            return out
        if state is BackendHealth.FOREIGN:
            if prev is not BackendHealth.FOREIGN:
                log.error("%s: someone replaced flowpacer's root qdisc; not fighting it: flows are "
                          "not shaped until it is removed (or flowpacer restarts with --take-over)",
                          b.interface)
                b.forget()
            return out
        why = {BackendHealth.LOST: "root qdisc missing (interface re-created or qdisc deleted)",
               BackendHealth.SPEED: "link speed changed"}[state]
        return self._set_up_again(b, why)

    def _set_up_again(self, b, why: str) -> Recheck:
        """Drop the bookkeeping, set up again (our qdisc adopted with its classes if it is
        there, made if not) and re-apply every flow; a failure is counted and retried."""
        try:
            b.forget()
            b.setup()
        except (OSError, FlowpacerError) as e:
            return self._rebuild_failed(b, why, e)
        self.health = BackendHealth.OK
        if self.problem:
            log.warning("%s: rebuilt after %d failed attempts", b.interface,
                        self._episode_failures)
            self.problem = ""
        self._episode_failures = 0
        log.warning("%s: %s: rebuilt, re-applying every flow", b.interface, why)
        return Recheck(mark_all=True, installed=list(b.installed().keys()))

    def _rebuild_failed(self, b, why: str, err: Exception) -> Recheck:
        """The lost qdisc cannot be made again (e.g. the psp module was unloaded): counted,
        logged once per reason and then once every REBUILD_LOG_S, retried at every pass; flows
        stay known (and unshaped) until it works. With ``backend: auto`` a psp that is gone is
        replaced by htb instead."""
        self.rebuild_failures += 1
        self._episode_failures += 1
        reason = str(err)
        if self._fall_back(b, why, reason):
            return Recheck(mark_all=True)
        now = self.clock()
        if reason != self.problem:
            log.warning("%s: %s; cannot rebuild: %s; flows stay known and unshaped, retrying at "
                        "every pass", b.interface, why, reason)
            self._problem_logged_at = now
        elif now - self._problem_logged_at >= REBUILD_LOG_S:
            log.warning("%s: still cannot rebuild (%d attempts failed): %s", b.interface,
                        self._episode_failures, reason)
            self._problem_logged_at = now
        else:
            log.debug("%s: rebuild failed again: %s", b.interface, reason)
        self.problem = reason
        return Recheck()

    def _fall_back(self, b, why: str, reason: str) -> bool:
        rs = self._rules
        try:
            alt = self.factory.fallback(self.kind_of(rs), b.kind, b.interface,
                                        self.link_rate_of(rs))
        except (OSError, FlowpacerError) as e:
            if self.problem != reason:
                log.warning("%s: cannot fall back either: %s", b.interface, e)
            return False
        if alt is None:
            return False
        nb, alt_reason = alt
        b.close()
        self.backend = nb
        if self.rx is not None:        # the receive side follows the send side's kind
            self._drop_receive()
            self._sync_receive(rs)
        self.health = BackendHealth.OK
        self.problem = ""
        self._episode_failures = 0
        self.fell_back = True
        self.reason = f"{alt_reason}; {b.name}: {reason}"
        self._note_fallback(rs)
        log.warning("%s: %s and %s cannot be rebuilt (%s): %s; re-applying every flow",
                    nb.interface, why, b.name, reason, alt_reason)
        return True

    # -------------------------------------------------------------- reload
    def needs_switch(self, new: RuleSet) -> bool:
        old = self._rules
        return (self.interface_of(new) != self.backend.interface
                or self.kind_of(new) != self.kind_of(old)
                or self.link_rate_of(new) != self.link_rate_of(old)
                # auto fell back to htb after psp was lost: back to psp when it can be had
                or (self.fell_back and self.factory.preferred_available()))

    def switch(self, new: RuleSet) -> None:
        """Clean switch-over: the old backend's objects go, the new backend starts empty. On
        failure the old configuration is put back (and FlowpacerError raised): the caller
        re-applies every flow either way."""
        old_rules = self._rules
        old = self.backend
        if self.rx is not None:
            self._drop_receive()
        old.teardown()
        old.close()
        self.backend = None
        try:
            self.start(new)
        except FlowpacerError:
            self.start(old_rules)
            raise

    def adopt_rules(self, rs: RuleSet) -> None:
        """A reload that keeps the backend: the receive side comes or goes with the rules."""
        self._rules = rs
        self._sync_receive(rs)

    # ---------------------------------------------------------- statistics
    def open_stats_channel(self) -> "StatsChannels":
        """Channels for ``class_stats`` from the calling thread (status, metrics), closed by
        the caller."""
        return StatsChannels()

    def class_stats(self, channels: "StatsChannels",
                    retain: bool = True) -> Dict[StatsKey, ClassStats]:
        """The counters of every class of the backends in use, by (interface, side, what it
        shapes): the send side's and, on the same interface's key, the receive side's. Read
        without the reconciler's lock, each backend over the caller's own channel."""
        b = self.backend
        if b is None or not self.usable:
            return {}
        ifname = b.interface
        out: Dict[StatsKey, ClassStats] = {}
        for be, side in ((b, Side.SEND), (self.rx, Side.RECEIVE)):
            if be is None or (side is Side.RECEIVE and not self.rx_usable):
                continue
            try:
                got = be.class_stats(channels.get(be))
            except (OSError, FlowpacerError) as e:
                if side is Side.SEND:
                    raise
                log.debug("receive side class statistics: %s", e)
                continue
            out.update((StatsKey(ifname, side, k), st) for k, st in got.items())
        if retain:
            channels.retain(self.backends())
        return out

    def shutdown(self, keep: bool = False) -> None:
        """Remove everything the backends made, or with ``keep`` leave it in the kernel for the
        next process to adopt (a restart, issue 28): only the netlink sockets are closed."""
        if keep:
            for b in self.backends():
                b.close()
            self.rx = self.backend = None
            return
        if self.rx is not None:
            self._drop_receive()
        if self.backend is not None:
            self.backend.teardown()
            self.backend.close()
            self.backend = None


class StatsChannels:
    """One thread's channels to the backends' counters, one per backend, made on first use and
    kept while that backend is the one asked (a switched backend's channel is closed)."""

    def __init__(self):
        self._by_backend: Dict[int, tuple] = {}

    def get(self, backend: Backend) -> Optional[StatsChannel]:
        got = self._by_backend.get(id(backend))
        if got is not None and got[0] is backend:
            return got[1]
        if got is not None:
            got[1].close()
        ch = backend.open_stats_channel()
        self._by_backend[id(backend)] = (backend, ch)
        return ch

    def retain(self, backends) -> None:
        """Close the channels of backends no longer in use (a switch, a fall-back)."""
        keep = {id(b) for b in backends}
        for k in [k for k in self._by_backend if k not in keep]:
            self._by_backend.pop(k)[1].close()

    def close(self) -> None:
        for _b, ch in self._by_backend.values():
            ch.close()
        self._by_backend.clear()
