"""htb options as the kernel (>= 3.x) reads them: no rate tables.

Since linux 3.8 htb computes transmit times from ``struct tc_ratespec`` itself
(``psched_ratecfg_precompute``); the 256-entry RTAB/CTAB tables that iproute2 and pyroute2 still
build are read only when ``linklayer`` is ``TC_LINKLAYER_UNAWARE``. Setting the link layer to
Ethernet lets us send a class in ~100 bytes without them. Rates at or above 2**32 bytes/s go in
TCA_HTB_RATE64/CEIL64 with the 32-bit field saturated, as iproute2 does.

Layout mirrors ``linux/pkt_sched.h``; ``tests/test_tc_encoding.py`` checks it against the header
and against pyroute2's own ``sched_htb`` nla classes.
"""
from __future__ import annotations

import struct

from pyroute2.netlink.rtnl.tcmsg import sched_htb as _pyroute2_htb

from flowpacer.kernel.tc.nl import TCA_KIND, TCA_OPTIONS, nla, nla_nested, nla_str, nla_u64

# enum TCA_HTB_* (linux/pkt_sched.h)
TCA_HTB_PARMS = 1
TCA_HTB_INIT = 2
TCA_HTB_CTAB = 3
TCA_HTB_RTAB = 4
TCA_HTB_DIRECT_QLEN = 5
TCA_HTB_RATE64 = 6
TCA_HTB_CEIL64 = 7

TC_HTB_PROTOVER = 3
TC_LINKLAYER_ETHERNET = 1
PSCHED_TICK_NS = 64          # PSCHED_SHIFT = 6: htb's buffer/cbuffer are in 64 ns ticks

# struct tc_ratespec { u8 cell_log; u8 linklayer; u16 overhead; s16 cell_align; u16 mpu; u32 rate; }
RATESPEC = struct.Struct("=BBHhHI")
# struct tc_htb_opt { tc_ratespec rate, ceil; u32 buffer, cbuffer, quantum, level, prio; }
HTB_OPT = struct.Struct("=BBHhHI" "BBHhHI" "IIIII")
# struct tc_htb_glob { u32 version, rate2quantum, defcls, debug, direct_pkts; }
HTB_GLOB = struct.Struct("=IIIII")

U32_MAX = 0xFFFFFFFF


def ticks(size_bytes: int, rate_bps: int) -> int:
    """Time to send ``size_bytes`` at ``rate_bps`` (bytes/s), in psched ticks, as htb wants."""
    t = (size_bytes * 1_000_000_000) // (max(rate_bps, 1) * PSCHED_TICK_NS)
    return max(1, min(t, U32_MAX))


def qdisc_options(default_minor: int, r2q: int = 10) -> bytes:
    """TCA_KIND + TCA_OPTIONS for ``tc qdisc add ... htb default MINOR``."""
    glob = HTB_GLOB.pack(TC_HTB_PROTOVER, r2q, default_minor, 0, 0)
    return nla_str(TCA_KIND, "htb") + nla_nested(TCA_OPTIONS, nla(TCA_HTB_INIT, glob))


def class_options(rate_bps: int, ceil_bps: int, burst_bytes: int, cburst_bytes: int,
                  quantum_bytes: int, prio: int = 0) -> bytes:
    """TCA_KIND + TCA_OPTIONS for an htb class; rates in bytes/s."""
    r32 = min(rate_bps, U32_MAX)
    c32 = min(ceil_bps, U32_MAX)
    parms = HTB_OPT.pack(0, TC_LINKLAYER_ETHERNET, 0, 0, 0, r32,
                         0, TC_LINKLAYER_ETHERNET, 0, 0, 0, c32,
                         ticks(burst_bytes, rate_bps), ticks(cburst_bytes, ceil_bps),
                         quantum_bytes, 0, prio)
    opts = [nla(TCA_HTB_PARMS, parms)]
    if rate_bps >= U32_MAX:
        opts.append(nla_u64(TCA_HTB_RATE64, rate_bps))
    if ceil_bps >= U32_MAX:
        opts.append(nla_u64(TCA_HTB_CEIL64, ceil_bps))
    return nla_str(TCA_KIND, "htb") + nla_nested(TCA_OPTIONS, *opts)


def parse_class_rates(options: dict) -> tuple:
    """(rate_bps, ceil_bps) from a dumped class's parsed TCA_OPTIONS."""
    raw = options.get(TCA_HTB_PARMS)
    if not raw:
        return 0, 0
    f = HTB_OPT.unpack_from(raw)
    rate, ceil = f[5], f[11]
    if TCA_HTB_RATE64 in options:
        rate = struct.unpack_from("=Q", options[TCA_HTB_RATE64])[0]
    if TCA_HTB_CEIL64 in options:
        ceil = struct.unpack_from("=Q", options[TCA_HTB_CEIL64])[0]
    return rate, ceil


# pyroute2's declaration of the same attributes (used to decode dumps in pyroute2 and, in the
# tests, to check that our packing says what pyroute2's nla_map says). Ours adds nothing to it.
options = _pyroute2_htb.options
