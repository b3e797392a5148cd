"""psp (flowpacer's precise-pacing qdisc) as a backend: flat classes, one per flow.

The qdisc makes its own default class (unpaced: unmatched traffic within the link rate) at
creation; flow classes hang directly under the qdisc and pace every wire packet on their byte
clock, borrowing idle link time up to their ceil.
"""
from __future__ import annotations

from ..model import Shape
from ..tc import psp as enc


class PspCodec:
    kind = "psp"
    has_link_class = False
    makes_default_class = True

    def qdisc_options(self, link_rate_bps: int, default_minor: int) -> bytes:
        return enc.qdisc_options(link_rate_bps, default_minor)

    def default_class_options(self, link_rate_bps: int) -> bytes:
        return enc.default_class_options()

    def flow_class_options(self, shape: Shape, link_rate_bps: int) -> bytes:
        ceil = min(max(shape.ceil_bps, shape.rate_bps), link_rate_bps)
        return enc.class_options(shape.rate_bps, max(ceil, shape.rate_bps))

    def parse_rates(self, options: dict):
        return enc.parse_class_rates(options)
