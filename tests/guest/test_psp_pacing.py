"""psp's pacing measured in the VM, side by side with htb in the same boot.

- Precision with TSO/GSO on (psp segments at enqueue and paces each wire packet) at 2 and
  10 Mbit/s, measured where the packets leave the sender's veth (``pacing.sender_capture``):
  the share of inter-packet gaps within +-25 % of the ideal gap is >= 80 % and at least 3x
  htb's (htb sends the GSO skbs whole: 0 %), and psp never sends more than 2 packets back to
  back (gaps under a quarter of the ideal; the simulator proves the bound exactly,
  tests/test_psp_sim.py): on the wire, and by the qdisc's own count (xstats longest_run),
  which must hold in every attempt.
- Sharing: 5 classes at 4,4,4,2,2 Mbit/s on a 10 Mbit/s psp link, all backlogged, get the
  link in proportion to their rates (2:2:2:1:1, each within 5 % of rate x 10/16).
- Borrowing: a class at 2 Mbit/s with ceil 6 gets its ceil while the link is idle and only
  its rate once another class needs the rest of the link.

Timing inside TCG depends on the host's load (a busy host stalls the guest's vCPUs for
milliseconds, for every qdisc alike; psp then drops clock lag beyond its catch-up windows, see
the report in docs/psp-results.md). A measurement that misses is therefore taken again, up to
3 times (precision: psp and htb back to back each time); every attempt's figures, with psp's
lateness and clamp counts, are recorded in pacing-figures.txt, so a pass on a retry is visible.
"""
from __future__ import annotations

import time

import pytest

import psplib
from pacing import (Capture, Htb, Iperf, IPERF_PORT, PacingStats, Psp, mbit, measure, to_mbit,
                    wait_for, window_rate)
from psplib import bed, psp_module  # noqa: F401

ATTEMPTS = 3
DURATION_S = {2: 5.0, 10: 4.0}


def _row(kind: str, rate: int, st: PacingStats, note: str = "") -> str:
    return f"{kind:5} {rate:4d} on  {st.row()}{note}"


@pytest.mark.parametrize("rate", [2, 10], ids=["2mbit", "10mbit"])
def test_psp_paces_wire_packets_with_gso_on(bed, rate):
    tb, sock = bed
    attempts = []
    for i in range(ATTEMPTS):
        psp = measure(tb, Psp(mbit(rate)), mbit(rate), gso=True, duration=DURATION_S[rate])
        x = sock.root(tb.sender_dev).xstats
        late_us = x["late_ns_total"] / max(1, x["paced_pkts"]) / 1e3
        # by the qdisc's own clock no run is ever longer than 2, however the VM behaves; the
        # wire (below) also shows vCPU stalls between dequeue and device, hence its retries
        assert 1 <= x["longest_run"] <= 2, f"psp's own longest run {x['longest_run']}"
        htb = measure(tb, Htb(mbit(rate)), mbit(rate), gso=True, duration=DURATION_S[rate])
        tb.clear_qdisc()
        runs_ok = psp.longest_run <= 2
        ok = (psp.within25 >= 0.80 and psp.within25 >= 3 * htb.within25
              and runs_ok and psp.mean_segs == 1.0)
        attempts.append((psp, htb, ok))
        psplib.record(_row("psp", rate, psp, f"  (attempt {i + 1}; mean lateness {late_us:.0f} us,"
                           f" worst {x['late_ns_max'] / 1e6:.1f} ms, clamps {x['clamps']}, "
                           f"GSO skbs split {x['gso_split']}, own longest run "
                           f"{x['longest_run']})"))
        psplib.record(_row("htb", rate, htb, f"  (attempt {i + 1})"))
        if ok:
            break
    psp, htb, ok = attempts[-1]
    assert psp.capture_drops == 0 and htb.capture_drops == 0
    assert ok, ("psp missed in every attempt: " + "; ".join(
        f"within25 {100 * p.within25:.1f} % (htb {100 * h.within25:.1f} %), longest run "
        f"{p.longest_run}" for p, h, _ in attempts))
    # the packets are paced, not the rate lost: psp's long-run rate stays on target
    assert abs(psp.rate_error) < 0.03, f"{to_mbit(psp.rate_bps):.3f} Mbit/s"


def _setup_classes(tb, sock, link_bps, classes):
    """psp root at ``link_bps``; class 0x10+i with (rate, ceil) fed by iperf3 port 5201+i."""
    tb.clear_qdisc()
    tb.set_gso(True)
    sock.add_qdisc(tb.sender_dev, link_rate_bps=link_bps)
    for i, (rate, ceil) in enumerate(classes):
        sock.add_class(tb.sender_dev, 0x10 + i, rate, ceil)
        tb.s("tc", "filter", "add", "dev", tb.sender_dev, "parent", "f1f0:", "protocol", "ip",
             "prio", "1", "u32", "match", "ip", "dport", str(IPERF_PORT + i), "0xffff",
             "flowid", f"f1f0:{0x10 + i:x}")


def _port_rate(cap: Capture, port: int, t0: int, t1: int) -> float:
    return window_rate([p for p in cap.packets if p.dport == port], t0, t1)


