"""Pools of ready flow classes for first-byte shaping (issue 16): ``Pool``, the state
``TcBackend`` (and ``harness.fakes.FakeBackend``) hold as ``backend.pool``, and
``queue_pool_op``, the netlink side of the ``PoolOp``s a plan carries.

A pool class is an ordinary flow class (same parent, same options as a flow of its rule would
get) that has no filter yet. ``flowpacer/sources/firstbyte.py`` hands their ids to its sock_ops program;
when a socket of a matching flow finishes its handshake, the program sets the socket's
``SO_PRIORITY`` to one of them (htb and psp classify by ``skb->priority`` before any filter)
and reports the claim. The claim is recorded here and the flow's ADD then takes that class
instead of making one: the class's rates are set to the flow's shape and the flow's own u32
filter is added as usual, so the flows' book (tcflows.py) and the filters stay the source of
truth.

Class ids are never handed out twice while a socket may still point at them: the id of a
claimed class is free again only when its class is gone *and* no socket carries it as its
priority any more -- the program reports a claiming socket's close, and ``firstbyte`` sweeps
the namespace's sockets' priorities with sock_diag (``pool_sockets_hold``): after a full qdisc
rebuild, a fall-back or a restart the bookkeeping starts afresh, and the ids still-open sockets
carry are skipped until those sockets are gone (else a stale priority would land in a reused
class). Pool classes left by a daemon that died are orphans (classes without a filter) and go
at the next start's adoption.

The engine plans the pool ops (``engine.plan_pools``) and the backend applies them in the same
batch as the flows' ops; nothing here is called from outside a plan except the read-only
``holding()`` and counts. ``Pool`` is pure bookkeeping (no netlink): its class ids, claims and
the ids waiting for their sockets; ``queue_pool_op`` sends through the backend's ``Channel``
(tcchannel.py).
"""
from __future__ import annotations

import errno
import itertools
import logging
import time
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Set, Tuple

from flowpacer.model import ApplyResult, FlowKey, OpKind, PoolHolding, PoolOp
from flowpacer.kernel.tc import nl
from flowpacer.kernel.tc.nl import tc_handle
from flowpacer.kernel.backend.filters import LayoutFull

if TYPE_CHECKING:
    from flowpacer.kernel.backend.tcchannel import Channel

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


# every bookkeeping of every backend gets its own epoch: a first-byte source that saw another
# epoch knows that its pool ids are void (a rebuild, a fall-back, a new backend)
_EPOCHS = itertools.count(1)


