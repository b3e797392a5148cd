"""Issue 7 with the psp backend, inside the VM where sch_psp can be loaded and unloaded.

1. kill -9 of the daemon while target flows are live and others churn, then a restart
   (``harness.scenarios.crash_restart``, the host test's scenario with ``backend: psp``).
2. The psp module going away under the running daemon: ``rmmod`` refused while our qdisc
   exists; then an admin deletes the root qdisc and unloads the module: counted, logged once,
   retried quietly, healed when the module is back (``backend: psp``), or a fall-back to htb
   (``backend: auto``).

The daemon runs with ``--no-tracer`` (sock_diag rescans): bcc's compile is too slow under TCG.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from harness import psplib
from flowpacer.surfaces.control import call
from harness.capture import NlProbe
from harness.scenarios import crash_restart, daemon
from harness.testbed import PY, in_netns, wait_for
from harness.psplib import PspNl

# TCG runs ~10x slower than the host; the numbers it carries (measured, see docs/reliability.md)
HELD = int(os.environ.get("FLOWPACER_REL_HELD", "500"))
CHURN = float(os.environ.get("FLOWPACER_REL_CHURN", "100"))
HOST_LIMIT_S = 2.0              # issue 7: live flows shaped again within 2 s of the restart


# net.core.rmem_max at 4 MiB (the host machines' value, as the daemon tests use); ``tb`` (the
# testbed with sch_psp loaded, and loaded again after the test) is in conftest.py
pytestmark = pytest.mark.usefixtures("big_rmem")


def _root(tb):
    with PspNl(tb.server_ns) as sock:
        return sock.root(tb.server_if)


def _qdisc(tb) -> str:
    return tb.run(tb.server_ns, ["tc", "qdisc", "show", "dev", tb.server_if]).stdout


# ---------------------------------------------------------------------- 1. crash and restart

def _import_s(runs: int = 3) -> float:
    """Seconds this VM takes to import the daemon (best of ``runs``)."""
    best = float("inf")
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run([PY, "-c", "import flowpacer.daemon.app"], check=True, timeout=120)
        best = min(best, time.monotonic() - t)
    return best


def _slowdown(vm_import_s: float) -> float:
    """How many times slower this VM runs the daemon's Python than the host: the same import,
    timed on the host by tests/test_vm.py (FLOWPACER_HOST_IMPORT_S) and here."""
    host = os.environ.get("FLOWPACER_HOST_IMPORT_S")
    if not host:
        pytest.fail("FLOWPACER_HOST_IMPORT_S is not set: run this through tests/test_vm.py")
    return vm_import_s / float(host)


def test_kill_9_and_restart_with_live_flows_and_churn_psp(tb):
    """The host test's scenario (tests/test_reliability.py) with ``backend: psp``. The limit is
    the issue's 2 s scaled by how much slower this VM runs the daemon's code than the host:
    the same interpreter start and import, timed on the host (idle, as the host test's daemon
    starts) and here under the load the restart meets (held flows, churn, the unmatched
    download and the first daemon running, just before the kill). Everything the daemon does
    is CPU-bound Python here, so that is the host's 2 s in this machine's time. The idle
    import is recorded too: in one CI run it was 2.6 s and the restart under load took 24.7 s,
    9.6 times as long, where on a quiet host the two were 4.7 s and 13.9 s; an idle figure
    does not say how slow the loaded guest is."""
    doomed = max(5, HELD // 10)
    idle = _import_s(runs=1)       # recorded only (13 s a run under TCG: the case's time)
    probe = NlProbe(tb)
    try:
        r = crash_restart(tb, held=HELD, churn_rate=CHURN, backend="psp", extra=["--no-tracer"],
                          doomed_n=doomed, unmatched_s=600.0, churn_s=50.0, slow=4.0, probe=probe,
                          poll_s=0.05, under_load=lambda: _import_s(runs=1))
    finally:
        probe.close()
    imp = r["under_load"]
    slow = _slowdown(imp)
    limit = HOST_LIMIT_S * slow
    psplib.record(
        f"psp crash/restart (VM): {r['held_flows']} live target flows + {r['churn_flows_per_s']:g} "
        f"flows/s churn ({r['churn_client']['rate']:.0f}/s achieved, {r['churn_client']['errors']} "
        f"errors); {r['stale_classes_at_restart']} stale classes at restart; live flows shaped "
        f"and stale gone {r['recovery_s_from_restart']:.2f} s after the process start "
        f"(down {r['down_s']:.1f} s); status vs kernel mismatch {r['status_vs_kernel_mismatch']}; "
        f"unmatched download {r['unmatched_goodput_bit_s'] / 1e6:.1f} Mbit/s overall, "
        f"{(r['unmatched_gap_goodput_bit_s'] or 0) / 1e6:.1f} Mbit/s from the kill to convergence "
        f"({r['unmatched_gap_window_s']:.1f} s window); left after SIGTERM {r['leaked_after_stop']}; "
        f"importing the daemon takes {imp:.2f} s in this VM under that load ({idle:.2f} s idle), "
        f"{slow:.1f}x the host's: {r['recovery_s_from_restart'] / slow:.2f} s in host time "
        f"(limit {limit:.1f} s here)")
    assert r["stale_classes_at_restart"] >= doomed - 3, r     # the flows that ended meanwhile
    assert r["recovery_s_from_restart"] <= limit, (limit, r)
    assert r["shaped_after_restart"] >= HELD and r["status_vs_kernel_mismatch"] <= 3, r
    assert r["leaked_after_stop"] == (0, 0), r
    assert _root(tb) is None, "SIGTERM left the psp qdisc behind"
    # never throttled: far above every rule (1 and 5 Mbit) while no daemon ran
    assert r["unmatched_gap_goodput_bit_s"] is not None, r
    assert r["unmatched_gap_goodput_bit_s"] > 50e6, r
    assert r["churn_client"]["errors"] == 0, r


# --------------------------------------------------------------- 2. the module goes away

HELD_B = 20
METRICS = "127.0.0.1:9717"


def _daemon_with_held_flows(tb, backend):
    """The daemon (``backend``) shaping HELD_B idle held flows; (daemon, holder, probe)."""
    blaster = [PY, "-m", "harness.blaster"]
    tb.popen(tb.server_ns, blaster + ["hold-serve", "--port", "7000"])
    tb.wait_listening(7000, timeout=30)
    d = daemon(tb, tempfile.mkdtemp(prefix="fp-rmmod-"), ["--no-tracer", "--metrics", METRICS, "-v"],
               backend)
    d.wait_ready(timeout=120)
    holder = tb.popen(tb.client_ns, blaster + ["hold-connect", "--host", str(tb.server_v4),
                                               "--port", "7000", "--count", str(HELD_B),
                                               "--seconds", "400"],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    probe = NlProbe(tb)
    wait_for(lambda: (d.try_status() or {}).get("shaped_flows") == HELD_B
             and probe.objects() == (HELD_B, HELD_B), 60, 0.1, "the held flows shaped")
    return d, holder, probe


@contextlib.contextmanager
def _held_flows_daemon(tb, backend):
    """``_daemon_with_held_flows`` for a ``with`` block: after the block the held flows are
    closed and their classes must go; the daemon is stopped in any case, and must then have
    exited 0 and left no qdisc of ours."""
    d, holder, probe = _daemon_with_held_flows(tb, backend)
    try:
        yield d, probe
        holder.stdin.close()
        wait_for(lambda: probe.objects() == (0, 0), 60, 0.2, "the closed flows' classes gone")
    finally:
        probe.close()
        d.stop()
    assert d.proc.returncode == 0, _log(d)[-3000:]
    assert "f1f0:" not in _qdisc(tb)


def _delete_qdisc_and_unload(tb, d):
    """What an admin does: ``tc qdisc del dev X root; rmmod sch_psp``. The daemon is stopped
    for the two commands so that it cannot rebuild in between (which would make rmmod busy)."""
    pid = d.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        tb.run(tb.server_ns, ["tc", "qdisc", "del", "dev", tb.server_if, "root"])
        psplib.unload(timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not psplib.loaded()


def _scrape(tb) -> str:
    with in_netns(tb.server_ns):
        return urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=30).read().decode()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in the metrics"
    return float(m.group(1))


def _log(d) -> str:
    return Path(d.log).read_text()


def test_rmmod_under_the_daemon_psp_counted_quiet_and_healed(tb):
    """backend: psp. rmmod is refused while the daemon's qdisc exists (nothing changes); after
    an admin deletes the qdisc and unloads the module: one warning with the kernel's reason,
    quiet retries counted in status and metrics, flows stay known; insmod: shaped again."""
    with _held_flows_daemon(tb, "psp") as (d, probe):
        busy = subprocess.run(["rmmod", psplib.MODULE], capture_output=True, text=True, timeout=60)
        assert busy.returncode != 0 and psplib.loaded(), busy
        psplib.record(f"psp unload (VM): rmmod with the daemon's qdisc in place: exit "
                      f"{busy.returncode}: {busy.stderr.strip()}")
        st = d.status()
        assert st["backend_state"] == "ok" and st["shaped_flows"] == HELD_B, st
        assert probe.objects() == (HELD_B, HELD_B) and d.proc.poll() is None

        _delete_qdisc_and_unload(tb, d)
        st = wait_for(lambda: (lambda s: s if s and s["counters"]["backend_rebuild_failures"] >= 6
                               else None)(d.try_status()), 120, 0.2, "six failed rebuilds")
        assert st["backend"] == "psp" and st["backend_state"] == "lost", st
        assert "create root psp qdisc" in st["backend_problem"], st
        assert st["live_flows"] == HELD_B and st["shaped_flows"] == 0, st
        assert d.proc.poll() is None, "the daemon died"
        log = _log(d)
        warned = [ln for ln in log.splitlines() if "cannot rebuild" in ln]
        assert len(warned) == 1, warned
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        psplib.record(f"psp unload (VM): after tc qdisc del + rmmod, {st['counters']['backend_rebuild_failures']} "
                      f"failed rebuilds, one log line: {warned[0].split(': ', 1)[1]}")
        text = _scrape(tb)
        assert _metric(text, f'flowpacer_backend_rebuild_failures_total{{interface="{tb.server_if}"}}') >= 6
        assert _metric(text, f'flowpacer_backend_state{{interface="{tb.server_if}",state="lost"}}') == 1
        out = tb.run(tb.server_ns, [PY, "-m", "flowpacer", "status", "--socket", d.sock],
                     timeout=120).stdout
        assert "state:     lost (cannot rebuild" in out, out

        psplib.load()
        wait_for(lambda: (lambda s: s and s["backend_state"] == "ok"
                          and s["shaped_flows"] == HELD_B)(d.try_status()), 60, 0.2,
                 "the qdisc rebuilt and the flows shaped again")
        assert probe.objects() == (HELD_B, HELD_B)
        assert _root(tb) is not None
        assert "rebuilt after" in _log(d) and len([ln for ln in _log(d).splitlines()
                                                   if "cannot rebuild" in ln]) == 1
    assert "Traceback" not in _log(d)


def test_rmmod_under_the_daemon_auto_falls_back_to_htb_and_reload_returns(tb):
    """backend: auto. psp lost and its module gone: htb takes over at the next pass (every live
    flow shaped again, the reason in status); psp comes back only at a reload (or restart)."""
    with _held_flows_daemon(tb, "auto") as (d, probe):
        assert d.status()["backend"] == "psp"
        _delete_qdisc_and_unload(tb, d)
        st = wait_for(lambda: (lambda s: s if s and s["backend"] == "htb"
                               and s["shaped_flows"] == HELD_B else None)(d.try_status()), 120, 0.2,
                      "htb shaping the flows")
        assert st["backend_state"] == "ok", st
        assert st["backend_reason"].startswith("auto: psp unavailable since it was lost"), st
        assert st["counters"]["backend_rebuild_failures"] == 1, st
        assert probe.objects() == (HELD_B, HELD_B)
        assert "qdisc htb f1f0:" in _qdisc(tb)
        assert d.proc.poll() is None and "Traceback" not in _log(d)
        psplib.record(f"psp unload (VM), backend auto: fell back to htb, {st['shaped_flows']} "
                      f"flows shaped again: {st['backend_reason']}")
        # the module is back: nothing changes until a reload
        psplib.load()
        st = d.status()
        assert st["backend"] == "htb" and st["counters"]["backend_rebuild_failures"] == 1, st
        r = call(d.sock, {"cmd": "reload"}, timeout=120)
        assert r["ok"] and r["switched_backend"], r
        st = d.status()
        assert st["backend"] == "psp" and st["shaped_flows"] == HELD_B, st
        assert st["backend_reason"] == "auto: sch_psp module is loaded", st
        assert _root(tb) is not None and probe.objects() == (HELD_B, HELD_B)
