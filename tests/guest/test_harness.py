"""The VM itself: the guest environment the other guest tests rely on."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import kmsg
from harness.pacing import Testbed, sh, wait_for

REPO = Path(__file__).resolve().parents[2]


def test_guest_environment():
    assert os.environ.get("FLOWPACER_IN_VM") == "1"
    assert os.geteuid() == 0
    # the kernel series the host asked for (vm/build.py: FLOWPACER_VM_KERNEL, default 6.1)
    series = os.environ.get("FLOWPACER_VM_KERNEL", "6.1")
    if "/" not in series:
        assert re.match(re.escape(series) + r"\.\d", os.uname().release), os.uname().release
    assert Path.cwd() == REPO  # the repo is at the same path as on the host
    moddir = Path("/lib/modules") / os.uname().release
    assert (moddir / "modules.dep").is_file()
    for d in ("/tmp", "/run", str(REPO)):  # writable (the root is a tmpfs overlay)
        probe = Path(d) / f".fp-probe-{os.getpid()}"
        probe.write_text("x")
        probe.unlink()
    lo = sh(["ip", "-o", "link", "show", "lo"]).stdout
    assert "UP" in lo and "LOWER_UP" in lo
    out = Path(os.environ["FLOWPACER_VM_OUT"])
    assert out.is_dir() and os.access(out, os.W_OK)


def test_netns_usable():
    with Testbed() as tb:
        assert tb.sender_ns in sh(["ip", "netns", "list"]).stdout
        ping = tb.s("busybox", "ping", "-c", "1", "-W", "5", tb.receiver_addr, check=False)
        assert ping.returncode == 0, ping.stdout + ping.stderr
    assert tb.sender_ns not in sh(["ip", "netns", "list"]).stdout


def _loaded(name: str) -> bool:
    return Path(f"/sys/module/{name}").is_dir()


@pytest.mark.parametrize("mod,kind", [("sch_fq", "fq"), ("sch_tbf", "tbf rate 1mbit burst 3k latency 50ms")],
                         ids=["sch_fq", "sch_tbf"])
def test_module_load_use_unload(mod, kind):
    """modprobe a stock qdisc module, use it on a veth, remove it; the kernel log stays clean
    (checked by the dmesg fixture)."""
    with Testbed() as tb:
        sh(["modprobe", mod])
        assert _loaded(mod)
        tb.s("tc", "qdisc", "replace", "dev", tb.sender_dev, "root", *kind.split())
        assert kind.split()[0] in tb.qdisc_show()
        tb.s("busybox", "ping", "-c", "2", "-i", "0.2", "-W", "5", tb.receiver_addr)
        busy = sh(["modprobe", "-r", mod], check=False)
        assert busy.returncode != 0, "a module in use must refuse to unload"
        tb.clear_qdisc()
    wait_for(lambda: sh(["modprobe", "-r", mod], check=False).returncode == 0, 10,
             f"{mod} to unload")
    assert not _loaded(mod)


def test_insmod_module_file_by_path():
    """What a module built in the repo needs: insmod FILE, then rmmod."""
    rel = os.uname().release
    path = sh(["modinfo", "-n", "sch_tbf"]).stdout.strip()
    assert ".ko" in path, path
    if _loaded("sch_tbf"):
        sh(["rmmod", "sch_tbf"])
    sh(["insmod", path])
    assert _loaded("sch_tbf")
    sh(["rmmod", "sch_tbf"])
    assert not _loaded("sch_tbf")
    assert rel in path


@pytest.mark.allow_dmesg(r"flowpacer dmesg self-test")
def test_dmesg_check_sees_kernel_log(dmesg_clean):
    """The check the other tests rely on can fail: a line written to the kernel log is read
    back and classified as a problem (this test allows its own line)."""
    line = f"WARNING: flowpacer dmesg self-test {os.getpid()}"
    with open("/dev/kmsg", "w") as f:
        f.write(line + "\n")
    seen = []
    wait_for(lambda: seen.extend(dmesg_clean.read_new()) or any(line in s for s in seen),
             5, "the self-test line in /dev/kmsg")
    assert any(line in p for p in kmsg.problems(seen))
    assert kmsg.problems(["usual line", "veth: link up"]) == []
    # the fixture reads again at teardown: write it once more so the allow-list is exercised
    with open("/dev/kmsg", "w") as f:
        f.write(line + "\n")
