"""`make check` and its markers: a test that needs root is marked by its fixtures when collected,
and in check mode (FLOWPACER_CHECK=1, harness/checkmode.py) whatever needs root or the VM fails
with the marker the test lacks, in the test's process and in its children."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import checkmode

ROOT = Path(__file__).resolve().parent.parent


def in_check_mode(code: str, tmp: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python with the guard installed (it patches the process for good,
    so never in pytest's own); its temporary files (the PATH scripts) go to ``tmp``."""
    prog = "from harness import checkmode\nbindir = checkmode.install()\n" + code
    env = {**os.environ, checkmode.ENV: "1", "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("argv,marker", [
    (["ip", "netns", "add", "x"], "kernel"), (["/usr/sbin/ip", "-n", "x", "link"], "kernel"),
    ("ip netns exec x true", "kernel"), (["unshare", "--net", "true"], "kernel"),
    (["nsenter", "-t", "1", "-n"], "kernel"), (["qemu-system-x86_64", "-m", "512"], "vm"),
    (["mmdebstrap", "bookworm"], "deb"), (["modprobe", "veth"], "kernel"),
])
def test_refused_commands_name_their_marker(argv, marker):
    what, mark = checkmode.refused_argv(argv)
    assert mark == marker
    assert f"mark this test {marker}" in checkmode.message(what, mark)


@pytest.mark.parametrize("argv", [["ip", "-j", "link", "show"], ["ip", "-V"], ["gcc", "-v"],
                                  "tmux -V", [], [b"python3", b"-c", b"1"]])
def test_harmless_commands_pass(argv):
    assert checkmode.refused_argv(argv) is None


@pytest.mark.parametrize("code,marker", [
    ("from harness.testbed import Testbed\nwith Testbed(): pass", "kernel"),
    ("from harness.testbed import Testbed\nTestbed().create()", "kernel"),
    ("import subprocess\nsubprocess.run(['ip', 'netns', 'add', 'fp-check-never'])", "kernel"),
    ("from pyroute2 import NetNS\nNetNS('fp-check-never')", "kernel"),
    ("from harness import vm\nvm.run(['true'])", "vm"),
    ("import tempfile\nfrom harness.daemon import Daemon\nfrom harness.testbed import Testbed\n"
     "Daemon(Testbed(), tempfile.mkdtemp(), 'rules: []').start()", "kernel"),
])
def test_in_process_attempts_fail_with_the_marker(code, marker, tmp_path):
    r = in_check_mode(code, tmp_path)
    assert r.returncode != 0
    assert f"mark this test {marker}" in r.stderr, r.stderr[-2000:]


def test_netlink_in_the_own_namespace_still_works(tmp_path):
    """Reading links over rtnetlink needs no root and no namespace: not refused."""
    r = in_check_mode("from pyroute2 import IPRoute\n"
                      "with IPRoute() as ip:\n"
                      "    print(sorted(link.get('ifname') for link in ip.get_links()))\n", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'lo'" in r.stdout


def test_bcc_compile_fails_with_the_marker(tmp_path):
    pytest.importorskip("bcc", reason="bcc (python3-bpfcc) is not installed: nothing to guard")
    r = in_check_mode("import bcc\nbcc.BPF(text='int f(void *c) { return 0; }')", tmp_path)
    assert r.returncode != 0 and "mark this test kernel" in r.stderr, r.stderr[-2000:]


def test_child_processes_meet_the_same_refusal_and_ip_still_reads(tmp_path):
    """A shell (or a daemon) started by the test finds the refusing scripts first in PATH;
    `ip` without a namespace argument is the real one."""
    r = in_check_mode(
        "import subprocess, sys\n"
        "a = subprocess.run(['sh', '-c', 'ip netns add fp-check-never'], capture_output=True, text=True)\n"
        "b = subprocess.run(['sh', '-c', 'qemu-system-x86_64 -version'], capture_output=True, text=True)\n"
        "c = subprocess.run(['sh', '-c', 'ip -V'], capture_output=True, text=True)\n"
        "print(a.returncode, b.returncode, c.returncode)\n"
        "sys.stderr.write(a.stderr + b.stderr)\n"
        "print(c.stdout.strip())\n"
        "checkmode.uninstall_shims(bindir)\n", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    codes, version = r.stdout.splitlines()[:2]
    assert codes.split()[:2] == ["126", "126"], r.stdout
    assert "mark this test kernel" in r.stderr and "mark this test vm" in r.stderr
    if codes.split()[2] == "0":                # iproute2 installed: the real one answered
        assert "iproute2" in version or "ip utility" in version, version
    assert not os.path.exists("/run/netns/fp-check-never")


def test_fixtures_that_need_root_mark_their_tests_kernel():
    """Collected with `-m "not kernel"`, a file's tests that use the testbed fixture are left
    out although the file itself carries no marker."""
    def collected(markexpr):
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", markexpr,
                            "tests/test_xmitstamp.py"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        return sorted(ln.split("::")[1] for ln in r.stdout.splitlines() if "::" in ln)
    unmarked, kernel = collected("not kernel"), collected("kernel")
    assert "test_object_cached_by_source_hash" in unmarked
    assert {"test_records_exactly_the_datagrams_sent", "test_errors_are_one_line"} <= set(kernel)
    assert not set(unmarked) & set(kernel)


def test_an_unmarked_test_over_the_limit_fails_and_names_the_slow_marker(tmp_path):
    """The fast subset stays fast: a test that runs longer than checkmode.SLOW_LIMIT_S without
    the slow marker fails in check mode (the limit lowered here to 0.3 s)."""
    f = tmp_path / "test_timing.py"
    f.write_text("import time, pytest\n"
                 "def test_long():\n    time.sleep(0.6)\n"
                 "@pytest.mark.slow\ndef test_long_marked():\n    time.sleep(0.6)\n"
                 "def test_short():\n    pass\n")
    env = {**os.environ, "FLOWPACER_CHECK": "1", "FLOWPACER_CHECK_SLOW_S": "0.3"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "tests.conftest", str(f)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "1 failed, 2 passed" in out, out
    assert "test_long " in out.split("short test summary")[-1] or "::test_long" in out, out
    assert "mark it slow" in out, out
