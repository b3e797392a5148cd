"""Crash and churn (issue 7): nothing left behind, live flows shaped again, resources flat."""
import pytest

from harness.scenarios import churn_soak, crash_restart

pytestmark = [pytest.mark.kernel, pytest.mark.heavy]

RECOVERY_UNDER_LOAD_S = 6.0


def test_kill_9_and_restart_with_live_flows_and_churn(testbed):
    r = crash_restart(testbed)
    print(f"crash: {r['stale_classes_at_restart']} stale classes and "
          f"{r['spare_classes_at_restart']} without a filter at the restart, "
          f"{r['spare_classes_at_end']} spares at the end")
    assert r["stale_classes_at_restart"] >= 45          # the 50 flows that ended meanwhile
    # (550 flows: htb may keep closed flows' classes as spares, issue 26; whether any are
    # left at the end depends on the churn's timing, so only the leak check below counts)
    # converged, within a bound that a stuck start or a retry loop exceeds; the 2 s goal of
    # issue 7 is a speed target, bench/reliability.py's (quiet host: 0.7 s): make test runs this
    # beside the other lane's VMs and root builds, where CI measured 2.19 s (~3x slower)
    assert r["recovery_s_from_restart"] <= RECOVERY_UNDER_LOAD_S, r
    assert r["shaped_after_restart"] >= 500 and r["status_vs_kernel_mismatch"] <= 3
    assert r["leaked_after_stop"] == (0, 0)
    assert r["unmatched_goodput_bit_s"] > 200e6          # never throttled (link rate 1 Gbit)
    assert r["churn_client"]["errors"] == 0


def test_churn_soak_100k_cycles(testbed):
    r = churn_soak(testbed, cycles=100_000)
    print(f"churn soak: {r['cycles']} cycles, {r['spare_classes_end']} spare classes at the end")
    assert r["cycles"] >= 99_000 and r["errors"] == 0
    assert r["kernel_objects_end"] == r["kernel_objects_base"]
    assert r["fds_end"] <= r["fds_warm"] + 2
    assert r["rss_end_bytes"] <= r["rss_warm_bytes"] + 15 * 2**20, r["curve"]
