"""htb as a pacing backend: one class per flow under a link class, default class for the rest.

Burst and quantum: the kernel's default burst (~1600 B) is 12.8 us at 1 Gbit, shorter than the
watchdog's lateness, so the tokens a late timer would have earned are capped away and the class
falls short (74 % of 1 Gbit on veth, facts.md). We give each class ``BURST_NS`` worth of tokens at
its rate (at least ``MIN_BURST_BYTES``) and set the quantum ourselves, rate/10 clamped to
[MTU, 200 000] bytes, so the kernel never prints its "quantum is big/small" warning.
"""
from __future__ import annotations

from flowpacer.model import BackendKind, Shape
from flowpacer.kernel.tc import htb as enc

BURST_NS = 2_000_000
MIN_BURST_BYTES = 3200           # two full-size Ethernet frames
MIN_QUANTUM = 1514
MAX_QUANTUM = 200_000
# unmatched traffic: guaranteed a sliver, borrows the rest of the link
DEFAULT_SHARE = 0.01


def burst_for(rate_bps: int) -> int:
    return max(MIN_BURST_BYTES, rate_bps * BURST_NS // 1_000_000_000)


def quantum_for(rate_bps: int) -> int:
    return max(MIN_QUANTUM, min(MAX_QUANTUM, rate_bps // 10))


class HtbCodec:
    """The ``Codec`` (contract.py) of htb."""
    kind = BackendKind.HTB
    qdisc_kind = "htb"
    has_link_class = True
    makes_default_class = False  # the backend makes :2 under the link class
    supports_groups = True       # rule and client classes above the flows (groups.py)
    kernel_shares = False        # htb gives each child its share (groups.targets computes it)

    def qdisc_options(self, link_rate_bps: int, default_minor: int) -> bytes:
        return enc.qdisc_options(default_minor)

    def _class(self, rate: int, ceil: int, prio: int = 0) -> bytes:
        return enc.class_options(rate, ceil, burst_for(rate), burst_for(ceil), quantum_for(rate), prio)

    def link_class_options(self, link_rate_bps: int) -> bytes:
        return self._class(link_rate_bps, link_rate_bps)

    def default_class_options(self, link_rate_bps: int) -> bytes:
        rate = max(1000, int(link_rate_bps * DEFAULT_SHARE))
        return self._class(rate, link_rate_bps, prio=1)

    def group_class_options(self, rate_bps: int, ceil_bps: int, link_rate_bps: int) -> bytes:
        """A rule's or a client's class: same prio as the flows, quantum by its rate."""
        return self._class(rate_bps, min(max(ceil_bps, rate_bps), link_rate_bps))

    def flow_class_options(self, shape: Shape, link_rate_bps: int) -> bytes:
        return self._class(shape.rate_bps, min(max(shape.ceil_bps, shape.rate_bps), link_rate_bps))

    def parse_rates(self, options: dict):
        return enc.parse_class_rates(options)
