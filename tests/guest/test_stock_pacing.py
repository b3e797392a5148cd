"""The measurement tools, proven on the kernel's stock qdiscs (htb, tbf, fq) in the VM.

Each configuration is measured once per boot (memoized) and its figures are appended to
``$FLOWPACER_VM_OUT/pacing-figures.txt``. What is asserted is what was measured to hold on
the 6.1 guest under TCG, with margins for a loaded host:

- htb at 10 Mbit/s delivers a goodput near the target (the best possible is 95.6 %: 1448-byte
  payloads in 1514-byte frames);
- with GSO on, htb and fq hand the veth multi-segment skbs: the wire sees bursts, almost no
  gap is within +-25 % of the ideal one;
- with GSO off (ethtool + gso_max_segs 1) every skb is one MTU-sized packet and most gaps
  are within +-25 % of the ideal;
- tbf splits GSO skbs bigger than its bucket, so it paces wire packets even with GSO on.

Not asserted: the rate at 10 Mbit/s with GSO off. One MTU-sized skb per 1.2 ms leaves htb,
tbf and fq no credit to catch up when the emulated timer fires late, and on a busy host any
of them lost up to 45 % of the rate there in some boots (none at 2 Mbit/s).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Tuple

import pytest

from harness.pacing import Fq, Htb, PacingStats, Tbf, Testbed, mbit, measure, require_virtual_time, to_mbit

QDISCS = {"htb": Htb, "tbf": Tbf, "fq": Fq}
RATES_MBIT = (2, 10)
DURATION_S = {2: 5.0, 10: 4.0}   # >= ~650 wire packets after the 1 s warm-up


@pytest.fixture(autouse=True, scope="module")
def _virtual_time():
    require_virtual_time()


@pytest.fixture(scope="module")
def figures():
    """figures(kind, rate_mbit, gso) -> PacingStats, measured once per module."""
    cache: Dict[Tuple[str, int, bool], PacingStats] = {}
    out = Path(os.environ.get("FLOWPACER_VM_OUT", "/tmp")) / "pacing-figures.txt"
    with Testbed() as tb:
        def get(kind: str, rate: int, gso: bool) -> PacingStats:
            key = (kind, rate, gso)
            if key not in cache:
                st = measure(tb, QDISCS[kind](mbit(rate)), mbit(rate), gso=gso,
                             duration=DURATION_S[rate])
                cache[key] = st
                new = not out.exists()
                with open(out, "a") as f:
                    if new:
                        f.write(f"{'qdisc':5} {'Mbit':>4} {'gso':3} {PacingStats.HEADER}\n")
                    f.write(f"{kind:5} {rate:4d} {'on' if gso else 'off':3} {st.row()}\n")
            print(f"{key}: {PacingStats.HEADER}\n{key}: {cache[key].row()}")
            return cache[key]
        yield get


CONFIGS = [(k, r, g) for r in RATES_MBIT for g in (True, False) for k in QDISCS]


@pytest.mark.parametrize("kind,rate,gso", CONFIGS,
                         ids=[f"{k}-{r}mbit-gso_{'on' if g else 'off'}" for k, r, g in CONFIGS])
def test_figures_sane(figures, kind, rate, gso):
    """Every configuration: enough packets, no qdisc above its rate, GSO really on or off."""
    st = figures(kind, rate, gso)
    expected = mbit(rate) * (DURATION_S[rate] - 1) / 1514
    assert st.packets > 0.4 * expected, f"only {st.packets} packets of ~{expected:.0f}"
    assert st.capture_drops == 0
    assert st.rate_error < 0.10, f"{to_mbit(st.rate_bps):.2f} Mbit/s exceeds {rate} Mbit/s"
    if not gso:
        assert st.mean_segs == 1.0       # gso_max_segs 1: MTU-sized skbs
    elif kind == "tbf":
        assert st.mean_segs <= 1.05      # split, except skbs that fit the 2-packet bucket
    else:
        assert st.mean_segs >= 2.0       # TCP builds multi-segment skbs


def test_htb_goodput_near_target(figures):
    st = figures("htb", 10, True)
    # 95.6 % is the ideal; a window of ~60 GSO skbs measures to about +-2 %
    assert 0.85 <= st.goodput_bps / mbit(10) <= 0.99, f"{to_mbit(st.goodput_bps):.2f} Mbit/s"
    assert abs(st.rate_error) < 0.05
    # iperf3's own count (whole run, slow start included) agrees
    assert 0.80 <= st.iperf_bps / mbit(10) <= 1.0


@pytest.mark.parametrize("rate", RATES_MBIT, ids=[f"{r}mbit" for r in RATES_MBIT])
@pytest.mark.parametrize("kind", ["htb", "fq"])
def test_gso_on_bursts_gso_off_paces(figures, kind, rate):
    on, off = figures(kind, rate, True), figures(kind, rate, False)
    assert on.within25 <= 0.15
    assert on.longest_run >= 3 and on.b2b_share >= 0.5
    # GSO off: late timers in the emulated guest can cost rate at 10 Mbit/s (longer gaps
    # than the ideal), but the wire packets are spread out, not sent in trains
    assert off.within25 >= on.within25 + 0.2
    assert off.b2b_share <= on.b2b_share - 0.4
    assert off.longest_run < on.longest_run or off.longest_run <= 3


@pytest.mark.parametrize("kind", ["htb", "fq", "tbf"])
def test_mtu_packets_paced_at_2mbit(figures, kind):
    st = figures(kind, 2, False)
    assert st.within25 >= 0.5
    assert st.longest_run <= 8


@pytest.mark.parametrize("rate", RATES_MBIT, ids=[f"{r}mbit" for r in RATES_MBIT])
def test_tbf_paces_wire_packets_with_gso_on(figures, rate):
    tbf, htb = figures("tbf", rate, True), figures("htb", rate, True)
    assert tbf.within25 >= htb.within25 + 0.3
    assert tbf.b2b_share <= htb.b2b_share - 0.4
    assert tbf.longest_run < htb.longest_run or tbf.longest_run <= 3