class Pool:
    """The first-byte pool state of one backend: the ready classes (made, not claimed, by
    rule), the claims whose flow has no class yet, and the allocation of pool-range ids."""

    def __init__(self, major: int):
        self.major = major
        self.epoch = next(_EPOCHS)
        self.classes: Dict[int, str] = {}                      # ready class id -> rule name
        self.claims: Dict[FlowKey, Tuple[int, int]] = {}       # key -> (class id, bound at ns)
        self._reset_ids(POOL_FIRST_MINOR, [])

    def _reset_ids(self, nxt: int, free: List[int]) -> None:
        self.next_minor = nxt
        self.free: List[int] = free
        self.awaiting: Dict[int, float] = {}     # claimed ids whose class went: since (monotonic)
        self.closed: Set[int] = set()            # ids whose socket closed while their class lives
        # held: ids an open socket carried at the last sweep (never handed out); swept: a sweep
        # ran since this state began (then awaiting ids wait for a sweep, not for a timeout)
        self.held: Set[int] = set()
        self.swept = False
        self.skipped = 0

    # ---------------------------------------------------------- bookkeeping
    def forget(self) -> None:
        """The backend dropped its bookkeeping (forget/resync/rebuild): every pool class and
        claim is void; a new epoch."""
        self.epoch = next(_EPOCHS)
        self.classes = {}
        self.claims = {}
        self._reset_ids(POOL_FIRST_MINOR, [])

    def adopted(self, used) -> None:
        """After adoption: the pool-range ids that adopted flows hold stay taken."""
        taken = {m for m in used if m >= POOL_FIRST_MINOR}
        nxt = max([POOL_FIRST_MINOR - 1] + list(taken)) + 1
        self._reset_ids(nxt, [m for m in range(nxt - 1, POOL_FIRST_MINOR - 1, -1)
                              if m not in taken])

    def holding(self) -> PoolHolding:
        return PoolHolding(self.epoch, frozenset(self.classes), dict(self.claims))

    def alloc_minor(self) -> int:
        if not self.free and self.awaiting and not self.swept:
            now = time.monotonic()
            for m in [m for m, t in self.awaiting.items() if now - t >= AWAIT_CLOSE_S]:
                del self.awaiting[m]
                self.free.append(m)
        while True:
            if self.free:
                m = self.free.pop()
            elif self.next_minor > POOL_LAST_MINOR:
                raise LayoutFull("no free pool class id")
            else:
                m = self.next_minor
                self.next_minor += 1
            if m not in self.held:
                return m
            # a still-open socket carries it (from before a rebuild or a restart): it waits
            self.awaiting[m] = time.monotonic()
            self.skipped += 1

    def free_minor(self, minor: int, claimed: bool = True) -> None:
        """The class of id ``minor`` is gone. A claimed id waits for its socket's close."""
        if not claimed or minor in self.closed:
            self.closed.discard(minor)
            self.free.append(minor)
        else:
            self.awaiting[minor] = time.monotonic()

    def socket_closed(self, classid: int) -> None:
        """The socket that claimed ``classid`` is closed: no packet carries it any more."""
        m = classid & 0xFFFF
        if m < POOL_FIRST_MINOR:
            return
        if self.awaiting.pop(m, None) is not None:
            self.held.discard(m)
            self.free.append(m)
        elif m in self.held:
            self.held.discard(m)        # a socket from before the rebuild: nothing of ours uses m
        else:
            self.closed.add(m)          # its class is still there (the flow's): freed with it

    def sockets_hold(self, priorities: Iterable[int]) -> int:
        """A sweep of the namespace's sockets (sock_diag) found these priorities: the pool ids
        among them are not handed out while that lasts, and the awaited ids no socket carries
        any more are free again. How many awaited ids were freed."""
        self.held = {p & 0xFFFF for p in priorities
                     if p >> 16 == self.major and POOL_FIRST_MINOR <= p & 0xFFFF <= POOL_LAST_MINOR}
        self.swept = True
        freed = [m for m in self.awaiting if m not in self.held]
        for m in freed:
            del self.awaiting[m]
            self.free.append(m)
        return len(freed)

    def ids_held(self) -> int:
        """Pool-range ids open sockets carried at the last sweep."""
        return len(self.held)

    def ids_waiting(self, older_than_s: float = 0.0) -> int:
        """Claimed ids waiting for their socket (those waiting longer than ``older_than_s``)."""
        if not older_than_s:
            return len(self.awaiting)
        cut = time.monotonic() - older_than_s
        return sum(1 for t in self.awaiting.values() if t <= cut)

    def oldest_wait_s(self) -> float:
        if not self.awaiting:
            return 0.0
        return max(0.0, time.monotonic() - min(self.awaiting.values()))

    def claim(self, key: FlowKey, classid: int, at_ns: int) -> Tuple[bool, Optional[int]]:
        """A socket of flow ``key`` uses ready class ``classid`` from now on: its ADD takes that
        class. (False, None) if the class is not a ready one (the pool was remade); else
        (True, the class id of an earlier claim of ``key`` that is replaced, or None)."""
        if classid not in self.classes:
            return False, None
        del self.classes[classid]
        old = self.claims.get(key)
        self.claims[key] = (classid, at_ns)
        return True, old[0] if old is not None and old[0] != classid else None

    def take_claim(self, key: FlowKey) -> Optional[int]:
        """The minor of the class flow ``key`` claimed, for its ADD (then it is the flow's)."""
        c = self.claims.pop(key, None)
        return c[0] & 0xFFFF if c is not None else None

    def drop_claim(self, key: FlowKey) -> Optional[int]:
        """Forget the claim of ``key``; its class id (the caller deletes the class)."""
        c = self.claims.pop(key, None)
        return c[0] if c is not None else None


# ------------------------------------------------------------- the kernel side