def _xstats_note(sock, dev) -> str:
    x = sock.root(dev).xstats
    return (f"mean lateness {x['late_ns_total'] / max(1, x['paced_pkts']) / 1e3:.0f} us, "
            f"worst {x['late_ns_max'] / 1e6:.1f} ms, clamps {x['clamps']}")


def _share_once(tb, sock, rates):
    _setup_classes(tb, sock, mbit(10), [(mbit(r), None) for r in rates])
    ports = [IPERF_PORT + i for i in range(len(rates))]
    with Capture(tb.receiver_ns, tb.receiver_dev, ports) as cap:
        with Iperf(tb, ports, duration=7) as ip:
            wait_for(lambda: ip.elapsed() >= 2.5, 20, "all flows to be backlogged")
            t0 = time.time_ns()
            q = sock.root(tb.sender_dev)
            wait_for(lambda: ip.elapsed() >= 6.5, 20, "the measurement window")
            t1 = time.time_ns()
            ip.wait()
    return [_port_rate(cap, p, t0, t1) for p in ports], q


def test_oversubscribed_link_shared_in_proportion_to_rates(bed):
    """4+4+4+2+2 = 16 Mbit/s of classes on a 10 Mbit/s link: 2:2:2:1:1."""
    tb, sock = bed
    rates = [4, 4, 4, 2, 2]
    want = [mbit(r) * 10 / sum(rates) for r in rates]
    for i in range(ATTEMPTS):
        got, q = _share_once(tb, sock, rates)
        errs = [abs(g / w - 1) for g, w in zip(got, want)]
        psplib.record(f"psp sharing 4,4,4,2,2 on 10 Mbit (attempt {i + 1}): " + ", ".join(
            f"{to_mbit(g):.3f} ({100 * g / w:.1f} %)" for g, w in zip(got, want))
            + f" Mbit/s, total {to_mbit(sum(got)):.3f}; rate sum seen "
            f"{q.xstats['rate_sum'] * 8 / 1e6:g} Mbit/s, active {q.xstats['active']}; "
            + _xstats_note(sock, tb.sender_dev))
        # all five backlogged (the unpaced default class may hold a stray ARP packet too)
        assert q.xstats["rate_sum"] == mbit(16) and q.xstats["active"] >= 5
        if max(errs) <= 0.05 and abs(sum(got) / mbit(10) - 1) <= 0.05:
            return
    pytest.fail(f"a class off its share by {100 * max(errs):.1f} % in every attempt: "
                + ", ".join(f"{to_mbit(g):.3f}/{to_mbit(w):.3f}" for g, w in zip(got, want)),
                pytrace=False)


def _borrow_once(tb, sock):
    _setup_classes(tb, sock, mbit(10), [(mbit(2), mbit(6)), (mbit(8), None)])
    a, b = IPERF_PORT, IPERF_PORT + 1
    with Capture(tb.receiver_ns, tb.receiver_dev, [a, b]) as cap:
        with Iperf(tb, [a], duration=10) as ia:
            wait_for(lambda: ia.elapsed() >= 1.0, 20, "A to start")
            alone0 = time.time_ns()
            wait_for(lambda: ia.elapsed() >= 4.0, 20, "A alone for 3 s")
            alone1 = time.time_ns()
            with Iperf(tb, [b], duration=5.5) as ib:
                wait_for(lambda: ib.elapsed() >= 1.5, 20, "B to be backlogged")
                both0 = time.time_ns()
                wait_for(lambda: ib.elapsed() >= 5.0, 20, "A and B together")
                both1 = time.time_ns()
                cls = sock.classes(tb.sender_dev)
                ib.wait()
            ia.wait()
    return (_port_rate(cap, a, alone0, alone1), _port_rate(cap, a, both0, both1),
            _port_rate(cap, b, both0, both1), cls)


def test_borrowing_up_to_ceil_only_while_the_link_is_idle(bed):
    """A: rate 2, ceil 6; B: rate 8; link 10 Mbit/s. A alone: its ceil. A and B: their rates."""
    tb, sock = bed
    for i in range(ATTEMPTS):
        a_alone, a_both, b_both, cls = _borrow_once(tb, sock)
        psplib.record(f"psp borrowing (attempt {i + 1}): A (2, ceil 6) alone "
                      f"{to_mbit(a_alone):.3f} Mbit/s; with B (8): A {to_mbit(a_both):.3f}, B "
                      f"{to_mbit(b_both):.3f}; A borrowed {cls[0x10].xstats['borrowed_pkts']} "
                      f"packets; " + _xstats_note(sock, tb.sender_dev))
        # only A borrows, and only while alone
        assert cls[0x10].xstats["borrowed_pkts"] > 0 and cls[0x11].xstats["borrowed_pkts"] == 0
        errs = (abs(a_alone / mbit(6) - 1), abs(a_both / mbit(2) - 1), abs(b_both / mbit(8) - 1))
        if max(errs) <= 0.05:
            return
    pytest.fail(f"off by {100 * max(errs):.1f} % in every attempt: A alone "
                f"{to_mbit(a_alone):.3f} (6), A {to_mbit(a_both):.3f} (2), B "
                f"{to_mbit(b_both):.3f} (8)", pytrace=False)
