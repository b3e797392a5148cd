"""Debian 13 first (issue 27 item 1): the README's set-up step, the unit tests and `make demo`
with Debian 13 (trixie)'s own Python 3.13, bcc 0.31, pyroute2 and clang, against the host kernel.

- A trixie minbase root made with mmdebstrap holds the Debian packages `tools/setup.sh demo`
  (what `make demo` runs first) lists, all but two small ones (its tar is cached with
  tests/test_deb.py's roots, harness/debroot.py). The checkout's files (git's list, as `make
  deb` takes them) are copied to /src/flowpacer in it.
- `bash tools/setup.sh demo` runs there as on a fresh Debian 13 machine: its apt step installs
  the two missing packages from trixie's archive (apt-get update and install, for real), then it
  makes the venv (`python3 -m venv --system-site-packages .venv`, pip) with trixie's Python
  3.13, so bcc imports from Debian's python3-bpfcc, and, since the host kernel has no headers
  package in the root, the `/lib/modules/$(uname -r)/build` link to trixie's headers.
- `make check` (the unit tests, FLOWPACER_CHECK=1) with the venv's Python 3.13.
- `python -m harness.demo` (`make demo`): namespaces, the delivery server, the daemon with its
  bcc tracer (compiled by trixie's clang libraries against the host kernel), the clients shaped
  at their rules' rates.
- `tools/setup.sh --dry-run test` there names the test VM's kernels a Debian 13 machine gets
  (bookworm's 6.1 and trixie-backports' 7.3 unpacked, 6.12 its own).

These run chrooted in the root facing the host kernel (harness/debroot.py `Root.host_sh`: the
host's /sys with tracing, bpf and cgroup file systems, /dev, /proc, a /run of their own for `ip
netns`, in a mount namespace of their own); afterwards no process, mount or namespace is left and
the root is deleted, also on failure.
"""
import os
import re
import shutil
from pathlib import Path

import pytest

from harness.debroot import Root, base_tar, cache_lock, mounts_under, run

pytestmark = [pytest.mark.deb, pytest.mark.untimed]

ROOT = Path(__file__).resolve().parent.parent
# left out of the root so that the set-up's own apt step installs them (small, no services)
LEFT_FOR_SETUP = ("vim-tiny", "tmux")


def setup_packages(mode: str):
    """The Debian packages `tools/setup.sh MODE` installs (its --list)."""
    p = run(["bash", str(ROOT / "tools/setup.sh"), "--list", mode], 60, "tools/setup.sh --list")
    pkgs = p.stdout.split()
    assert set(LEFT_FOR_SETUP) <= set(pkgs), pkgs
    return pkgs


SRC = "/src/flowpacer"
# pip's settings of this machine (an index, its CA bundle, a timeout) reach the root's pip
PIP_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_DEFAULT_TIMEOUT", "PIP_TRUSTED_HOST",
           "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY")
CA_IN_ROOT = "/etc/ssl/certs/flowpacer-test-host-ca.crt"


