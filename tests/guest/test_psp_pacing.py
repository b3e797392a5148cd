"""psp's pacing measured in the VM's virtual time, side by side with htb in the same boot.

These tests run with ``vm/run.py --clock virtual`` (``tests/test_vm.py`` does that): the guest's
clock counts instructions, so timers fire when they are due whatever the host's load, and the
same inputs give the same figures (``test_same_case_twice_same_figures`` checks it). No
measurement is taken again: a miss is a failure.

- Precision with TSO/GSO on (psp segments at enqueue and paces each wire packet) at 2, 10 and
  100 Mbit/s, measured where the packets leave the sender's veth (``pacing.sender_capture``):
  >= 95 % of the inter-packet gaps within +-10 % of the ideal gap (issue 14's goal; 100 % at
  2, 10 and 100 Mbit/s on the guest without ERMS and init_on_alloc, vm/README.md) and at least 3x htb's share within +-25 % (htb sends the GSO skbs whole: 0 %), never more
  than 2 packets back to back (gaps under a quarter of the ideal; the simulator proves the
  bound exactly, tests/test_psp_sim.py), on the wire and by the qdisc's own count (xstats
  longest_run), and the frame rate within 0.1 % of the target.
- At 1 Gbit/s with pktgen as the source: the same goals (``test_psp_at_1gbit_with_pktgen``).
- Sharing: 5 classes at 4,4,4,2,2 Mbit/s on a 10 Mbit/s psp link, all backlogged, get the
  link in proportion to their rates (2:2:2:1:1, each within 1 % of rate x 10/16).
- Borrowing: a class at 2 Mbit/s with ceil 6 gets its ceil while the link is idle and only
  its rate once another class needs the rest of the link.

Every figure, with psp's lateness and clamp counts, is recorded in pacing-figures.txt.
"""
from __future__ import annotations

import time

import pytest

from harness import psplib
from harness.pacing import (Capture, Htb, Iperf, IPERF_PORT, PacingStats, Psp, mbit, measure, measure_pktgen,
                    require_virtual_time, to_mbit, wait_for, window_rate)

DURATION_S = {2: 5.0, 10: 4.0, 100: 3.0}
RATES = (2, 10, 100)


@pytest.fixture(autouse=True, scope="module")
def _virtual_time():
    require_virtual_time()


def _row(kind: str, rate: int, st: PacingStats, note: str = "") -> str:
    return f"{kind:5} {rate:4d} on  {st.row()}{note}"


def _psp_note(x: dict) -> str:
    late_us = x["late_ns_total"] / max(1, x["paced_pkts"]) / 1e3
    return (f"mean lateness {late_us:.0f} us, worst {x['late_ns_max'] / 1e6:.2f} ms, clamps "
            f"{x['clamps']}, GSO skbs split {x['gso_split']}, own longest run {x['longest_run']}")


def _measure_psp(tb, sock, rate):
    st = measure(tb, Psp(mbit(rate)), mbit(rate), gso=True, duration=DURATION_S[rate])
    return st, sock.root(tb.sender_dev).xstats


@pytest.mark.parametrize("rate", RATES, ids=[f"{r}mbit" for r in RATES])
def test_psp_paces_wire_packets_with_gso_on(bed, rate):
    tb, sock = bed
    psp, x = _measure_psp(tb, sock, rate)
    psplib.record(_row("psp", rate, psp, "  (" + _psp_note(x) + ")"))
    htb = measure(tb, Htb(mbit(rate)), mbit(rate), gso=True, duration=DURATION_S[rate])
    tb.clear_qdisc()
    psplib.record(_row("htb", rate, htb))
    assert psp.capture_drops == 0 and htb.capture_drops == 0
    # by the qdisc's own clock no run is ever longer than 2; on the wire neither
    assert 1 <= x["longest_run"] <= 2, f"psp's own longest run {x['longest_run']}"
    assert psp.longest_run <= 2, f"longest run on the wire {psp.longest_run}"
    assert psp.mean_segs == 1.0                       # every GSO skb split at enqueue
    assert psp.within10 >= 0.95, f"within +-10 %: {100 * psp.within10:.1f} %"
    assert psp.within25 >= 0.95, f"within +-25 %: {100 * psp.within25:.1f} %"
    assert psp.within25 >= 3 * htb.within25
    # the packets are paced, not the rate lost: psp's rate stays on target
    assert abs(psp.fit_rate_error) <= 0.001, f"{to_mbit(psp.rate_bps):.4f} Mbit/s (fitted " \
        f"{100 * psp.fit_rate_error:+.4f} %)"
    assert abs(psp.rate_error) <= 0.001, f"{100 * psp.rate_error:+.4f} %"
    assert x["clamps"] == 0


