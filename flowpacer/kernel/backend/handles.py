"""The tc backends' handles and per-flow record, shared by the components of ``TcBackend``.

Kernel objects (all under handle major ``MAJOR``):
  root qdisc ``f1f0:``      htb or psp (the codec decides)
  class ``f1f0:1``           the link (htb only), rate = link rate
  class ``f1f0:2``           default class: unmatched traffic, unshaped up to the link rate
  class ``f1f0:10``..        one per shaped flow, or a group class (issue 15), or a spare: the
                             class of a closed flow, kept (no filter points at it) for the next
                             new flow (tcids.py, tcflows.py)
  class ``f1f0:c000``..      first-byte pool classes (pool.py)
Class ids never leave the tc backends: the daemon sees flows by ``FlowKey`` and groups by
``GroupKey`` (contract.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from flowpacer.model import ClassStats, FlowKey, Shape, Side
from flowpacer.kernel.tc.nl import parse_stats2, parse_tcmsg, tc_handle

MAJOR = 0xF1F0
QDISC_HANDLE = tc_handle(MAJOR, 0)
LINK_MINOR = 1
DEFAULT_MINOR = 2
FIRST_FLOW_MINOR = 0x10
LAST_FLOW_MINOR = 0xBFFF         # 0xC000..0xFFFF: first-byte pool classes (pool.py)
FLOW_CLASS_IDS = LAST_FLOW_MINOR - FIRST_FLOW_MINOR + 1   # Capabilities.class_ids (49 136)
# Spare classes (tcids.py): the kernel walks every class of the qdisc for each class it makes
# or deletes (tc_bind_tclass), and not for a change, so a closed flow's class is kept and changed
# for the next flow instead. Kept once the flow and spare classes number SPARE_FROM (below that
# making and deleting is cheap, and a small setup keeps exactly one class per flow), at most
# SPARE_MAX of them.
SPARE_FROM = 256
SPARE_MAX = 16384


@dataclass
class Installed:
    classid: int
    filter_handle: int
    shape: Shape
    parent: Optional[int] = None     # the minor of its group class (issue 15); None: the link
    kernel: Optional[tuple] = None   # (rate, ceil) in the kernel when it differs from the shape's
    base: Optional["EchoedStats"] = None   # a reused spare's counters when the flow got it


class EchoedStats:
    """A reused spare's counters as the kernel echoed the change that gave it to a new flow,
    kept as the echoed message and parsed the first time the flow's statistics are read: most
    flows end before anyone reads them, and parsing every echo cost ~49 us of the ~210 us a new
    flow takes (issue 26's profile)."""

    __slots__ = ("_msg", "_stats")

    def __init__(self, mtype: int, body: bytes):
        self._msg: Optional[Tuple[int, bytes]] = (mtype, body)
        self._stats: Optional[ClassStats] = None

    def get(self) -> ClassStats:
        if self._stats is None:
            assert self._msg is not None
            mtype, body = self._msg
            self._stats = ClassStats(**parse_stats2(parse_tcmsg(mtype, body)))
            self._msg = None
        return self._stats



def less(st: ClassStats, echoed: Optional[EchoedStats]) -> ClassStats:
    """A reused class' counters counted from ``echoed`` (the previous flows' share taken out)."""
    if echoed is None:
        return st
    base = echoed.get()
    return ClassStats(max(0, st.bytes - base.bytes), max(0, st.packets - base.packets),
                      max(0, st.drops - base.drops), max(0, st.overlimits - base.overlimits),
                      st.backlog_bytes, st.qlen, st.rate_est_bps)



def wire_key(key: FlowKey, side: Side) -> FlowKey:
    """The tuple a flow's packets carry on ``side``: the key itself when sending (source =
    local), reversed when receiving (source = remote). Its own inverse, so adoption maps a
    filter's tuple back with it."""
    if side is Side.SEND:
        return key
    return FlowKey(key.remote_addr, key.remote_port, key.local_addr, key.local_port,
                   key.protocol)



def handle_text(classid: int) -> str:
    """A class id as tc prints it (``f1f0:1a``): the display string status shows."""
    return f"{classid >> 16:x}:{classid & 0xFFFF:x}"
