"""`flowpacer top`: the view's pure parts (rates, layout, escaping), and the real thing in a tmux
pane next to a real daemon shaping real flows in a testbed."""
import os
import re
import subprocess

import pytest

from harness.testbed import PY, client_argv, server_argv, wait_for
from flowpacer.text import ascii_only as term_safe
from flowpacer.surfaces.top import Tracker, render
from flowpacer.units import format_bit_rate as fmt_bits

from harness.daemon import Daemon

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def status(flows, **kw):
    st = {"backend": "htb", "interface": "eth0", "link_rate_bit": 10**9, "shaped_flows": len(flows),
          "live_flows": len(flows), "flow_source": "tracer", "flows": flows}
    st.update(kw)
    return st


def flow(local, nbytes, rule="r", rate=10**7, process="srv", classid="f1f0:10"):
    return {"rule": rule, "pid": 42, "process": process, "local": local, "remote": "10.0.0.2:5000",
            "classid": classid, "rate_bit": rate, "ceil_bit": rate, "bytes": nbytes}


# ------------------------------------------------------------------ pure parts

def test_actual_rate_is_byte_growth_over_time_and_rows_sort_by_it():
    t = Tracker("/x.sock", 1.0)
    v = t.update(status([flow("1.1.1.1:1", 1000), flow("1.1.1.1:2", 5000, classid="f1f0:11")]), 10.0)
    assert [r.actual_bit for r in v.rows] == [None, None]          # one answer: no rate yet
    v = t.update(status([flow("1.1.1.1:1", 1000 + 250_000), flow("1.1.1.1:2", 5000 + 1_000_000,
                                                                    classid="f1f0:11")]), 12.0)
    assert [(r.local, r.actual_bit) for r in v.rows] == [("1.1.1.1:2", 4_000_000.0),
                                                         ("1.1.1.1:1", 1_000_000.0)]
    assert [(x.rule, x.flows, x.actual_bit, x.target_bit) for x in v.totals] == \
        [("r", 2, 5_000_000.0, 2 * 10**7)]
    # the 10 s average spans every answer of the last 10 s; "actual" only the last refresh
    v = t.update(status([flow("1.1.1.1:1", 1000 + 250_000), flow("1.1.1.1:2", 5000 + 1_000_000,
                                                                    classid="f1f0:11")]), 14.0)
    assert [(r.local, r.actual_bit, r.avg_bit) for r in v.rows] == \
        [("1.1.1.1:2", 0.0, 2_000_000.0), ("1.1.1.1:1", 0.0, 500_000.0)]     # ties: by average
    for k in range(1, 20):                   # then only the last 10 s or so count
        v = t.update(status([flow("1.1.1.1:1", 1000 + 250_000 + k * 125_000)]), 14.0 + k)
    assert v.rows[0].actual_bit == 1_000_000.0 and v.rows[0].avg_bit == 1_000_000.0
    # a counter that went backwards (the flow's class was re-made) has no rate, not a negative one
    v = t.update(status([flow("1.1.1.1:1", 10)]), 13.0)
    assert [r.actual_bit for r in v.rows] == [None]


def test_a_flow_with_a_receive_class_counts_each_side_apart():
    """Issue 17: one flow, a send and a receive class with the same class id (on two devices):
    two rows with their own rates, the receive one under "RULE (receive)", totals apart."""
    t = Tracker("/x.sock", 1.0)

    def both(sent, received):
        return status([flow("1.1.1.1:1", sent), dict(flow("1.1.1.1:1", received), side="receive")])
    t.update(both(0, 0), 10.0)
    v = t.update(both(500_000, 125_000), 11.0)
    assert sorted((r.rule, r.actual_bit) for r in v.rows) == [("r", 4_000_000.0),
                                                              ("r (receive)", 1_000_000.0)]
    assert sorted((x.rule, x.flows) for x in v.totals) == [("r", 1), ("r (receive)", 1)]


