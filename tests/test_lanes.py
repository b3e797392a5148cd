"""`make test`'s two lanes (harness/lanes.py): every test file runs in exactly one of them, and
the VM lane holds the files whose tests are all VM tests."""
import re
from pathlib import Path

from harness import lanes

TESTS = Path(lanes.REPO) / "tests"


def _files_of(lane: lanes.Lane):
    args = lane.args[lane.args.index("pytest") + 1:]
    ignored = {args[i + 1] for i, a in enumerate(args) if a == "--ignore"}
    named = [a for a in args if a.startswith("tests/")]
    named = [a for a in named if a not in ignored]
    every = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py"))
    return set(named) if named else set(every) - ignored


def test_every_test_file_runs_in_exactly_one_lane():
    host, vm = lanes.lanes()
    every = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")}
    assert _files_of(host) | _files_of(vm) == every
    assert not _files_of(host) & _files_of(vm)
    assert _files_of(vm) == set(lanes.VM_FILES)


def test_the_vm_lane_holds_the_files_marked_vm_as_a_whole():
    """A file marked vm at module level belongs in the VM lane; one that marks a single case
    (test_deb's systemd unit in the VM) stays with the host lane on purpose."""
    whole = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")
             if re.search(r"^pytestmark = .*pytest\.mark\.vm", p.read_text(), re.M)}
    assert whole == set(lanes.VM_FILES)


def test_arguments_mean_one_plain_pytest(monkeypatch):
    calls = []
    monkeypatch.setattr(lanes.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 3)
    assert lanes.main(["tests/test_units.py", "-k", "rate"]) == 3
    assert calls[0][1:] == ["-m", "pytest", "-ra", "tests/test_units.py", "-k", "rate"]


def test_run_lanes_waits_for_both_and_fails_when_one_fails(monkeypatch, tmp_path, capsys):
    import sys
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
