"""Restarts without a gap (issue 28 item 4).

With ``--keep-on-exit`` (the unit sets FLOWPACER_KEEP_ON_EXIT) SIGTERM leaves the qdisc, classes
and filters in the kernel; the next process adopts them before it removes anything, so a live
flow stays shaped across ``systemctl restart`` and a package upgrade. ``systemctl stop`` still
leaves nothing: the unit's ExecStopPost= runs ``flowpacer cleanup --all --after-stop %n``, which
removes everything unless the unit is being restarted (``flowpacer/surfaces/afterstop.py``).

Fast tests: the ExecStopPost= decision for every way a unit stops, the job lookup, the daemon's
shutdown with and without keep (in-process, fakes), the command line's refusals.
Kernel test (root, traffic): a real daemon shaping three long downloads (IPv4, IPv6, and IPv4
on a dual-stack socket: v4-mapped), SIGTERM with keep, a second daemon started: the receiver's
bytes, sampled in its namespace every 20 ms, never run faster than the rules allow in any
100 ms window across the gap; then ``cleanup --all --after-stop`` keeps for a failure and
removes everything for a stop.
"""
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from flowpacer.surfaces import afterstop
from flowpacer.surfaces.afterstop import decide, parse_jobs, unit_job
from flowpacer.surfaces.cli import main
from flowpacer.model import (BackendKind, Direction, Flow, FlowKey, FlowSource, Match,
                             ProcessInfo, Rule, RuleSet)
from harness.fakes import FakeFactory, FakeSockDiag, inprocess_daemon, mixed_key

RULES = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                (Rule("web", Match(process=("nginx",)), 5_000_000),))



key = mixed_key


def flow(k: FlowKey) -> Flow:
    return Flow(k, Direction.INBOUND, ProcessInfo(pid=100, comm="nginx"), FlowSource.TRACER,
                seen_ns=time.monotonic_ns())


def shaped(d):
    return set(d.supervisor.backend.installed())


# ------------------------------------------------------------------ the ExecStopPost= decision