def checkout_files():
    """The checkout's files as `make deb` takes them (git's list: tracked and untracked, not
    ignored), relative to ROOT."""
    p = run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            60, "git ls-files")
    return [f for f in p.stdout.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def trixie(root, tmp_path_factory):
    path = tmp_path_factory.mktemp("trixie13")
    r = Root(path)
    try:
        with cache_lock():
            tar = base_tar("trixie", [p for p in setup_packages("demo") if p not in LEFT_FOR_SETUP])
        r.unpack(tar, "trixie")
        dest = path / SRC.lstrip("/")
        dest.mkdir(parents=True)
        for f in checkout_files():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
        env = {k: os.environ[k] for k in PIP_ENV if os.environ.get(k)}
        # pip's downloads (matplotlib ... from PyPI) kept in the cache for the next session
        env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CACHE_DIR="/var/cache/flowpacer-test/pip")
        ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
        if ca and os.path.isfile(ca):
            shutil.copyfile(ca, path / CA_IN_ROOT.lstrip("/"))
            env["PIP_CERT"] = CA_IN_ROOT
        r.env = env
        yield r
    finally:
        if (path / "proc").exists():
            r.kill_processes()
        left = mounts_under(path)
        assert not left, f"mounts left under the trixie root: {left}"
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def venv(trixie):
    """`tools/setup.sh demo`, as `make demo` runs it first, in the trixie root."""
    kver = os.uname().release
    p = trixie.host_sh(f"cd {SRC}\nbash tools/setup.sh demo 2>&1\n", timeout=1200,
                       what="tools/setup.sh demo in the trixie root", check=False, env=trixie.env)
    print(p.stdout[-3000:])
    assert p.returncode == 0, p.stdout[-5000:]
    assert f"installing Debian packages: {' '.join(sorted(LEFT_FOR_SETUP))}" in p.stdout, p.stdout
    for pkg in LEFT_FOR_SETUP:
        assert (trixie.path / "var/lib/dpkg/info" / f"{pkg}.list").exists(), pkg
    # the headers link of a kernel without a headers package: trixie's own headers
    hdrs = sorted((trixie.path / "usr/src").glob("linux-headers-*-amd64"))
    assert len(hdrs) == 1 and "+deb13-" in hdrs[0].name, hdrs
    assert os.readlink(trixie.path / "lib/modules" / kver / "build") == f"/usr/src/{hdrs[0].name}"
    assert (trixie.path / SRC.lstrip("/") / ".venv/.installed").exists()
    return p


def test_dry_run_names_the_vm_kernels_of_a_debian_13_machine(trixie, venv):
    p = trixie.host_sh(f"cd {SRC}\nbash tools/setup.sh --dry-run test 2>&1\n",
                       what="tools/setup.sh --dry-run test in the trixie root", env=trixie.env)
    out = p.stdout
    assert "unpack bookworm's 6.1 kernel" in out and "unpack trixie-backports' 7.3" in out, out
    assert "bookworm-backports" not in out, out


def test_setup_uses_trixies_python_bcc_pyroute2_and_clang(trixie, venv):
    p = trixie.host_sh(
        f"cd {SRC}\n"
        ".venv/bin/python -c 'import sys, bcc, pyroute2, flowpacer.sources.tracer; "
        "from importlib.metadata import version; "
        "print(sys.version.split()[0], bcc.__file__, pyroute2.__file__, version(\"pyroute2\"))'\n"
        "dpkg-query -W -f '${Version}\\n' python3-bpfcc\n"
        "clang --version | head -n 1\n", what="versions in the venv", env=trixie.env)
    print(p.stdout)
    lines = p.stdout.split("\n")
    py, bcc_file, pyroute2_file, pyroute2_version = lines[0].split(" ")
    assert py.startswith("3.13."), lines[0]
    assert bcc_file.startswith("/usr/lib/python3/dist-packages/bcc/"), bcc_file
    assert lines[1].startswith("0.31."), lines[1]
    assert re.search(r"\bclang version 19\.", lines[2]), lines[2]
    # pyproject asks for pyroute2 >= 0.9.1: trixie's 0.7.7 is on the venv's path and pip adds
    # the newer one to the venv (as on Debian 12, whose 0.7.2 is older still)
    assert pyroute2_file.startswith((f"{SRC}/.venv/", "/usr/lib/python3/")), pyroute2_file
    assert pyroute2_version, lines[0]


def test_make_check_with_python_3_13(trixie, venv):
    p = trixie.host_sh(f"cd {SRC}\nmake check PYTEST_ARGS='-q -p no:cacheprovider' 2>&1",
                       timeout=1800, what="make check in the trixie root", check=False, env=trixie.env)
    tail = p.stdout[-5000:]
    print(tail)
    assert p.returncode == 0, tail
    m = re.search(r"(\d+) passed", tail)
    assert m and int(m.group(1)) > 300, tail
    assert not re.search(r"\d+ (failed|error)", tail), tail


