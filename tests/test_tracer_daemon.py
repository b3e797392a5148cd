"""The daemon with its eBPF tracer: flows shaped as they open, classes gone within 1 s of the
close (any close: FIN, RST, exit), bursts of short flows leave nothing behind."""
import json
import socket
import struct
import subprocess
import time

import pytest

from harness.testbed import PY, in_netns, server_argv, wait_for

from harness.daemon import Daemon

pytestmark = pytest.mark.kernel

RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: burst
        match: {process: fp-burst-srv, direction: inbound}
        rate: 50mbit
      - name: held
        match: {process: fp-test-srv, direction: inbound}
        rate: 20mbit
"""


def flow_objects(tb):
    out = tb.run(tb.server_ns, ["tc", "filter", "show", "dev", tb.server_if]).stdout
    return sum("flowid" in line for line in out.splitlines())


@pytest.fixture
def daemon(testbed, tmp_path):
    # a long rescan period: what happens within it is the tracer's doing
    d = Daemon(testbed, tmp_path, RULES, "--rescan", "30")
    yield d
    d.stop()


def test_burst_of_short_flows_leaves_nothing(testbed, daemon):
    testbed.popen(testbed.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port",
                                      "7100", "--bytes", "20000"])
    testbed.wait_listening(7100)
    daemon.start()
    assert daemon.status()["flow_source"].startswith("tracer")
    r = testbed.run(testbed.client_ns, [PY, "-m", "harness.blaster", "churn", "--host",
                                        str(testbed.server_v6), "--port", "7100", "--rate", "400",
                                        "--seconds", "1"], timeout=60)
    t_end = time.monotonic()
    done = json.loads(r.stdout.splitlines()[-1])
    assert done["flows"] >= 350 and done["errors"] == 0
    wait_for(lambda: not daemon.flows() and flow_objects(testbed) == 0, 1.0, 0.02,
             "every class gone within 1 s")
    ev = daemon.status()["counters"]["events"]
    assert ev["tracer_open"] >= done["flows"] * 0.95 and ev["reconcile_close"] == 0
    assert time.monotonic() - t_end < 5


@pytest.mark.parametrize("how", ["fin", "rst", "exit"])
def test_class_goes_within_1s_of_any_close(testbed, daemon, how):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    daemon.start()
    if how == "exit":
        p = testbed.popen(testbed.client_ns, [PY, "-m", "harness.blaster", "fetch", "--host",
                                              str(testbed.server_v4), "--port", "9101", "--seconds", "30"])
        wait_for(lambda: daemon.flows(), 3, 0.02, "the flow shaped")
        p.kill()                                   # the client dies: its kernel resets the flow
        p.wait(timeout=10)
    else:
        with in_netns(testbed.client_ns):
            s = socket.create_connection((str(testbed.server_v4), 9101), timeout=5)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        s.recv(65536)
        wait_for(lambda: daemon.flows(), 3, 0.02, "the flow shaped")
        if how == "rst":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    t = time.monotonic()
    wait_for(lambda: not daemon.flows() and flow_objects(testbed) == 0, 1.0, 0.02,
             f"the class gone within 1 s of the {how}")
    assert time.monotonic() - t <= 1.0


def test_non_targets_cost_nothing_in_userspace(testbed, daemon):
    testbed.popen(testbed.server_ns, server_argv([9102], "fp-other-srv"))
    testbed.wait_listening(9102)
    daemon.start()
    before = daemon.status()["tracer"]
    r = testbed.run(testbed.client_ns, [PY, "-m", "harness.blaster", "fetch", "--host",
                                        str(testbed.server_v4), "--port", "9102", "--seconds", "1"])
    after = daemon.status()["tracer"]
    assert json.loads(r.stdout.splitlines()[-1])["bytes"] > 0
    assert after["events"] == before["events"]          # nothing reached userspace
    assert after["filtered"] > before["filtered"]       # the kernel saw and dropped it
    assert not daemon.flows()