OK = {"SERVICE_RESULT": "success", "EXIT_CODE": "exited", "EXIT_STATUS": "0"}
CRASH = {"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "1"}
BAD_RULES = {"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "2"}
WATCHDOG = {"SERVICE_RESULT": "watchdog", "EXIT_CODE": "killed", "EXIT_STATUS": "ABRT"}
STOP_TIMEOUT = {"SERVICE_RESULT": "timeout", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}


@pytest.mark.parametrize("job, env, remove", [
    ("restart", OK, False),            # systemctl restart, the postinst's restart on upgrade
    ("try-restart", OK, False),
    ("restart", CRASH, False),
    ("stop", OK, True),                # systemctl stop, apt remove, shutdown
    ("stop", STOP_TIMEOUT, True),      # killed after TimeoutStopSec: still a stop
    ("", OK, True),                    # exited 0 with no job: nothing starts it again
    ("", BAD_RULES, True),             # RestartPreventExitStatus=2: no restart follows
    ("start", BAD_RULES, True),        # a restart's start that met invalid rules
    ("", CRASH, False),                # Restart=on-failure: the next process adopts
    ("", WATCHDOG, False),
    ("start", CRASH, False),
    (None, OK, True),                  # systemctl cannot answer: the result decides
    (None, CRASH, False),
    (None, {}, True),                  # run by hand with no systemd environment
])
def test_after_stop_decision(job, env, remove):
    d = decide(job, env)
    assert d.remove is remove, d
    assert d.why


def test_list_jobs_lines_are_parsed_by_unit():
    out = ("  812 flowpacer.service restart running\n"
           "  813 nginx.service     start   waiting\n")
    assert parse_jobs(out, "flowpacer.service") == "restart"
    assert parse_jobs(out, "nginx.service") == "start"
    assert parse_jobs(out, "other.service") == ""
    assert parse_jobs("", "flowpacer.service") == ""
    assert parse_jobs("No jobs running.\n", "flowpacer.service") == ""


def test_job_lookup_says_none_when_systemctl_cannot_answer():
    def missing(*a, **kw):
        raise FileNotFoundError("systemctl")

    def failing(*a, **kw):
        return subprocess.CompletedProcess(a, 1, "", "System has not been booted with systemd")

    def answering(*a, **kw):
        return subprocess.CompletedProcess(a, 0, "5 flowpacer.service stop running\n", "")
    assert unit_job("flowpacer.service", run=missing) is None
    assert unit_job("flowpacer.service", run=failing) is None
    assert unit_job("flowpacer.service", run=answering) == "stop"


def test_cleanup_command_line_refusals_without_traceback():
    r = CliRunner().invoke(main, ["cleanup"])
    assert r.exit_code == 1 and "give --interface IF or --all" in r.output, r.output
    r = CliRunner().invoke(main, ["cleanup", "--all", "--interface", "eth0"])
    assert r.exit_code == 1 and "give --interface IF or --all" in r.output, r.output


def test_cleanup_after_stop_keeps_during_a_restart_without_touching_the_kernel(monkeypatch):
    # the restart case returns before any netlink socket is opened (so no root is needed)
    monkeypatch.setattr(afterstop, "unit_job", lambda unit: "restart")
    r = CliRunner().invoke(main, ["cleanup", "--all", "--after-stop", "flowpacer.service"])
    assert r.exit_code == 0, r.output
    assert "left in place" in r.output and "restart job" in r.output


# ------------------------------------------------------------------ the daemon's shutdown

def _run_and_stop(tmp_path, keep: bool):
    live = [flow(key(i, fam)) for i in range(2) for fam in (4, 6, "mapped")]
    sd = FakeSockDiag()
    sd.flows = {f.key: f for f in live}
    fac = FakeFactory()
    with inprocess_daemon(tmp_path, RULES, factory=fac, sockdiag=sd, tracer_enabled=False) as d:
        from harness.testbed import wait_for
        wait_for(lambda: shaped(d) == {f.key for f in live}, 5, what="flows shaped")
        d.opts.keep_on_exit = keep
    return fac.made[0], live


def test_shutdown_with_keep_leaves_every_class_for_the_next_process(tmp_path):
    b, live = _run_and_stop(tmp_path, keep=True)
    assert not b.torn_down and b.closed
    assert set(b.installed()) == {f.key for f in live}
    # the next process adopts exactly those (FakeFactory's first backend "finds" them)
    sd = FakeSockDiag()
    sd.flows = {f.key: f for f in live}
    fac = FakeFactory(installed=b.installed())
    with inprocess_daemon(tmp_path / "2", RULES, factory=fac, sockdiag=sd,
                          tracer_enabled=False) as d:
        assert shaped(d) == {f.key for f in live}
        assert not [o for o in d.supervisor.backend.applied if o.kind.value == "add"]


def test_shutdown_without_keep_removes_everything(tmp_path):
    b, _ = _run_and_stop(tmp_path, keep=False)
    assert b.torn_down and b.closed and not b.installed()


# ------------------------------------------------------------------ the kernel: a restart's gap

RATE_BIT = 16_000_000              # each flow's rule rate, bit/s
SERVE_RULES = f"""
    interface: IFACE
    backend: BACKEND
    link_rate: 1gbit
    rules:
      - name: dl
        match: {{process: fp-test-srv, direction: inbound}}
        rate: {RATE_BIT // 1_000_000}mbit
"""
WINDOW_S = 0.1
MARGIN = 1.25                      # at most 25 % over the rules' sum in any 100 ms window


class RxSampler:
    """The receiver's interface byte counter, read in its namespace every 20 ms (the kernel's
    count of what arrived, not the application's reads)."""

    def __init__(self, ns: str, dev: str):
        self.ns, self.dev = ns, dev
        self.samples = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.error = None

    def _read(self) -> int:
        with open("/proc/thread-self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == self.dev:
                    return int(rest.split()[0])
        raise RuntimeError(f"{self.dev} not in /proc/net/dev")

    def _run(self):
        from harness.testbed import in_netns
        try:
            with in_netns(self.ns):
                while not self._stop.is_set():
                    self.samples.append((time.monotonic(), self._read()))
                    self._stop.wait(0.02)
        except Exception as e:          # reported by stop()
            self.error = e

    def start(self):
        self._t.start()
        return self

    def stop(self):
        self._stop.set()
        self._t.join(5)
        if self.error:
            raise self.error

    def since(self, t: float) -> int:
        return sum(1 for ts, _ in self.samples if ts >= t)

    def windows(self, t_from: float, t_to: float):
        """(start, bit/s) of every window of at least WINDOW_S between two samples in
        [t_from, t_to]."""
        s = [x for x in self.samples if t_from <= x[0] <= t_to]
        out, j = [], 0
        for i, (ti, bi) in enumerate(s):
            j = max(j, i + 1)
            while j < len(s) and s[j][0] - ti < WINDOW_S:
                j += 1
            if j >= len(s):
                break
            tj, bj = s[j]
            out.append((ti, (bj - bi) * 8 / (tj - ti)))
        return out


def _objects(tb):
    from harness.capture import kernel_objects
    return kernel_objects(tb)


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["htb"])
def test_restart_keeps_every_live_flow_shaped_then_stop_leaves_nothing(root, tmp_path, backend):
    from harness.testbed import PY, Daemon, Testbed, client_argv, wait_for
    flows = [("v4", "ipv4", 9101), ("v6", "ipv6", 9104), ("v4", "ipv4-mapped", 9104)]
    seconds = 40.0                  # bounds the downloads; they are ended once measured
    with Testbed(tag="srv" + secrets.token_hex(2), subnet=28, gso=False) as tb:
        blaster = [PY, "-m", "harness.blaster", "serve", "--name", "fp-test-srv"]
        tb.popen(tb.server_ns, blaster + ["--ports", "9101"])
        tb.popen(tb.server_ns, blaster + ["--ports", "9104", "--v6"])
        tb.wait_listening(9101)
        tb.wait_listening(9104)
        opts = ("--rescan", "0.2", "--no-metrics", "--no-tracer", "--keep-on-exit")
        d1 = Daemon(tb, tmp_path, SERVE_RULES, *opts, backend=backend).start()
        rx = RxSampler(tb.client_ns, tb.client_if).start()
        clients = []
        for fam, _name, port in flows:
            host = str(tb.server_v6 if fam == "v6" else tb.server_v4)
            clients.append(tb.popen(tb.client_ns, client_argv(host, port, seconds, warmup=0.5)
                                    + ["--interval", "0.1"], stdout=subprocess.PIPE, text=True))
        try:
            wait_for(lambda: len(d1.flows()) == 3, 20, 0.05, "three flows shaped")
            t_shaped = time.monotonic()
            wait_for(lambda: rx.since(t_shaped + 0.5) >= 40, 20, 0.05, "a shaped second")
            before = _objects(tb)
            t_stop = time.monotonic()
            assert d1.stop() == 0
            t_exited = time.monotonic()
            left = _objects(tb)
            assert left == before and left[0] >= 3, (before, left)   # SIGTERM kept them all
            d2 = Daemon(tb, tmp_path, None, *opts, backend=backend, log_mode="a").start(wait=False)
            d2.wait_ready(90)
            t_ready = time.monotonic()
            assert len(d2.flows()) == 3
            assert "adopted flowpacer qdisc with 3 flow classes" in d2.log_text()
            wait_for(lambda: rx.since(t_ready + 0.2) >= 50, 20, 0.05, "a shaped second after")
            t_end = time.monotonic()
        finally:
            for c in clients:
                if c.poll() is None:
                    c.send_signal(signal.SIGTERM)
            outs = [c.communicate(timeout=30)[0] for c in clients]
            rx.stop()
        limit = 3 * RATE_BIT * MARGIN
        win = rx.windows(t_shaped + 0.5, t_end)
        peak_t, peak = max(win, key=lambda w: w[1])
        gap = [w for w in win if t_stop - 0.2 <= w[0] <= t_ready + 0.2]
        gap_peak = max(r for _, r in gap)
        report = (f"{backend}: peak {peak / 1e6:.1f} Mbit/s at {peak_t - t_stop:+.2f} s from "
                  f"SIGTERM; in the gap (SIGTERM {t_stop - t_stop:.2f}, exited "
                  f"{t_exited - t_stop:.2f}, second daemon ready {t_ready - t_stop:.2f} s) peak "
                  f"{gap_peak / 1e6:.1f} Mbit/s over {len(gap)} windows; limit "
                  f"{limit / 1e6:.1f} Mbit/s")
        print(report, file=sys.stderr)
        assert len(gap) >= 10, report
        assert peak <= limit, report
        import json
        for (fam, name, port), out in zip(flows, outs):
            res = json.loads(out.strip().splitlines()[-1])
            bps = res["goodput_bps"] * 8
            # each flow was shaped at its rule's rate the whole time, none starved
            assert 0.6 * RATE_BIT <= bps <= 1.1 * RATE_BIT, (name, bps, report)

        # stop semantics: a failure keeps the classes (systemd restarts it), a stop removes all
        assert d2.stop() == 0
        assert "qdisc htb f1f0:" in tb.qdisc_show() or "qdisc psp f1f0:" in tb.qdisc_show()
        # a unit with no job (whether or not systemctl answers here): the result decides
        cleanup = ["ip", "netns", "exec", tb.server_ns, PY, "-m", "flowpacer", "cleanup", "--all",
                   "--after-stop", f"fp-{tb.tag}-none.service"]
        failed = subprocess.run(cleanup, capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, **CRASH))
        assert failed.returncode == 0 and "left in place" in failed.stdout, failed
        assert "f1f0:" in tb.qdisc_show()
        stopped = subprocess.run(cleanup, capture_output=True, text=True, timeout=60,
                                 env=dict(os.environ, **OK))
        assert stopped.returncode == 0, stopped
        assert f"{tb.server_if}: flowpacer qdisc removed" in stopped.stdout, stopped.stdout
        assert _objects(tb) == (0, 0)
        assert "f1f0:" not in tb.qdisc_show()
