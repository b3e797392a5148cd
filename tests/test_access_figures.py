"""The access benchmark's figures (issue 30, harness/accessfig.py): goodput per second, time to
first N KiB, a stream player's stalls, Jain's index, ss's retransmits, CPU per gigabit. Pure
logic on made-up byte counts: no namespace, no VM."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness import accessfig as F

BIN = 0.01


def steady(rate_bytes_s: float, seconds: float, start_s: float = 0.0):
    """Bins of a flow receiving ``rate_bytes_s`` from ``start_s`` on."""
    n = int(round(seconds / BIN))
    return [0 if i * BIN < start_s - 1e-9 else int(rate_bytes_s * BIN) for i in range(n)]


def test_per_second_whole_seconds_of_the_window():
    bins = steady(1000, 5)
    assert F.per_second(bins, BIN, 0, 5) == pytest.approx([1000] * 5)
    assert F.per_second(bins, BIN, 1.5, 5) == pytest.approx([1000] * 3 + [1000])  # 3.5 s: 4 parts
    assert len(F.per_second(bins, BIN, 0, 4.3)) == 4                       # 0.3 s left out
    bins[250] += 5000                                                       # a burst in second 2
    assert F.per_second(bins, BIN, 0, 5)[2] == pytest.approx(6000)


def test_first_reach():
    bins = steady(10_000, 2, start_s=0.5)            # 100 bytes a bin from 0.5 s
    assert F.first_reach(bins, BIN, 100) == pytest.approx(0.51)
    assert F.first_reach(bins, BIN, 1000) == pytest.approx(0.60)
    assert F.first_reach(bins, BIN, 10 ** 9) is None


def test_playout_stream_at_its_bitrate_never_stalls():
    rate = 25_000
    bins = steady(rate, 6)
    bins[0] += rate * 2                              # the 2 s preroll at once
    p = F.playout(bins, BIN, rate, preroll_bytes=rate)
    assert p["start_s"] == pytest.approx(0.01)
    assert (p["stalls"], p["stall_s"], p["below_bitrate_seconds"]) == (0, 0, 0)


def test_playout_counts_a_gap_as_stall_seconds():
    rate = 25_000
    bins = steady(rate, 10)
    bins[0] += rate                                  # 1 s ahead
    for i in range(300, 500):                        # nothing for 2 s from 3 s on
        bins[i] = 0
    p = F.playout(bins, BIN, rate, preroll_bytes=rate, rebuffer_bytes=rate // 2)
    assert p["stalls"] == 1
    # 1 s of buffer covers 3-4 s; dry at 4 s until 5 s, then 0.5 s to rebuffer
    assert p["stall_s"] == pytest.approx(1.5, abs=0.03)
    assert p["below_bitrate_seconds"] == 2           # seconds 4 and 5
    assert F.playout(bins, BIN, rate, rate, rate // 2, t_from=5)["below_bitrate_seconds"] == 1


def test_playout_slower_than_bitrate_stalls_and_before_start_is_no_stall():
    bins = steady(10_000, 8, start_s=1.0)
    p = F.playout(bins, BIN, 20_000, preroll_bytes=20_000)
    assert p["start_s"] == pytest.approx(3.0)       # 2 s of 10 kB/s to reach the preroll
    # it drains 10 kB/s net: dry in the bin at 4.99 s, 2 s to rebuffer: seconds 4, 5 and 6
    assert p["stalls"] == 1 and p["below_bitrate_seconds"] == 3 and p["stall_s"] == pytest.approx(2)
    assert F.playout([0] * 100, BIN, 1000, 1000) == {"start_s": None, "stall_s": 0,
                                                      "stalls": 0, "below_bitrate_seconds": 0}


def test_jain():
    assert F.jain([1, 1, 1]) == pytest.approx(1)
    assert F.jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert F.jain([None, 2, 2]) == pytest.approx(1)
    assert F.jain([]) is None and F.jain([0, 0]) is None


SS = """\
0      0      [::ffff:10.90.0.1]:5700 [::ffff:10.92.0.1]:50180
\t cubic wscale:10,10 rto:208 mss:1448 cwnd:21 bytes_sent:3024979 retrans:0/28 minrtt:0.044
0      85432  [fd90::1]:5701    [fd92:0:0:1::1]:52054
\t bbr wscale:10,10 rto:216 mss:1428 cwnd:13 bytes_sent:1501163 delivered:1032
0      0      [::ffff:10.90.0.1]:5700 [::ffff:10.92.0.1]:50181
\t cubic retrans:1/3 lost:1
"""


def test_ss_retransmits_per_local_port():
    assert F.ss_retransmits(SS) == {5700: 31, 5701: 0}
    with_state = "ESTAB " + SS.splitlines()[0] + "\n" + SS.splitlines()[1] + "\n"
    assert F.ss_retransmits(with_state) == {5700: 28}


def test_cpu_per_gbit_and_quantiles():
    assert F.cpu_per_gbit(2.0, 125_000_000) == pytest.approx(2.0)
    assert F.cpu_per_gbit(1.0, 0) is None
    q = F.quantiles(list(range(1, 101)), 4)
    assert q == [1, 25, 50, 75, 100]
    assert F.quantiles([], 10) == []


def test_added_delays_above_the_flows_minimum_in_the_window():
    a = [SimpleNamespace(sent_ns=t, recv_ns=t + d) for t, d in
         ((0, 5_000_000), (10, 6_000_000), (20, 9_000_000), (30, 5_500_000))]
    assert F.added_delays_ms(a, 10, 30) == pytest.approx([1.0, 4.0])
    assert F.added_delays_ms([], 0, 1) == []
