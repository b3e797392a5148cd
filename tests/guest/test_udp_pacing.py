"""UDP datagrams paced by psp through the daemon (issue 17), in the VM's virtual time.

``flowpacer run --no-tracer --backend psp`` (sock_diag finds iperf3's connected UDP socket; bcc
would take minutes to compile under TCG) with one rule ``{process: iperf3, protocol: udp}`` at
10 Mbit/s; ``iperf3 -u -R`` offers 40 Mbit/s of 1200-byte datagrams from the server namespace.
Captured where they leave the server's veth (tcpdump, nanosecond stamps), the datagrams must be
spaced, not sent in bursts: >= 90 % of the gaps within +-25 % of the ideal gap, never more than
2 back to back, and the frame rate within 3 % of the rule.
"""
from __future__ import annotations

from harness import psplib
from harness.daemon import Daemon
from harness.testbed import wait_for as host_wait_for
from harness.pacing import PcapCapture, analyze, mbit, require_virtual_time, to_mbit

RULES = """
    interface: IFACE
    backend: psp
    link_rate: 1gbit
    rules:
      - name: udp
        match: {process: iperf3, protocol: udp}
        rate: 10mbit
"""
PORT, CPORT, SIZE = 5401, 45401, 1200


def test_psp_paces_udp_datagrams(tb, tmp_path, big_rmem):
    require_virtual_time()
    srv = tb.popen(tb.server_ns, ["iperf3", "-s", "-1", "-p", str(PORT)])
    tb.wait_listening(PORT)
    d = Daemon(tb, tmp_path, RULES, "--no-tracer", "--no-metrics", "--rescan", "0.2",
               backend="psp").start()
    try:
        with PcapCapture(tb.server_ns, tb.server_if, CPORT) as cap:
            cli = tb.popen(tb.client_ns, ["iperf3", "-c", str(tb.server_v4), "-p", str(PORT),
                                          "-u", "-R", "-b", "40M", "-l", str(SIZE), "-t", "4",
                                          "--cport", str(CPORT)])
            host_wait_for(lambda: any(f.get("protocol") == "udp" for f in d.flows()), 10, 0.05,
                          "the UDP flow in status")
            cli.wait(timeout=120)
        st = analyze(cap.packets, mbit(10), warmup_s=1.0, tail_s=0.2, full_frame=SIZE + 42)
        psplib.record(f"udp   10 psp {st.row()}")
        assert cap.drops == 0
        assert st.longest_run <= 2, f"{st.longest_run} datagrams back to back"
        assert st.within25 >= 0.90, f"within +-25 %: {100 * st.within25:.1f} %"
        assert abs(st.rate_error) <= 0.03, f"{to_mbit(st.rate_bps):.3f} Mbit/s of frames"
    finally:
        rc = d.stop()
        srv.kill()
    assert rc == 0
