"""Where each flow's u32 filter goes: two levels of 256-bucket hash tables per address family.

Per family one u32 instance (``prio`` 1 for IPv4, 2 for IPv6) under the root qdisc:

    root table (800:, the kernel's)     one link node: guard (TCP, no IP options / ext headers),
      |                                  hash = low byte of the destination (remote) port
      v
    L1 table (256 buckets)              bucket b1 holds one link node once a flow needs it,
      |                                  hash = low byte of the source (local) port
      v
    L2 table of bucket b1 (256 buckets) bucket b2 holds the flows' exact 4-tuple leaves

So a server's accepted flows (fixed local port, ephemeral remote ports) and a client's connected
flows (ephemeral local ports) both spread over 65 536 buckets, and a packet checks at most the
leaves whose ports share both low bytes with it: classification cost does not grow with the
number of flows. Node ids in a bucket are ours (1..4095), never the kernel's silent reuse.

This module is pure bookkeeping; the backend turns its answers into netlink requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from ..model import FlowKey
from ..tc import u32

PRIO = {4: 1, 6: 2}
PROTO = {4: u32.ETH_P_IP, 6: u32.ETH_P_IPV6}
PORTS_OFF = {4: u32.V4_PORTS_OFF, 6: u32.V6_PORTS_OFF}
GUARD = {4: u32.v4_tcp_guard, 6: u32.v6_tcp_guard}
L1_HTID = {4: 0xA00, 6: 0xA01}
L2_HTID_FIRST = 0xA02          # the kernel hands out 1..0x7ff and 0x800 itself
L2_HTID_LAST = 0xFFF
DIVISOR = 256
MAX_NODE = 0xFFF

HMASK_REMOTE_PORT = 0x000000FF  # low byte of the destination port of the ports word
HMASK_LOCAL_PORT = 0x00FF0000   # low byte of the source port


class LayoutFull(Exception):
    """No room for another filter in this bucket or no free hash table id."""


@dataclass
class Placement:
    family: int
    l2_htid: int
    bucket: int
    node: int
    new_l2: bool                # the L2 table and its L1 link must be created first
    l1_bucket: int

    @property
    def handle(self) -> int:
        return u32.htid_handle(self.l2_htid, self.bucket, self.node)

    @property
    def in_table(self) -> int:
        return u32.htid_handle(self.l2_htid, self.bucket)


@dataclass
class Layout:
    l2: Dict[Tuple[int, int], int] = field(default_factory=dict)      # (family, b1) -> htid
    used_nodes: Dict[Tuple[int, int], Set[int]] = field(default_factory=dict)  # (htid, b2) -> ids
    free_htids: List[int] = field(default_factory=lambda: list(range(L2_HTID_LAST, L2_HTID_FIRST - 1, -1)))

    @staticmethod
    def buckets(key: FlowKey) -> Tuple[int, int]:
        return key.remote_port & 0xFF, key.local_port & 0xFF

    def place(self, key: FlowKey) -> Placement:
        """Choose the handle for a new leaf (and reserve it)."""
        fam = key.family
        b1, b2 = self.buckets(key)
        htid = self.l2.get((fam, b1))
        new = htid is None
        if new:
            if not self.free_htids:
                raise LayoutFull("no free u32 hash table id")
            htid = self.free_htids[-1]
        used = self.used_nodes.get((htid, b2), set())
        if len(used) >= MAX_NODE:
            raise LayoutFull(f"u32 bucket {htid:x}:{b2:x} holds {MAX_NODE} filters already")
        node = 1
        while node in used:
            node += 1
        if new:
            self.free_htids.pop()
            self.l2[(fam, b1)] = htid
        self.used_nodes.setdefault((htid, b2), set()).add(node)
        return Placement(fam, htid, b2, node, new, b1)

    def release(self, handle: int) -> None:
        htid, b2, node = u32.split_handle(handle)
        used = self.used_nodes.get((htid, b2))
        if used is not None:
            used.discard(node)
            if not used:
                del self.used_nodes[(htid, b2)]

    def forget_l2(self, family: int, b1: int) -> None:
        """Undo a reservation of an L2 table that could not be created."""
        htid = self.l2.pop((family, b1), None)
        if htid is not None:
            self.free_htids.append(htid)

    def adopt_l2(self, family: int, b1: int, htid: int) -> None:
        self.l2[(family, b1)] = htid
        if htid in self.free_htids:
            self.free_htids.remove(htid)

    def adopt_leaf(self, handle: int) -> None:
        htid, b2, node = u32.split_handle(handle)
        self.used_nodes.setdefault((htid, b2), set()).add(node)

    def family_of_l2(self, htid: int) -> Optional[Tuple[int, int]]:
        for (fam, b1), h in self.l2.items():
            if h == htid:
                return fam, b1
        return None