def book(pool: "Pool", op: PoolOp, res: ApplyResult) -> List[Tuple[int, bool, str]]:
    """The bookkeeping of a pool op that makes no class (sweep, closed, claim, release, delete),
    done at once; the classes it leaves to delete, as (class id, claimed, why). Shared by
    ``queue_pool_op`` (netlink) and the in-memory FakeBackend, so both keep the same books."""
    k = op.kind
    if k is OpKind.POOL_SWEEP:
        res.pool_freed_by_sweep += pool.sockets_hold(op.priorities)
    elif k is OpKind.POOL_CLOSED:
        for cid in op.classids:
            pool.socket_closed(cid)
    elif k is OpKind.POOL_CLAIM:
        ok, old = pool.claim(op.key, op.classids[0], op.at_ns)
        if ok and old is not None:
            return [(old, True, "delete replaced claimed class")]
    elif k is OpKind.POOL_RELEASE:
        cid = pool.drop_claim(op.key)
        if cid is not None:
            return [(cid, True, "delete unused claimed class")]
    elif k is OpKind.POOL_DELETE:
        return [(cid, False, "delete pool class") for cid in op.classids
                if pool.classes.pop(cid, None) is not None]
    return []


def queue_pool_op(chan: "Channel", pool: Pool, op: PoolOp, add, res: ApplyResult) -> None:
    """Queue the netlink requests of one pool op of a plan on a tc backend's ``chan`` for its
    ``pool`` (``add(req, callback)`` as in ``FlowClasses.apply``, tcflows.py); bookkeeping-only
    ops take effect at once. A refused request is logged (the engine plans the pool again at
    the next round), never an OpError."""
    if op.kind is OpKind.POOL_CHANGE:
        _queue_change(chan, pool, op, add, res)
    elif op.kind is OpKind.POOL_FILL:
        _queue_fill(chan, pool, op, add, res)
    else:
        for cid, claimed, what in book(pool, op, res):
            _queue_delete(chan, pool, cid, add, claimed=claimed, what=what)


def _queue_delete(chan: "Channel", pool: Pool, cid: int, add, claimed: bool, what: str) -> None:
    def done(err):
        if err is not None and err.errno != errno.ENOENT:
            log.warning("%s: %s", chan.interface, err)
            if not claimed:
                return          # still there: its id stays taken (adoption removes it later)
        # a claimed id: the socket may still carry it as its priority, reused after its close
        pool.free_minor(cid & 0xFFFF, claimed=claimed)
    add(chan.class_del(cid, f"{what} {nl.fmt_handle(cid)}"), done)


def _queue_change(chan: "Channel", pool: Pool, op: PoolOp, add, res: ApplyResult) -> None:
    """Give unclaimed pool classes another shape (a reload reuses them for ``op.rule``)."""
    options = chan.codec.flow_class_options(op.shape, chan.link_rate_bps)
    made = res.pool_made.setdefault(op.rule, [])
    for cid in op.classids:
        if cid not in pool.classes:
            continue

        def done(err, cid=cid):
            if err is None:
                pool.classes[cid] = op.rule
                made.append(cid)
                return
            log.warning("%s: %s", chan.interface, err)
            pool.classes.pop(cid, None)
            e2 = chan.transact([chan.class_del(cid, f"delete pool class {nl.fmt_handle(cid)}")])[0]
            if e2 is None or e2.errno == errno.ENOENT:
                pool.free_minor(cid & 0xFFFF, claimed=False)
        add(chan.class_msg(cid & 0xFFFF, chan.flow_parent, options, False,
                           f"change pool class {nl.fmt_handle(cid)}"), done)


def _queue_fill(chan: "Channel", pool: Pool, op: PoolOp, add, res: ApplyResult) -> None:
    """Make up to ``op.count`` ready classes of ``op.shape`` (fewer when the kernel refused
    some or ids ran out)."""
    options = chan.codec.flow_class_options(op.shape, chan.link_rate_bps)
    made = res.pool_made.setdefault(op.rule, [])
    for _ in range(op.count):
        try:
            m = pool.alloc_minor()
        except LayoutFull:
            break
        cid = tc_handle(pool.major, m)

        def done(err, m=m, cid=cid):
            if err is None:
                pool.classes[cid] = op.rule
                made.append(cid)
                return
            log.warning("%s: %s", chan.interface, err)
            if err.errno != errno.EEXIST:      # never an id someone else holds
                pool.free_minor(m, claimed=False)
        add(chan.class_msg(m, chan.flow_parent, options, True,
                           f"add pool class {nl.fmt_handle(cid)}"), done)
