"""Debian 13 first (issue 27 item 1): the README's set-up step, the unit tests and `make demo`
with Debian 13 (trixie)'s own Python 3.13, bcc 0.31, pyroute2 and clang, against the host kernel.

- A trixie minbase root made with mmdebstrap holds what the set-up installs from trixie's archive
  for these steps (python3, python3-venv, python3-bpfcc, python3-pyroute2, the other Python
  libraries, clang and gcc, make, iproute2, the headers of trixie's kernel for bcc); its tar is
  cached with tests/test_deb.py's roots (harness/debroot.py). The checkout's files (git's list,
  as `make deb` takes them) are copied to /src/flowpacer in it.
- The set-up's venv step as tools/setup.sh does it: `python3 -m venv --system-site-packages
  .venv`, `pip install -e '.[test]' ...`; bcc then imports from Debian's python3-bpfcc, and the
  `/lib/modules/$(uname -r)/build` link setup.sh makes on a kernel without a headers package
  points at trixie's headers.
- `make check` (the unit tests, FLOWPACER_CHECK=1) with the venv's Python 3.13.
- `python -m harness.demo` (`make demo`): namespaces, the delivery server, the daemon with its
  bcc tracer (compiled by trixie's clang libraries against the host kernel), the clients shaped
  at their rules' rates.

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
# what the set-up installs from trixie's archive for the unit tests and the demo
# (as tools/setup.sh: the editors and tmux of `rules edit`'s tests, htpasswd and bcrypt of the
# metrics endpoint's basic auth)
PACKAGES = ("python3", "python3-venv", "python3-bpfcc", "python3-pyroute2", "python3-yaml",
            "python3-click", "python3-prometheus-client", "python3-numpy", "python3-bcrypt",
            "clang", "libbpf1", "gcc", "libc6-dev", "make", "iproute2", "procps", "kmod",
            "linux-headers-amd64", "vim-tiny", "tmux", "apache2-utils", "openssl")
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
            tar = base_tar("trixie", PACKAGES)
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
    """The set-up's venv step (tools/setup.sh), and its headers link, in the trixie root."""
    kver = os.uname().release
    hdrs = sorted((trixie.path / "usr/src").glob("linux-headers-*-amd64"))
    assert len(hdrs) == 1 and "+deb13-" in hdrs[0].name, hdrs
    moddir = trixie.path / "lib/modules" / kver
    if not (moddir / "build").exists():       # as setup.sh: a kernel without a headers package
        moddir.mkdir(parents=True, exist_ok=True)
        os.symlink(f"/usr/src/{hdrs[0].name}", moddir / "build")
        os.symlink(f"/usr/src/{hdrs[0].name[:-len('-amd64')]}-common", moddir / "source")
    p = trixie.host_sh(
        f"cd {SRC}\n"
        "/usr/bin/python3 -m venv --system-site-packages .venv\n"
        ".venv/bin/pip install -q -e '.[test]' prometheus-client matplotlib numpy\n"
        "touch .venv/.installed\n", timeout=900, what="the venv step of the set-up", env=trixie.env)
    return p


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