GBIT = 1000


def test_psp_at_1gbit_with_pktgen(bed):
    """Issue 14's goal at 1 Gbit/s: >= 95 % of the gaps within +-10 % of the ideal 12.1 us,
    the rate within 0.1 %, never more than 2 packets back to back. The source is pktgen
    (1514-byte UDP frames at 1.1 Gbit/s through the qdisc, dropped at the receiver's ingress):
    a TCP sender and receiver in the one-vCPU guest leave the qdisc no CPU to be punctual with.

    The capture is the BPF one (``harness.xmitstamp``, nothing in user space per packet): on 6.1,
    which leaves pending softirqs to ksoftirqd once it is awake, tcpdump's process competes with
    ksoftirqd and so with the qdisc watchdog's softirq (psp 90.0 % with tcpdump, 98.0 % with the
    BPF capture; bench/results/vm_gaps_pktgen*.json)."""
    tb, sock = bed
    st = measure_pktgen(tb, Psp(mbit(GBIT)), mbit(GBIT), duration=2.0, capture="bpf")
    x = sock.root(tb.sender_dev).xstats
    tb.clear_qdisc()
    psplib.record(f"psp   {GBIT} pktgen {st.row()}  ({_psp_note(x)})")
    assert st.capture_drops == 0
    assert st.within10 >= 0.95, f"within +-10 %: {100 * st.within10:.1f} %"
    assert abs(st.rate_error) <= 0.001, f"{100 * st.rate_error:+.4f} %"
    assert st.longest_run <= 2 and x["longest_run"] <= 2, (st.longest_run, x["longest_run"])
    assert x["clamps"] == 0


# Two runs of one case in one boot differ only by what virtual time does not fix: the
# moments host I/O (the 9p root, the console) reaches the guest and the random TCP ports,
# ISNs and hash seeds. Measured on 6.1: within10/within25 equal to 0.1 pp, rate to 1e-5.
# The first-to-last rate also moves with the lateness of the window's two end packets: CI
# (f0b6fcf) saw one packet 2.37 ms late in one run (host I/O) and the rates 3.8e-4 apart on the
# 3 s window while the fitted rates stayed 4e-6 apart. So that rate's allowance adds the worst
# lateness psp counted in either run over the window; the fitted rate keeps the tight bound,
# and the longest back-to-back run may differ by the packets that lateness lets through at once.
SAME_PP = 0.005          # shares of gaps: 0.5 percentage points
SAME_RATE = 0.0002       # rate error: 0.02 percentage points
SAME_GAP = 0.01          # median gap: 1 %


