"""`make test`'s two lanes (harness/lanes.py): every test runs in exactly one of them, the tests
measured on the wall clock stay in the timed lane, and the untimed lane yields the CPU."""
import os
import subprocess
import sys

import pytest

from harness import lanes


def _collected(args):
    """The node ids a lane's pytest arguments select (collection only, nothing runs)."""
    i = args.index("pytest")
    extra = [a for a in args[i + 1:] if a != "-ra" and not a.startswith("--durations")]
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *extra], cwd=lanes.REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {line for line in p.stdout.splitlines() if "::" in line}


@pytest.mark.slow          # three collections of the whole suite: ~15 s each
@pytest.mark.untimed       # and nothing measured on the wall clock
def test_every_test_runs_in_exactly_one_lane_and_wall_clock_tests_stay_timed():
    timed, untimed = lanes.lanes()
    t, u = _collected(timed.args), _collected(untimed.args)
    every = _collected([sys.executable, "-m", "pytest"])
    assert t | u == every and not t & u
    # the guest's virtual clock apart from its real one (psp and the daemon on 6.1 and 7.3)
    assert any(n.startswith("tests/test_vm.py::test_guest[") and "test_psp_pacing" in n for n in u)
    assert not any("test_psp_pacing" in n for n in t)
    # the daemon's timers' tests wait, which costs no host time in virtual time
    assert any("test_guest[" in n and "test_psp_udp_daemon" in n for n in u)
    assert any("test_guest[" in n and "test_psp_daemon" in n for n in t)
    assert any(n.startswith("tests/test_vm.py::test_guest_on_kernel[7.3") for n in t)
    assert "tests/test_vm.py::test_guest_run_clean[real]" in t
    assert "tests/test_vm.py::test_guest_run_clean[virtual]" in u
    # a real-clock guest measuring a rate: timed; the packages' chroots and the server VM
    # (systemd, its restarts, crashes and watchdog; loose rates): untimed
    assert "tests/test_vm_signing.py::test_unsigned_module_refused_auto_falls_back_to_htb" in t
    assert "tests/test_deb.py::test_make_deb_builds_both_packages_lintian_clean" in u
    assert {n.split("::")[0] for n in u} >= {"tests/test_debian13.py", "tests/test_server_vm.py"}


def test_the_untimed_lane_runs_niced_and_the_timed_lane_does_not():
    timed, untimed = lanes.lanes()
    assert untimed.args[:3] == ["nice", "-n", str(lanes.UNTIMED_NICE)] and lanes.UNTIMED_NICE > 0
    assert untimed.group_nice == lanes.UNTIMED_GROUP_NICE and timed.group_nice == 0
    assert "nice" not in timed.args


WHERE = "import os; print(open('/proc/self/autogroup').read().strip(), os.getsid(0), flush=True)"
# the untimed lane's command: a child in a process group of its own, as vm/run.py and
# harness/servervm.py start qemu, saying where it runs
CHILD = ("import subprocess, sys\n"
         "subprocess.run([sys.executable, '-c', sys.argv[1]], process_group=0, check=True)\n")


def test_a_lanes_group_nice_covers_the_children_it_starts_as_qemu_is(monkeypatch, tmp_path, capsys):
    """Each lane is a session, so a scheduler autogroup, of its own; a lane's ``group_nice``
    (the untimed lane's: UNTIMED_GROUP_NICE, 0 since session 14, see there) is that group's,
    so the whole lane weighs as one process at that nice, and a child it starts the way
    vm/run.py starts qemu stays in the group. Here with 5, the nice session 14 tried. (The
    shares themselves are the scheduler's, measured in that session's note, not here: a test
    on CPU shares fails on a busy host.)"""
    monkeypatch.setattr(lanes, "LOG_DIR", tmp_path)
    timed = lanes.Lane("timed", [sys.executable, "-c", WHERE], tmp_path / "timed.log", echo=False)
    untimed = lanes.Lane("untimed", ["nice", "-n", str(lanes.UNTIMED_NICE), sys.executable, "-c",
                                     CHILD, WHERE], tmp_path / "untimed.log", echo=False,
                         group_nice=5)
    monkeypatch.setattr(lanes, "lanes", lambda: [timed, untimed])
    assert lanes.run_lanes() == 0
    capsys.readouterr()
    got = {lane.name: lane.log.read_text().split() for lane in (timed, untimed)}
    t_group, t_nice, t_sid = got["timed"][0], got["timed"][2], got["timed"][3]
    u_group, u_nice, u_sid = got["untimed"][0], got["untimed"][2], got["untimed"][3]
    assert t_nice == "0" and u_nice == "5", got
    assert t_group != u_group and t_sid != u_sid, got
    assert u_sid != str(os.getsid(0)), got          # not make's session either


