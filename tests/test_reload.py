"""Live reload under traffic: the new rate shows in the flow's measured rate within 2 s, the flow
keeps its class and queue (no drops from the reload)."""
import json
import subprocess
import time

import pytest

from flowpacer.surfaces.control import call
from harness.daemon import RULES, Daemon
from harness.testbed import PY, server_argv, wait_for
from harness.traffic import WIRE

pytestmark = pytest.mark.kernel


def rate_between(samples, t0, a, b):
    """Goodput (bytes/s) between absolute monotonic times a and b from (t, bytes) samples."""
    pts = [(t0 + t, n) for t, n in samples]
    lo = min(pts, key=lambda p: abs(p[0] - a))
    hi = min(pts, key=lambda p: abs(p[0] - b))
    return (hi[1] - lo[1]) / (hi[0] - lo[0])


@pytest.mark.parametrize("old,new", [(10, 30), (30, 10)])
def test_reload_rerates_live_flow_within_2s_without_drops(testbed, tmp_path, old, new):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES.replace("rate: 10mbit", f"rate: {old}mbit")).start()
    try:
        c = testbed.popen(testbed.client_ns, [PY, "-m", "harness.blaster", "fetch", "--host",
                                              str(testbed.server_v4), "--port", "9101", "--seconds",
                                              "9", "--warmup", "0", "--interval", "0.1"],
                          stdout=subprocess.PIPE, text=True)
        # its class once its handshake's claim is handled (CI of f3f0d43: the tracer's event
        # made :10 first, the claim then rebound the flow to its pool class)
        f = wait_for(d.settled_flows, 5, 0.05, "the flow, its first-byte claim handled")[0]
        t_flow = time.monotonic()
        wait_for(lambda: time.monotonic() - t_flow > 3.5, 5, 0.05, "a steady rate")  # let it settle
        drops_before = d.flows()[0]["drops"]
        d.rules.write_text(d.rules.read_text().replace(f"rate: {old}mbit", f"rate: {new}mbit"))
        r = call(d.sock, {"cmd": "reload"})
        t_reload = time.monotonic()
        assert r["ok"] and r["changed"] == 1 and r["added"] == 0 and r["removed"] == 0
        g = d.flows()[0]
        assert g["classid"] == f["classid"] and g["rate_bit"] == new * 10**6
        wait_for(lambda: time.monotonic() - t_reload > 3.5, 5, 0.05, "the new rate to settle")
        drops_after = d.flows()[0]["drops"]
        assert drops_after == drops_before == 0        # same queue, nothing thrown away
        res = json.loads(c.communicate(timeout=60)[0].splitlines()[-1])
        before = rate_between(res["samples"], res["t0_monotonic"], t_reload - 2.5, t_reload - 0.5)
        after = rate_between(res["samples"], res["t0_monotonic"], t_reload + 2.0, t_reload + 3.5)
        assert before == pytest.approx(old * 1e6 / 8 * WIRE, rel=0.05)
        assert after == pytest.approx(new * 1e6 / 8 * WIRE, rel=0.05)
        assert d.status()["counters"]["reloads_ok"] == 1
    finally:
        d.stop()