def test_same_case_twice_same_figures(bed):
    """One case (psp at 10 Mbit/s, GSO on) measured twice gives the same figures within a
    tight tolerance: the pacing tests need no retries."""
    tb, sock = bed
    runs, worst_late_ns = [], 0
    for i in range(2):
        st, x = _measure_psp(tb, sock, 10)
        psplib.record(_row("psp", 10, st, f"  (determinism run {i + 1}; {_psp_note(x)})"))
        runs.append(st)
        worst_late_ns = max(worst_late_ns, x["late_ns_max"])
    a, b = runs
    ends_rate = SAME_RATE + worst_late_ns / 1e9 / min(a.window_s, b.window_s)
    diffs = {"within10": abs(a.within10 - b.within10), "within25": abs(a.within25 - b.within25),
             "b2b_share": abs(a.b2b_share - b.b2b_share),
             "rate_error": abs(a.rate_error - b.rate_error),
             "fit_rate_error": abs(a.fit_rate_error - b.fit_rate_error),
             "median_gap": abs(a.median_gap_us / b.median_gap_us - 1)}
    psplib.record("psp 10 Mbit twice: differences " + ", ".join(
        f"{k} {v:.6f}" for k, v in diffs.items()))
    assert diffs["within10"] <= SAME_PP and diffs["within25"] <= SAME_PP, diffs
    assert diffs["b2b_share"] <= SAME_PP, diffs
    assert diffs["fit_rate_error"] <= SAME_RATE, diffs
    assert diffs["rate_error"] <= ends_rate, (diffs, f"allowed {ends_rate:.6f}")
    assert diffs["median_gap"] <= SAME_GAP, diffs
    # a late packet is followed back to back by those whose departure time passed meanwhile
    # (the byte clock keeps the rate): rehearsal ci33 saw one 2.5 ms late (host I/O: a 3.7 ms
    # gap, then 3.5 us), a run of 2. Late by psp's count or by the widest gap seen.
    gap_us = min(a.median_gap_us, b.median_gap_us)
    late_us = max(worst_late_ns / 1000, *(st.gap_pct_us.get("max", 0) - gap_us for st in runs))
    assert abs(a.longest_run - b.longest_run) <= int(late_us // gap_us), \
        (a.longest_run, b.longest_run, f"lateness {late_us / 1000:.2f} ms")


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
    got, q = _share_once(tb, sock, rates)
    errs = [abs(g / w - 1) for g, w in zip(got, want)]
    psplib.record("psp sharing 4,4,4,2,2 on 10 Mbit: " + ", ".join(
        f"{to_mbit(g):.3f} ({100 * g / w:.2f} %)" for g, w in zip(got, want))
        + f" Mbit/s, total {to_mbit(sum(got)):.3f}; rate sum seen "
        f"{q.xstats['rate_sum'] * 8 / 1e6:g} Mbit/s, active {q.xstats['active']}; "
        + _xstats_note(sock, tb.sender_dev))
    # all five backlogged (the unpaced default class may hold a stray ARP packet too)
    assert q.xstats["rate_sum"] == mbit(16) and q.xstats["active"] >= 5
    assert max(errs) <= 0.01, (f"a class off its share by {100 * max(errs):.2f} %: " + ", ".join(
        f"{to_mbit(g):.3f}/{to_mbit(w):.3f}" for g, w in zip(got, want)))
    assert abs(sum(got) / mbit(10) - 1) <= 0.01, f"link {to_mbit(sum(got)):.3f} Mbit/s"


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
    a_alone, a_both, b_both, cls = _borrow_once(tb, sock)
    psplib.record(f"psp borrowing: A (2, ceil 6) alone {to_mbit(a_alone):.3f} Mbit/s; with B "
                  f"(8): A {to_mbit(a_both):.3f}, B {to_mbit(b_both):.3f}; A borrowed "
                  f"{cls[0x10].xstats['borrowed_pkts']} packets; "
                  + _xstats_note(sock, tb.sender_dev))
    # only A borrows, and only while alone
    assert cls[0x10].xstats["borrowed_pkts"] > 0 and cls[0x11].xstats["borrowed_pkts"] == 0
    errs = (abs(a_alone / mbit(6) - 1), abs(a_both / mbit(2) - 1), abs(b_both / mbit(8) - 1))
    assert max(errs) <= 0.02, (f"off by {100 * max(errs):.2f} %: A alone {to_mbit(a_alone):.3f}"
                               f" (6), A {to_mbit(a_both):.3f} (2), B {to_mbit(b_both):.3f} (8)")
