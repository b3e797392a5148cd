"""psp (flowpacer's precise-pacing qdisc) as a backend: one class per flow, group classes above.

The qdisc makes its own default class (unpaced: unmatched traffic within the link rate) at
creation; flow classes hang under the qdisc and pace every wire packet on their byte clock,
borrowing idle link time up to their ceil.

Aggregates (issue 15): a rule with ``total_rate``/``client_rate`` gets psp *group* classes (rule
group, client group under it), made and removed with their flows in the same batch by the shared
tc backend (tc.py, groups.py), as htb's group classes are. Unlike htb, the module itself shares an
oversubscribed group among its backlogged members in proportion to their rates and holds the cap
on the group's byte clock (flowpacer/kernel/kmod/psp_sched.h, "Groups"), so the backend gives every class
its nominal values: a group its cap, a flow its rule's rate (``kernel_shares``): no flow class
changes when a sibling comes or goes.
"""
from __future__ import annotations

from flowpacer.errors import BackendError
from flowpacer.model import BackendKind, Shape
from flowpacer.kernel.tc import psp as enc


class PspCodec:
    """The ``Codec`` (contract.py) of psp."""
    kind = BackendKind.PSP
    qdisc_kind = "psp"
    has_link_class = False       # the link rate is a qdisc option
    makes_default_class = True
    supports_groups = True       # rule and client group classes above the flows
    kernel_shares = True         # the module shares a group's rate; groups.targets: nominal rates

    def qdisc_options(self, link_rate_bps: int, default_minor: int) -> bytes:
        return enc.qdisc_options(link_rate_bps, default_minor)

    def link_class_options(self, link_rate_bps: int) -> bytes:
        """psp has no link class (``has_link_class`` is false): asking for one is a bug."""
        raise BackendError("psp has no link class: its link rate is a qdisc option")

    def default_class_options(self, link_rate_bps: int) -> bytes:
        return enc.default_class_options()

    def group_class_options(self, rate_bps: int, ceil_bps: int, link_rate_bps: int) -> bytes:
        """A rule's or a client's group: its cap (``rate_bps``; a group never borrows)."""
        return enc.group_options(max(1, rate_bps))

    def flow_class_options(self, shape: Shape, link_rate_bps: int) -> bytes:
        ceil = min(max(shape.ceil_bps, shape.rate_bps), link_rate_bps)
        return enc.class_options(shape.rate_bps, max(ceil, shape.rate_bps))

    def parse_rates(self, options: dict):
        return enc.parse_class_rates(options)