def test_arguments_mean_one_plain_pytest(monkeypatch):
    calls = []
    monkeypatch.setattr(lanes.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 3)
    assert lanes.main(["tests/test_units.py", "-k", "rate"]) == 3
    assert calls[0][1:] == ["-m", "pytest", "-ra", "tests/test_units.py", "-k", "rate"]


def test_run_lanes_waits_for_both_and_fails_when_one_fails(monkeypatch, tmp_path, capsys):
    ok = [sys.executable, "-c", "import time; time.sleep(1.5); print('1 passed in 1.5s')"]
    bad = [sys.executable, "-c",
           "print('=== short test summary info ===');print('FAILED tests/x.py::y');"
           "raise SystemExit(1)"]
    monkeypatch.setattr(lanes, "LOG_DIR", tmp_path)
    timed = lanes.Lane("timed", ok, tmp_path / "timed.log", echo=True)
    untimed = lanes.Lane("untimed", bad, tmp_path / "untimed.log", echo=False)
    monkeypatch.setattr(lanes, "lanes", lambda: [timed, untimed])
    assert lanes.run_lanes() == 1
    out = capsys.readouterr().out
    assert "lane untimed: FAILED (exit 1)" in out and "FAILED tests/x.py::y" in out
    assert "lane timed: passed" in out
    assert (tmp_path / "untimed.log").read_text().endswith("FAILED tests/x.py::y\n")
    # each lane's time is its own: the failing one ended first, not when the other's wait returned
    assert untimed.seconds < timed.seconds and timed.seconds >= 1.5


def test_each_lane_starts_with_its_guest_phase_and_the_untimed_heavy_work_waits_for_the_real_guests(
        tmp_path, monkeypatch):
    """The timed lane starts with its real-clock guests, the untimed lane with its virtual-clock
    guest, side by side; the untimed lane's heavy work (the server VM first, the Debian roots)
    waits for vm.apart until the timed lane's guest phase is over, and holds it to its end."""
    import threading
    from harness import vm
    timed, untimed = lanes.lanes()
    tfiles = [a for a in timed.args if a.startswith("tests/")]
    ufiles = [a for a in untimed.args if a.startswith("tests/")]
    assert tfiles[:2] == ["tests/test_vm.py", "tests/test_vm_signing.py"]
    assert ufiles[:2] == ["tests/test_vm.py", "tests/test_server_vm.py"]
    assert len(tfiles) == len(set(tfiles)) == len(ufiles) == len(set(ufiles))
    monkeypatch.setattr(vm, "APART_LOCK", str(tmp_path / "apart.lock"))
    t_phase, u_phase = lanes.GuestPhase(lanes.TIMED), lanes.GuestPhase(lanes.UNTIMED)
    t_phase.start()                                   # the timed lane's session start
    u_phase.start()                                   # takes nothing: its virtual guest runs now
    steps = []

    def untimed_lane():
        u_phase.before("tests/test_vm.py::test_guest[test_psp_pacing.py::test_a]")
        steps.append("virtual guest")
        u_phase.before("tests/test_server_vm.py::test_debian13_server")    # waits for the lock
        steps.append("server VM")
    u = threading.Thread(target=untimed_lane)
    u.start()
    for nodeid in ("tests/test_vm.py::test_guest[test_psp_daemon.py::test_x]",
                   "tests/test_vm.py::test_guest_on_kernel[7.3:test_psp_module.py::test_y]",
                   "tests/test_vm_signing.py::test_unsigned"):
        t_phase.before(nodeid)                        # still the timed guest phase: still held
    u.join(0.5)
    assert steps == ["virtual guest"]                 # the server VM waits for the real guests
    t_phase.before("tests/test_aggregates.py::test_z")     # the host tests: released
    u.join(5)
    assert steps == ["virtual guest", "server VM"]
    # and the untimed lane holds it to its end: a real-clock guest started now would wait
    other = lanes.GuestPhase(lanes.TIMED)
    got = threading.Event()
    threading.Thread(target=lambda: (other.start(), got.set(), other.finish()), daemon=True).start()
    assert not got.wait(0.5)
    u_phase.before("tests/test_deb.py::test_roots")
    u_phase.finish()
    assert got.wait(5)
    # outside make test's lanes nothing is held
    none = lanes.GuestPhase(None)
    none.start()
    none.before("tests/test_daemon.py::x")
    assert none._held is None
