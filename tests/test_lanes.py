"""`make test`'s two lanes (harness/lanes.py): every test runs in exactly one of them, the VM
lane holds every test that boots the qemu VM, and the host lane yields the CPU to it."""
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
def test_every_test_runs_in_exactly_one_lane_and_the_vm_lane_boots_the_vm():
    host, vm = lanes.lanes()
    h, v = _collected(host.args), _collected(vm.args)
    every = _collected([sys.executable, "-m", "pytest"])
    assert h | v == every and not h & v
    files = {n.split("::", 1)[0] for n in v}
    assert {"tests/test_vm.py", "tests/test_server_vm.py", "tests/test_vm_signing.py"} <= files
    assert "tests/test_deb.py::test_unit_under_systemd_in_the_vm" in v
    assert not any(n.startswith("tests/test_vm.py") for n in h)


def test_the_host_lane_runs_niced_and_the_vm_lane_does_not():
    host, vm = lanes.lanes()
    assert host.args[:3] == ["nice", "-n", str(lanes.HOST_NICE)] and lanes.HOST_NICE > 0
    assert "nice" not in vm.args


def test_arguments_mean_one_plain_pytest(monkeypatch):
    calls = []
    monkeypatch.setattr(lanes.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 3)
    assert lanes.main(["tests/test_units.py", "-k", "rate"]) == 3
    assert calls[0][1:] == ["-m", "pytest", "-ra", "tests/test_units.py", "-k", "rate"]


def test_run_lanes_waits_for_both_and_fails_when_one_fails(monkeypatch, tmp_path, capsys):
    ok = [sys.executable, "-c", "print('1 passed in 0.01s')"]
    bad = [sys.executable, "-c",
           "print('=== short test summary info ===');print('FAILED tests/x.py::y');"
           "raise SystemExit(1)"]
    monkeypatch.setattr(lanes, "LOG_DIR", tmp_path)
    monkeypatch.setattr(lanes, "lanes", lambda: [
        lanes.Lane("host", ok, tmp_path / "host.log", echo=True),
        lanes.Lane("vm", bad, tmp_path / "vm.log", echo=False)])
    assert lanes.run_lanes() == 1
    out = capsys.readouterr().out
    assert "lane vm: FAILED (exit 1)" in out and "FAILED tests/x.py::y" in out
    assert "lane host: passed" in out
    assert (tmp_path / "vm.log").read_text().endswith("FAILED tests/x.py::y\n")
