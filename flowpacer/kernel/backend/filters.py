"""Where each flow's u32 filter goes: two levels of 256-bucket hash tables per address family.

Per family one u32 instance (``prio`` 1 for IPv4, 2 for IPv6) under the root qdisc:

    root table (800:, the kernel's)     two link nodes: guard (TCP, resp. UDP; no IP options /
      |                                  ext headers), hash = low byte of the destination port
      v
    L1 table (256 buckets)              bucket b1 holds one link node once a flow needs it,
      |                                  hash = low byte of the source (local) port
      v
    L2 table of bucket b1 (256 buckets) bucket b2 holds the flows' exact 4-tuple leaves, each
                                         with the IP protocol (TCP and UDP flows of the same
                                         ports share buckets, never leaves; issue 17)

So a server's accepted flows (fixed local port, ephemeral remote ports) and a client's connected
flows (ephemeral local ports) both spread over 65 536 buckets, and a packet checks at most the
leaves whose ports share both low bytes with it: classification cost does not grow with the
number of flows. Node ids in a bucket are ours (1..4095), never the kernel's silent reuse.
All 514 tables exist from set-up on, so a flow is always exactly one class and one filter.

This module is pure bookkeeping; the backend turns its answers into netlink requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Set, Tuple

from flowpacer.model import FlowKey
from flowpacer.kernel.tc import u32

PRIO = {4: 1, 6: 2}
PROTO = {4: u32.ETH_P_IP, 6: u32.ETH_P_IPV6}
PORTS_OFF = {4: u32.V4_PORTS_OFF, 6: u32.V6_PORTS_OFF}
GUARD = {4: u32.v4_guard, 6: u32.v6_guard}
PROTOCOLS = (u32.IPPROTO_TCP, u32.IPPROTO_UDP)     # one root link node each, per family
# Fixed table ids, away from the ones the kernel hands out itself (1..0x7ff, 0x800):
L1_HTID = {4: 0xA00, 6: 0xA01}
L2_HTID_BASE = {4: 0xB00, 6: 0xC00}      # + low byte of the remote port
DIVISOR = 256
MAX_NODE = 0xFFF

HMASK_REMOTE_PORT = 0x000000FF  # low byte of the destination port of the ports word
HMASK_LOCAL_PORT = 0x00FF0000   # low byte of the source port


class LayoutFull(Exception):
    """No room for another filter in this bucket."""


def l2_htid(family: int, b1: int) -> int:
    return L2_HTID_BASE[family] + b1


def all_tables():
    """(family, htid, l1_bucket or None) of every table: the L1 tables, then the 512 L2 tables.

    All of them are made at set-up (about 1 MB of kernel memory), so adding a flow never has to
    create a table: a flow costs one class and one filter, always.
    """
    for fam in (4, 6):
        yield fam, L1_HTID[fam], None
    for fam in (4, 6):
        for b1 in range(DIVISOR):
            yield fam, l2_htid(fam, b1), b1


@dataclass
class Placement:
    family: int
    l2_htid: int
    bucket: int
    node: int

    @property
    def handle(self) -> int:
        return u32.htid_handle(self.l2_htid, self.bucket, self.node)

    @property
    def in_table(self) -> int:
        return u32.htid_handle(self.l2_htid, self.bucket)


@dataclass
class Layout:
    used_nodes: Dict[Tuple[int, int], Set[int]] = field(default_factory=dict)  # (htid, b2) -> ids

    def place(self, key: FlowKey) -> Placement:
        """Choose the handle for a new leaf (and reserve it)."""
        fam = key.family
        htid = l2_htid(fam, key.remote_port & 0xFF)
        b2 = key.local_port & 0xFF
        used = self.used_nodes.setdefault((htid, b2), set())
        if len(used) >= MAX_NODE:
            raise LayoutFull(f"u32 bucket {htid:x}:{b2:x} holds {MAX_NODE} filters already")
        node = 1
        while node in used:
            node += 1
        used.add(node)
        return Placement(fam, htid, b2, node)

    def release(self, handle: int) -> None:
        htid, b2, node = u32.split_handle(handle)
        used = self.used_nodes.get((htid, b2))
        if used is not None:
            used.discard(node)
            if not used:
                del self.used_nodes[(htid, b2)]

    def adopt_leaf(self, handle: int) -> None:
        htid, b2, node = u32.split_handle(handle)
        self.used_nodes.setdefault((htid, b2), set()).add(node)