def test_daemon_gone_is_reported_and_counts_start_over():
    t = Tracker("/run/x.sock", 0.5)
    t.update(status([flow("1.1.1.1:1", 1000)]), 1.0)
    v = t.failed("no daemon answers on /run/x.sock: Connection refused")
    assert "daemon not answering" in v.error and "retrying every 0.5 s" in v.error and not v.rows
    lines = render(v, 120, 30)
    assert any("daemon not answering" in text for _s, text in lines)
    v = t.update(status([flow("1.1.1.1:1", 9000)]), 3.0)
    assert v.rows[0].actual_bit is None                 # no rate across the gap
    # an answer of the wrong shape is reported like a missing daemon, not a traceback
    v = t.update({"flows": [{"no": "fields"}]}, 4.0)
    assert "unreadable status answer" in v.error


def test_untrusted_strings_are_escaped_to_printable_ascii():
    assert term_safe("a\x1b[2Jb\n\u202e\u4e2d") == "a\\x1b[2Jb\\x0a\\u202e\\u4e2d"
    t = Tracker("/x\x07.sock", 1.0)
    v = t.update(status([flow("1.1.1.1:1", 1, process="evil\x1b]0;pwn\x07", rule="r\x1b")],
                        interface="e\x1bth0", flow_source="x\r\n"), 1.0)
    for _style, text in render(v, 200, 40):
        assert all(0x20 <= ord(c) < 0x7F for c in text), repr(text)
    assert any("evil\\x1b]0;pwn\\x07" in text for _s, text in render(v, 200, 40))
    assert "\\x07" in t.failed("x").error


@pytest.mark.parametrize("w,h", [(20, 3), (30, 5), (40, 8), (80, 12), (200, 60), (5, 1), (0, 0)])
def test_render_fits_any_terminal(w, h):
    t = Tracker("/x.sock", 1.0)
    flows = [flow(f"10.0.0.1:{p}", p * 1000, rule=f"rule{p % 3}") for p in range(1, 40)]
    t.update(status(flows), 1.0)
    v = t.update(status([dict(f, bytes=f["bytes"] * 3) for f in flows]), 2.0)
    lines = render(v, w, h)
    assert len(lines) <= h and all(len(text) <= w for _s, text in lines)
    if h >= 12 and w >= 80:
        texts = [text for _s, text in lines]
        assert texts[0].startswith("flowpacer top")
        assert any(text.startswith("RULE") and "FLOWS" in text for text in texts)   # totals
        assert any(text.startswith("RULE") and "PROCESS" in text for text in texts)  # flows
        flow_lines = [x for x in texts if x.startswith("rule") and "10.0.0.2:5000" in x]
        if h < 39:
            assert texts[-1].startswith("... ") and texts[-1].endswith("more flows")
            assert len(flow_lines) + int(texts[-1].split()[1]) == 39
        else:
            assert len(flow_lines) == 39
        head = next(x for x in texts if x.startswith("RULE") and "PROCESS" in x)
        assert "ACTUAL" in head and "TARGET" in head and "REMOTE" in head    # what matters most
        col = head.index("ACTUAL")
        rates = [float(x[col - 4:].split()[0]) for x in flow_lines]   # kbit/s here: sorted
        assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]
        if w == 80:
            assert "AVG" not in head                                  # dropped to make room
            assert all(x.endswith("B") for x in flow_lines)           # the rest is whole
        if w == 200:
            assert "AVG 10s" in head and "SENT" in head and "LOCAL" in head


def test_fmt_bits():
    assert fmt_bits(None) == "-" and fmt_bits(9_494_000) == "9.49 Mbit/s"
    assert fmt_bits(1.5e9) == "1.5 Gbit/s" and fmt_bits(999) == "999 bit/s"


