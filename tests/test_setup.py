"""`make deb` and `make install` install only what building and installing need (issue 28 item 1):
the package lists of tools/setup.sh and the Makefile's prerequisites, read from the files."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "tools", "setup.sh")

# what must never be installed to build or install flowpacer: servers that Debian starts when it
# installs them, the test VM and its kernels, capture and traffic tools, the Debian-root maker
TEST_ONLY = re.compile(r"^(nginx|prometheus|qemu|linux-image|linux-headers|tshark|wireshark|"
                       r"tcpdump|mmdebstrap|debootstrap|iperf|apache2|nghttp2|busybox|h2load|"
                       r"netcat|tmux|vim|clang|libbpf|bpfcc-tools)")


def listed(mode):
    out = subprocess.run(["bash", SETUP, "--list", mode], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    pkgs = out.stdout.split()
    assert pkgs
    return set(pkgs)


def array(name):
    """The packages of one of setup.sh's arrays, read from its text (comments dropped)."""
    text = open(SETUP).read()
    m = re.search(rf"^{name}=\((.*?)^\)", text, re.M | re.S)
    assert m, name
    return set(re.sub(r"#.*", "", m.group(1)).split())


@pytest.mark.parametrize("mode", ["build", "install"])
def test_build_and_install_lists_hold_no_test_only_package(mode):
    pkgs = listed(mode)
    assert not {p for p in pkgs if TEST_ONLY.match(p)}, mode
    # the test-only list stays apart: a package moved into the build or install list is removed
    # from TEST_PKGS (else it was needed by both, and so is not test-only)
    assert not pkgs & array("TEST_PKGS")
    assert pkgs == array({"build": "BUILD_PKGS", "install": "INSTALL_PKGS"}[mode])
    # and make test still installs all of it itself
    assert pkgs <= listed("test")
    assert {"nginx-light", "prometheus", "qemu-system-x86", "mmdebstrap"} <= listed("test")


def test_build_list_has_debian_controls_build_depends():
    """Not too short either: dpkg-buildpackage refuses to start without a Build-Depends."""
    text = open(os.path.join(ROOT, "debian", "control")).read()
    m = re.search(r"^Build-Depends:(.*?)(?=^\S)", text, re.M | re.S)
    provided = {"debhelper-compat": "debhelper", "dh-sequence-dkms": "dh-dkms",
                "dh-sequence-python3": "dh-python"}
    deps = {provided.get(d, d) for d in re.findall(r"([a-z0-9][a-z0-9+.-]+)", re.sub(
        r"\([^)]*\)|\[[^]]*\]|<[^>]*>", "", m.group(1)))}
    assert deps and deps <= listed("build")
    assert {"build-essential", "dpkg-dev", "lintian"} <= listed("build")


@pytest.mark.parametrize("target,mode", [("deb", "build"), ("install", "install")])
def test_make_target_asks_only_for_its_own_list(target, mode):
    out = subprocess.run(["make", "-C", ROOT, "-n", "-B", target], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    runs = re.findall(r"tools/setup\.sh(.*)", out.stdout)
    assert [r.split() for r in runs] == [[mode]], out.stdout
    dry = subprocess.run(["bash", SETUP, "--dry-run", mode], capture_output=True, text=True,
                         timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"setup ({mode}): Debian packages: " in dry.stdout
    assert "would also" not in dry.stdout and "backports" not in dry.stdout, dry.stdout
    assert "no kernel, no server, no venv" in dry.stdout


def test_make_test_installs_everything_itself():
    for target, mode in (("test", "test"), ("demo", "demo")):
        out = subprocess.run(["make", "-C", ROOT, "-n", "-B", target], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert re.search(rf"tools/setup\.sh {mode}$", out.stdout, re.M), (target, out.stdout)
    # the demo's packages are in the test set-up too, and it never installs a VM or a server
    assert listed("demo") <= listed("test")
    assert not {p for p in listed("demo") if re.match(r"^(nginx|prometheus|qemu|linux-image|"
                                                     r"mmdebstrap|tshark|iperf)", p)}
    dry = subprocess.run(["bash", SETUP, "--dry-run", "test"], capture_output=True, text=True,
                         timeout=60)
    # the test VM's kernels by release (tests/test_debian13.py runs this on Debian 13)
    release = re.search(r"^VERSION_CODENAME=(\S+)", open("/etc/os-release").read(), re.M).group(1)
    want = {"bookworm": "bookworm-backports' 6.12 kernel",
            "trixie": "unpack bookworm's 6.1 kernel"}[release]
    assert dry.returncode == 0 and want in dry.stdout, dry.stdout


def test_bad_argument_is_one_line():
    out = subprocess.run(["bash", SETUP, "--nonsense"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "unknown argument" in out.stderr
