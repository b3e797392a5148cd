"""Pools of ready flow classes for first-byte shaping (issue 16), a part of ``TcBackend``.

A pool class is an ordinary flow class (same parent, same options as a flow of its rule would
get) that has no filter yet. ``flowpacer/firstbyte.py`` hands their ids to its sock_ops program;
when a socket of a matching flow finishes its handshake, the program sets the socket's
``SO_PRIORITY`` to one of them (htb and psp classify by ``skb->priority`` before any filter)
and reports the claim. The claim is recorded here and the flow's ADD then takes that class
instead of making one: the class's rates are set to the flow's shape and the flow's own u32
filter is added as usual, so ``_flows`` and the filters stay the source of truth.

Class ids are never handed out twice while a socket may still point at them: the id of a
claimed class is free again only when its class is gone *and* no socket carries it as its
priority any more -- the program reports a claiming socket's close, and ``firstbyte`` sweeps
the namespace's sockets' priorities with sock_diag (``pool_sockets_hold``): after a full qdisc
rebuild, a fall-back or a restart the bookkeeping starts afresh, and the ids still-open sockets
carry are skipped until those sockets are gone (else a stale priority would land in a reused
class). Pool classes left by a daemon that died are orphans (classes without a filter) and go
at the next start's adoption.
"""
from __future__ import annotations

import errno
import logging
import time
from typing import Dict, Iterable, List, Optional

from ..model import FlowKey, Shape
from ..tc import nl
from ..tc.nl import RTM_DELTCLASS, tc_handle
from .filters import LayoutFull

log = logging.getLogger(__name__)

# Pool classes have ids of their own range, above the flow allocator's (tc.LAST_FLOW_MINOR), so
# that an unclaimed pool class is told from a leaked flow class by its id alone: a class of this
# range is a flow's once a filter points at it.
POOL_FIRST_MINOR = 0xC000
POOL_LAST_MINOR = 0xFFFF
# A claimed id is its socket's priority until the socket closes: after its class was deleted it
# is handed out again only once the program reported that close (FB_F_CLOSED) or a sweep found
# no socket carrying it; without any sweep (no first-byte stage), after AWAIT_CLOSE_S.
AWAIT_CLOSE_S = 60.0


