"""Class ids of ``TcBackend``'s flow and group classes: ``ClassIds``, the flow-range minors
(handles.py: ``FIRST_FLOW_MINOR``..``LAST_FLOW_MINOR``) that are free, the next never used, and
the spares.

Spares (issue 26): making or deleting a class makes the kernel walk every class of the qdisc
(``tc_bind_tclass``: 50 us per class made at 1 000 classes, 0.7 ms at 5 000, 5 ms at 10 000 on
6.18), changing one does not (2 us). So with ``spare_max`` set, a closed flow's filter goes but
its class stays, a spare, and the next new flow's class is a spare changed to its rates (one
change and one filter, no class made: tcflows.py). Kept once flows and spares number
``spare_from``, at most ``spare_max`` of them. Spares go with the root qdisc at teardown; a
restart adopts them (``adopted``).

Pool-range ids (above ``LAST_FLOW_MINOR``) are the pool's (pool.py): one freed here goes back
to it.
"""
from __future__ import annotations

from typing import Callable, Collection, Iterable, List, Set

from flowpacer.kernel.tc.nl import tc_handle
from flowpacer.kernel.backend.filters import LayoutFull
from flowpacer.kernel.backend.handles import FIRST_FLOW_MINOR, LAST_FLOW_MINOR, MAJOR, SPARE_FROM
from flowpacer.kernel.backend.pool import Pool


class ClassIds:
    """Which flow-range class ids are free, and which classes are spares."""

    def __init__(self, pool: Pool, spare_max: int = 0, spare_from: int = SPARE_FROM):
        self._pool = pool
        self.spare_max = spare_max       # configuration (read-only)
        self.spare_from = spare_from
        self._free: List[int] = []       # ids given back, popped last first
        self._next = FIRST_FLOW_MINOR    # ids from here on were never handed out
        self._spares: List[int] = []     # minors of spare classes
        self._queued = 0                 # removes of this apply that keep their class
        self.ready = 0                   # the ready spares the rules want (the last SpareOp's)
        self.making = 0                  # ready spares asked of the kernel, not answered yet

    # ----------------------------------------------------------------- ids
    def alloc(self) -> int:
        """A free flow-range minor; raises ``LayoutFull`` when none is left."""
        if self._free:
            return self._free.pop()
        m = self._next
        if m > LAST_FLOW_MINOR:
            raise LayoutFull("no free class id (49 136 flows shaped)")
        self._next = m + 1
        return m

    def free(self, minor: int) -> None:
        """Class ``minor`` is gone: its id can be handed out again (a pool-range id: by the
        pool, once its socket is gone)."""
        if minor > LAST_FLOW_MINOR:
            self._pool.free_minor(minor)
            return
        self._free.append(minor)

    def peek(self) -> int:
        """The id ``alloc`` would hand out next (a test's foreign class takes it)."""
        return self._free[-1] if self._free else self._next

    # -------------------------------------------------------------- spares
    def new_apply(self) -> None:
        """A plan's batch begins: no remove of it has kept its class yet, no ready spare of it
        is on its way (a batch whose transport failed answered none)."""
        self._queued = 0
        self.making = 0

    def keep_spare(self, minor: int, flows: int) -> bool:
        """Whether the class of a flow being removed (a flow-range class under the link, one of
        ``flows`` flows) stays as a spare; if so, it is counted against ``spare_max`` from now
        on, and joins the spares with ``add_spare`` once the kernel answered (a batch of closes
        stops at ``spare_max`` too). Below ``spare_from`` one is kept too while the spares are
        fewer than ``ready`` (the rules' ``ready_classes``: else the next fill makes it again)."""
        spares = len(self._spares)
        if (minor <= LAST_FLOW_MINOR and spares + self._queued < self.spare_max
                and (flows + spares >= self.spare_from or spares + self._queued < self.ready)):
            self._queued += 1
            return True
        return False

    def add_spare(self, minor: int) -> None:
        self._spares.append(minor)

    def take_spare(self) -> int:
        """A spare's minor for a new flow (no longer a spare), or 0 when there is none."""
        return self._spares.pop() if self._spares else 0

    def spare_count(self) -> int:
        return len(self._spares)

    def spare_minors(self) -> List[int]:
        return sorted(self._spares)

    def drop_spares(self) -> None:
        """The spares went with the root qdisc (teardown)."""
        self._spares.clear()

    def audit_spares(self, present: Collection[int]) -> None:
        """Spares whose class someone removed (not among ``present`` class ids) are forgotten
        and their ids free."""
        gone = [m for m in self._spares if tc_handle(MAJOR, m) not in present]
        if gone:
            self._spares = [m for m in self._spares if tc_handle(MAJOR, m) in present]
            for m in gone:
                self.free(m)

    # ------------------------------------------------------------ life cycle
    def forget(self) -> None:
        """Nothing of ours is in the kernel any more: every id is free, no spare."""
        self._free.clear()
        self._spares.clear()
        self._next = FIRST_FLOW_MINOR

    def adopted(self, minors: Iterable[int], used: Set[int],
                idle_leaf: Callable[[int], bool]) -> Set[int]:
        """After a restart: ``minors`` are our classes in the kernel, ``used`` those that flows
        and groups hold. The flow-range ones that are not used and for which ``idle_leaf`` holds
        (a leaf under the link: a spare, or a flow closed while no daemon ran) are kept as spares
        (at most ``spare_max``): keeping one is cheaper than deleting it (both cost a walk of
        every class). Ids are handed out above the highest flow-range class; those below it
        neither used nor spare are free (the caller deletes their classes). Returns ``used`` and
        the spares."""
        ms = sorted(minors)
        spares: List[int] = []
        for m in ms:
            if len(spares) >= self.spare_max:
                break
            if FIRST_FLOW_MINOR <= m <= LAST_FLOW_MINOR and m not in used and idle_leaf(m):
                spares.append(m)
        self._spares = spares
        taken = set(used) | set(spares)
        self._next = max([FIRST_FLOW_MINOR - 1] + [m for m in ms if m <= LAST_FLOW_MINOR]) + 1
        self._free = [m for m in range(self._next - 1, FIRST_FLOW_MINOR - 1, -1)
                      if m not in taken]
        return taken