def test_make_demo_with_trixies_bcc_against_the_host_kernel(trixie, venv):
    p = trixie.host_sh(f"cd {SRC}\n.venv/bin/python -m harness.demo 2>&1", timeout=600,
                       what="python -m harness.demo in the trixie root", check=False, env=trixie.env)
    out = p.stdout
    print(out)
    assert p.returncode == 0, out[-5000:]
    daemon = re.search(r"^daemon: backend (\S+) .*; flows from (.*)$", out, re.M)
    assert daemon, out
    assert daemon.group(2).startswith("tracer "), daemon.group(0)   # the bcc tracer ran
    rows = re.findall(r"^client\d+\s+(\d+)\s+(\S+)\s.*?\s([\d.]+%|-)\s+(\S+)$", out, re.M)
    assert len(rows) == 4, out
    for port, rule, share, cls in rows:
        if rule == "(none)":
            assert share == "-" and cls == "-", (port, rule, share, cls)
            continue
        assert cls != "-", f"port {port}: the flow had no class"
        assert 85.0 <= float(share.rstrip("%")) <= 105.0, f"port {port}: {share} of its rule's rate"
    assert out.rstrip().endswith("testbed removed."), out[-2000:]


def test_setup_gives_a_debian_13_host_the_vm_kernels_and_builds_the_module_for_them(trixie, venv):
    """`make test`'s set-up on Debian 13, its part that differs from Debian 12's: every package
    of `tools/setup.sh --list test` resolves from trixie's archive (apt's simulation), and
    `tools/setup.sh kernels` (what `test` runs after its packages) unpacks bookworm's 6.1 and
    trixie-backports' 7.3 for the VM, each with a root of its release (mmdebstrap) in which
    vm/kmod.py builds sch_psp at W=1 without a warning; trixie's own 6.12 is linux-image-amd64."""
    pkgs = " ".join(setup_packages("test"))
    p = trixie.host_sh(f"apt-get install -s --no-install-recommends {pkgs} 2>&1\n", timeout=300,
                       what="apt-get install -s of setup.sh's test packages", check=False,
                       env=trixie.env)
    assert p.returncode == 0 and "\nInst qemu-system-x86 " in p.stdout, p.stdout[-3000:]
    # the release's own kernel, which the VM boots as 6.12
    assert re.search(r"^Inst linux-image-amd64 \(6\.12\.", p.stdout, re.M), p.stdout[-3000:]
    p = trixie.host_sh(f"cd {SRC}\nbash tools/setup.sh kernels 2>&1\n", timeout=1200,
                       what="tools/setup.sh kernels in the trixie root", check=False, env=trixie.env)
    print(p.stdout[-3000:])
    assert p.returncode == 0, p.stdout[-5000:]
    for series, release in (("6.1", "bookworm"), ("7.3", "trixie")):
        mods = sorted((trixie.path / "usr/lib/modules").glob(f"{series}.*"))
        assert len(mods) == 1, (series, mods)
        assert (mods[0] / "vmlinuz").is_file() and (mods[0] / "modules.dep").is_file(), mods[0]
        assert os.readlink(mods[0] / "build").startswith(f"/var/cache/flowpacer/{release}-kbuild/"), mods[0]
        p = trixie.host_sh(
            f"cd {SRC}\n.venv/bin/python -c 'from pathlib import Path; from vm import kmod; "
            f"print(kmod.build_psp(Path(\"/tmp/kmod-{series}\"), series=\"{series}\", strict=True))' 2>&1\n",
            timeout=600, what=f"the module for {series} in the trixie root", check=False,
            env=trixie.env)
        assert p.returncode == 0 and p.stdout.strip().endswith("sch_psp.ko"), p.stdout[-3000:]