class PoolMixin:
    """Methods of ``TcBackend`` for first-byte pools (state made on first use)."""

    # state: created lazily so that TcBackend.__init__ needs no change
    def _pool_state(self):
        st = self.__dict__.get("_pool")
        if st is None:
            st = self.__dict__["_pool"] = {"claims": {}, "classes": set()}
        return st

    @property
    def pool_epoch(self) -> int:
        """Changes whenever the backend's bookkeeping was dropped (forget/resync/rebuild): the
        pool classes made before are gone or orphans then, and the pools must be made again."""
        return self.__dict__.get("_pool_epoch", 0)

    def _pool_forget(self) -> None:
        """Called by forget(): every pool class and claim is void."""
        self.__dict__["_pool_epoch"] = self.pool_epoch + 1
        self.__dict__.pop("_pool", None)
        self.__dict__.pop("_pool_id_state", None)

    def _pool_ids(self):
        ids = self.__dict__.get("_pool_id_state")
        if ids is None:
            ids = self.__dict__["_pool_id_state"] = self._pool_new_ids(POOL_FIRST_MINOR, [])
        return ids

    @staticmethod
    def _pool_new_ids(nxt: int, free: List[int]) -> dict:
        # held: ids an open socket carried at the last sweep (never handed out); swept: a sweep
        # ran since this state began (then awaiting ids wait for a sweep, not for a timeout)
        return {"next": nxt, "free": free, "awaiting": {}, "closed": set(), "held": set(),
                "swept": False}

    def _pool_alloc_minor(self) -> int:
        ids = self._pool_ids()
        if not ids["free"] and ids["awaiting"] and not ids["swept"]:
            now = time.monotonic()
            for m in [m for m, t in ids["awaiting"].items() if now - t >= AWAIT_CLOSE_S]:
                del ids["awaiting"][m]
                ids["free"].append(m)
        while True:
            if ids["free"]:
                m = ids["free"].pop()
            elif ids["next"] > POOL_LAST_MINOR:
                raise LayoutFull("no free pool class id")
            else:
                m = ids["next"]
                ids["next"] += 1
            if m not in ids["held"]:
                return m
            # a still-open socket carries it (from before a rebuild or a restart): it waits
            ids["awaiting"][m] = time.monotonic()
            self.__dict__["_pool_skipped"] = self.__dict__.get("_pool_skipped", 0) + 1

    def _pool_free_minor(self, minor: int, claimed: bool = True) -> None:
        """The class of id ``minor`` is gone. A claimed id waits for its socket's close."""
        ids = self._pool_ids()
        if not claimed or minor in ids["closed"]:
            ids["closed"].discard(minor)
            ids["free"].append(minor)
        else:
            ids["awaiting"][minor] = time.monotonic()

    def pool_socket_closed(self, classid: int) -> None:
        """The socket that claimed ``classid`` is closed: no packet carries it any more."""
        ids = self._pool_ids()
        m = classid & 0xFFFF
        if m < POOL_FIRST_MINOR:
            return
        if ids["awaiting"].pop(m, None) is not None:
            ids["held"].discard(m)
            ids["free"].append(m)
        elif m in ids["held"]:
            ids["held"].discard(m)      # a socket from before the rebuild: nothing of ours uses m
        else:
            ids["closed"].add(m)        # its class is still there (the flow's): freed with it

    def pool_sockets_hold(self, priorities: Iterable[int]) -> int:
        """A sweep of the namespace's sockets (sock_diag) found these priorities: the pool ids
        among them are not handed out while that lasts, and the awaited ids no socket carries
        any more are free again. How many awaited ids were freed."""
        ids = self._pool_ids()
        major = self._parent_handle() >> 16
        held = {p & 0xFFFF for p in priorities
                if p >> 16 == major and POOL_FIRST_MINOR <= p & 0xFFFF <= POOL_LAST_MINOR}
        ids["held"] = held
        ids["swept"] = True
        freed = [m for m in ids["awaiting"] if m not in held]
        for m in freed:
            del ids["awaiting"][m]
            ids["free"].append(m)
        return len(freed)

    def pool_ids_held(self) -> int:
        """Pool-range ids open sockets carried at the last sweep."""
        return len(self._pool_ids()["held"])

    def pool_ids_waiting(self, older_than_s: float = 0.0) -> int:
        """Claimed ids waiting for their socket (those waiting longer than ``older_than_s``)."""
        aw = self._pool_ids()["awaiting"]
        if not older_than_s:
            return len(aw)
        cut = time.monotonic() - older_than_s
        return sum(1 for t in aw.values() if t <= cut)

    def _pool_adopted(self, used) -> None:
        """After adoption: the pool-range ids that adopted flows hold stay taken."""
        taken = [m for m in used if m >= POOL_FIRST_MINOR]
        nxt = max([POOL_FIRST_MINOR - 1] + taken) + 1
        self.__dict__["_pool_id_state"] = self._pool_new_ids(
            nxt, [m for m in range(nxt - 1, POOL_FIRST_MINOR - 1, -1) if m not in set(taken)])

    def pool_create(self, shape: Shape, n: int) -> List[int]:
        """Make up to ``n`` ready classes with ``shape``; their class ids (fewer when the kernel
        refused some or ids ran out)."""
        if n <= 0:
            return []
        st = self._pool_state()
        options = self.codec.flow_class_options(shape, self.link_rate_bps)
        minors: List[int] = []
        for _ in range(n):
            try:
                minors.append(self._pool_alloc_minor())
            except LayoutFull:
                break
        major = self._parent_handle() >> 16
        reqs = [self._class_msg(m, self._flow_parent, options, True,
                                f"add pool class {nl.fmt_handle(tc_handle(major, m))}")
                for m in minors]
        out = []
        for m, err in zip(minors, self._rtnl.transact(reqs)):
            if err is None:
                cid = tc_handle(major, m)
                st["classes"].add(cid)
                out.append(cid)
            else:
                log.warning("%s: %s", self.interface, err)
                if err.errno != errno.EEXIST:      # never an id someone else holds
                    self._pool_free_minor(m, claimed=False)
        return out

    def pool_change(self, classids: Iterable[int], shape: Shape) -> List[int]:
        """Give unclaimed pool classes another shape (a reload reuses them); the ids changed."""
        classids = [c for c in classids if c in self._pool_state()["classes"]]
        options = self.codec.flow_class_options(shape, self.link_rate_bps)
        reqs = [self._class_msg(c & 0xFFFF, self._flow_parent, options, False,
                                f"change pool class {nl.fmt_handle(c)}") for c in classids]
        out = []
        for c, err in zip(classids, self._rtnl.transact(reqs)):
            if err is None:
                out.append(c)
            else:
                log.warning("%s: %s", self.interface, err)
                self.pool_delete([c])
        return out

    def pool_delete(self, classids: Iterable[int]) -> None:
        """Delete unclaimed pool classes (no socket points at them) and free their ids."""
        st = self._pool_state()
        classids = [c for c in classids if c in st["classes"]]
        if not classids:
            return
        reqs = [self._req(RTM_DELTCLASS, 0, nl.tcmsg(self.ifindex, c, self._parent_handle()),
                          f"delete pool class {nl.fmt_handle(c)}") for c in classids]
        for c, err in zip(classids, self._rtnl.transact(reqs)):
            st["classes"].discard(c)
            if err is None or err.errno == errno.ENOENT:
                self._pool_free_minor(c & 0xFFFF, claimed=False)
            else:
                log.warning("%s: %s", self.interface, err)

    def pool_claimed(self, key: FlowKey, classid: int) -> bool:
        """A socket of flow ``key`` uses pool class ``classid`` from now on: its ADD takes that
        class. False if the class is not one of ours any more (the pool was remade)."""
        st = self._pool_state()
        if classid not in st["classes"]:
            return False
        st["classes"].discard(classid)
        old = st["claims"].get(key)
        if old is not None and old != classid:
            self._pool_drop_claim(key)
        st["claims"][key] = classid
        return True

    def _pool_take_claim(self, key: FlowKey) -> Optional[int]:
        """The minor of the class flow ``key`` claimed, for its ADD (then it is the flow's)."""
        st = self.__dict__.get("_pool")
        if not st:
            return None
        cid = st["claims"].pop(key, None)
        return cid & 0xFFFF if cid is not None else None

    def pool_pending(self) -> Dict[FlowKey, int]:
        """Claims whose flow has no class of its own yet."""
        st = self.__dict__.get("_pool")
        return dict(st["claims"]) if st else {}

    def _pool_drop_claim(self, key: FlowKey) -> None:
        st = self._pool_state()
        cid = st["claims"].pop(key, None)
        if cid is None:
            return
        err = self._rtnl.transact([self._req(
            RTM_DELTCLASS, 0, nl.tcmsg(self.ifindex, cid, self._parent_handle()),
            f"delete unused claimed class {nl.fmt_handle(cid)}")])[0]
        if err is not None and err.errno != errno.ENOENT:
            log.warning("%s: %s", self.interface, err)
        # the socket may still carry the id as its priority: reused after its close
        self._pool_free_minor(cid & 0xFFFF)

    def pool_release(self, key: FlowKey) -> None:
        """Flow ``key`` claimed a class but will not be shaped by it (no rule wants it, its flow
        is over, or it already has a class of its own): the class goes, its id waits for the
        socket's close."""
        self._pool_drop_claim(key)

    def pool_classes(self) -> int:
        st = self.__dict__.get("_pool")
        return len(st["classes"]) if st else 0