def test_top_without_a_terminal_says_so(tmp_path):
    r = subprocess.run([PY, "-m", "flowpacer", "top", "--socket", str(tmp_path / "s")],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "needs a terminal" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ in tmux, for real

# the ``tmux`` fixture (a private tmux server, ``harness.terminal.Tmux``) is in conftest.py


TOP_RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: slow
        match: {process: fp-test-srv, direction: inbound, local_port: 9101}
        rate: 10mbit
      - name: odd
        match: {process: "fp?odd", direction: inbound, local_port: 9103}
        rate: 5mbit
"""

FLOW_RE = re.compile(r"^slow\s+(\d+)\s+fp-test-srv\s+(\S+)\s+(\S+)\s+10 Mbit/s\s+"
                     r"([\d.]+) (\w?)bit/s\s+([\d.]+) (\w?)bit/s\s", re.M)
MBIT = {"G": 1000, "M": 1, "k": 0.001, "": 1e-6}


def _rates_mbit(screen, remote):
    """(actual, 10 s average) of the flow to ``remote`` in Mbit/s, or None."""
    for m in FLOW_RE.finditer(screen):
        if m.group(3) == remote:
            return float(m.group(4)) * MBIT[m.group(5)], float(m.group(6)) * MBIT[m.group(7)]
    return None


def _plausible(screen, remote):
    r = _rates_mbit(screen, remote)
    # one refresh is noisy (the counter grows by whole GSO packets); the average is held to
    # the rule's 10 Mbit/s (the class counts frames, headers included)
    return r is not None and 4 <= r[0] <= 16 and 8.5 <= r[1] <= 10.8


def test_top_in_tmux_shows_flows_rates_and_survives_the_daemon(testbed, tmp_path, tmux):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.popen(testbed.server_ns, server_argv([9103], "fp\x1bodd"))       # a hostile comm
    testbed.wait_listening(9101)
    testbed.wait_listening(9103)
    d = Daemon(testbed, tmp_path, TOP_RULES).start()
    try:
        host = str(testbed.server_v4)
        testbed.popen(testbed.client_ns, client_argv(host, 9101, 40, local_port=45101))
        testbed.popen(testbed.client_ns, client_argv(host, 9103, 40, local_port=45103))
        wait_for(lambda: len([f for f in d.flows() if f["bytes"] > 0]) == 2, 10, 0.05,
                 "both flows shaped")

        tmux.start([PY, "-m", "flowpacer", "top", "--socket", d.sock, "--interval", "0.5"])
        remote = f"{testbed.client_v4}:45101"
        # the flow, with its rule, pid, process, addresses, target, and an actual rate near
        # the 10 Mbit/s it is held to (the class counts the frames' bytes, headers included)
        screen = tmux.wait_screen(lambda s: _plausible(s, remote), 15,
                                  "the shaped flow at a plausible actual rate")
        pid = int(FLOW_RE.search(screen).group(1))
        assert pid == next(f["pid"] for f in d.flows() if f["rule"] == "slow")
        assert re.search(r"^slow\s+1\s+10 Mbit/s\s+[\d.]+ \w?bit/s\s+[\d.]+ Mbit/s\s", screen,
                         re.M), screen                                          # totals
        assert "backend htb on " + testbed.server_if in screen
        # the hostile process name arrives escaped, not as an escape sequence
        assert re.search(r"^odd\s+\d+\s+fp\\x1bodd\s", screen, re.M), screen
        # the faster flow sorts first: 10 Mbit/s above 5 Mbit/s
        flow_lines = [l for l in screen.splitlines() if re.match(r"^(slow|odd)\s+\d+\s+fp", l)]
        assert [l.split()[0] for l in flow_lines] == ["slow", "odd"], screen

        # a tiny terminal: still drawn, no crash; back to a large one: the flows again
        tmux("resize-window", "-t", "t", "-x", "30", "-y", "6")
        tmux.wait_screen(lambda s: s.splitlines()[0].startswith("flowpacer top") and
                         max(len(l) for l in s.splitlines()) <= 30, 5, "the small layout")
        tmux("resize-window", "-t", "t", "-x", "160", "-y", "40")
        tmux.wait_screen(lambda s: _rates_mbit(s, remote) is not None, 5, "the large layout")
        assert tmux.dead() is None
    finally:
        assert d.stop() == 0

    # the daemon is gone: top says so and keeps running
    tmux.wait_screen(lambda s: "daemon not answering" in s, 10, "'daemon not answering'")
    assert tmux.dead() is None
    tmux("send-keys", "-t", "t", "q")
    assert tmux.wait_exit() == 0
