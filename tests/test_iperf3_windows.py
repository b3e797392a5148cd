"""harness.traffic's reading of an iperf3 report by windows of the test's own clock (the bond
and VRF guest tests measure flows before and after an event with it): only intervals wholly
inside the window count, and the rate is their bytes over their span."""
from harness.traffic import iperf3_rate_between


def report(per_interval):
    """A report of 0.25 s intervals with these byte counts."""
    return {"intervals": [{"sum": {"start": 0.25 * i, "end": 0.25 * (i + 1), "bytes": b}}
                          for i, b in enumerate(per_interval)]}


def test_a_window_takes_the_intervals_wholly_inside_it():
    rep = report([1000] * 4 + [500] * 4)            # 4000 B/s for 1 s, then 2000 B/s
    t0 = 100.0                                      # the test's start, on the caller's clock
    assert iperf3_rate_between(rep, t0, t0, t0 + 1.0) == 4000
    assert iperf3_rate_between(rep, t0, t0 + 1.0, t0 + 2.0) == 2000
    # a window's partial intervals are left out, not prorated
    assert iperf3_rate_between(rep, t0, t0 + 0.1, t0 + 1.9) == (3 * 1000 + 3 * 500) / 1.5
    # nothing inside: 0, which fails any rate assertion rather than passing one
    assert iperf3_rate_between(rep, t0, t0 + 5, t0 + 6) == 0.0
    assert iperf3_rate_between(rep, t0, t0 + 0.3, t0 + 0.4) == 0.0
