"""Clean Debian roots for the tests that install or run flowpacer on a Debian release
(tests/test_deb.py: the packages in Debian 12 and 13; tests/test_debian13.py: the README's set-up,
`make check` and `make demo` with Debian 13's own Python, bcc and pyroute2).

A root starts from a tar made by mmdebstrap (minbase, plus a package list): one tar per release
and package list, cached in CACHE (FLOWPACER_TEST_CACHE, default /var/cache/flowpacer-test) for a
week, keyed by the release's sources and the list, and the downloaded packages are kept in
CACHE/archives, so that a test session makes each root from the archive at most once and later
sessions unpack it in seconds. `cache_lock()` serialises the users of the cache (apt's archive
lock is in it).

`Root.sh(script)` runs a script chrooted in the root, in new mount and pid namespaces (the
chrooted command is their pid 1: when it ends, every process it left is killed and every mount is
gone): /proc, /sys (read-only), a minimal /dev, /run, /tmp and the package cache are mounted there
only. `Root.host_sh(script)` is for what must meet the host kernel as a server's daemon does
(eBPF, tracepoints, network namespaces): the host's /sys (with its tracing, bpf and cgroup file
systems) and /dev are bind-mounted, /proc is the host's pid namespace's (the tracer's pids are
the kernel's), in a new mount namespace only; every process still running in the root when the
script ends is killed, and the mounts go with the namespace.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("FLOWPACER_TEST_CACHE", "/var/cache/flowpacer-test"))
MIRROR = os.environ.get("FLOWPACER_TEST_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("FLOWPACER_TEST_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
BASE_MAX_AGE_S = 7 * 24 * 3600
RELEASES = {"bookworm": 12, "trixie": 13}


def sources(release: str) -> list[str]:
    """The release's own archive: main, -updates and -security (backports are added by whoever
    needs them, as an admin does)."""
    return [f"deb {MIRROR} {release} main", f"deb {MIRROR} {release}-updates main",
            f"deb {SECURITY} {release}-security main"]


def backports(release: str) -> str:
    return f"deb {MIRROR} {release}-backports main"


def run(argv, timeout, what, check=True, **kw):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{what}: timed out after {timeout} s\n{out}\n{err}"[-6000:])
    if check and p.returncode != 0:
        pytest.fail(f"{what}: exit status {p.returncode}\n{p.stdout}\n{p.stderr}"[-6000:])
    return p


@contextmanager
def cache_lock(wait_s: float = 900):
    """One user of the cache at a time."""
    (CACHE / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{CACHE}/lock is held by another test run for {wait_s:.0f} s")
                time.sleep(1)
        yield


def base_tar(release: str, include=(), extra_sources=()) -> Path:
    """A minbase root of `release` with the packages `include` (and their dependencies, not their
    recommendations) as a tar, made with mmdebstrap (cached for a week; call it under
    cache_lock())."""
    srcs = sources(release) + list(extra_sources)
    include = sorted(include)
    want = "\n".join(srcs) + "\n" + "".join(f"include {p}\n" for p in include)
    name = f"{release}-minbase"
    if include or extra_sources:
        name += "-" + hashlib.sha256(want.encode()).hexdigest()[:12]
    tar, sig = CACHE / f"{name}.tar", CACHE / f"{name}.sources"
    if (tar.exists() and sig.exists() and sig.read_text() == want
            and time.time() - tar.stat().st_mtime < BASE_MAX_AGE_S):
        return tar
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed (tools/setup.sh installs it)")
    arch = CACHE / "archives"
    tmp = CACHE / f"{name}.tar.new"
    argv = ["mmdebstrap", "--mode=root", "--variant=minbase", "--format=tar", "--skip=essential/unlink",
            f"--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives && cp -a {arch}/. \"$1\"/var/cache/apt/archives/",
            f"--customize-hook=cp -a \"$1\"/var/cache/apt/archives/. {arch}/"]
    if include:
        argv += ["--aptopt=APT::Install-Recommends \"false\"", "--include=" + ",".join(include)]
    run(argv + [release, str(tmp), *srcs], 900, f"mmdebstrap {name}")
    os.replace(tmp, tar)
    sig.write_text(want)
    return tar


# Runs "$@" chrooted in $1 with its own mounts, in new mount and pid namespaces.
IN_ROOT = r"""
R=$1; C=$2; shift 2
mount -t proc proc "$R/proc"
mount -t sysfs -o ro sysfs "$R/sys"
mount -t tmpfs -o mode=0755,size=16m tmpfs "$R/dev"
for d in null zero full random urandom tty; do : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
ln -s /proc/self/fd "$R/dev/fd"
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=0755 tmpfs "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
mount --bind "$C" "$R/var/cache/apt/archives"
exec chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "$@"
"""

# Runs "$@" chrooted in $1 facing the host kernel, in a new mount namespace: the root is a mount
# point of its own (`ip netns` makes / a slave mount), the host's /sys (its tracing, bpf and
# cgroup file systems included; bpf and tracefs are mounted where the host has not) and /dev,
# /proc of the host's pid namespace, a /run of its own (`ip netns` keeps its namespaces' handles
# there: they go with this mount namespace), /tmp, and the cache $3 as /var/cache/flowpacer-test
# (pip's downloads). $2: environment assignments passed through (NAME=value ...).
ON_HOST = r"""
R=$1; E=$2; C=$3; shift 3
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mountpoint -q "$R/sys/fs/bpf" || mount -t bpf bpf "$R/sys/fs/bpf"
mountpoint -q "$R/sys/kernel/tracing" || mount -t tracefs tracefs "$R/sys/kernel/tracing"
mount --rbind /dev "$R/dev"
mount -t tmpfs -o mode=0755 tmpfs "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
mkdir -p "$R/var/cache/flowpacer-test"
mount --bind "$C" "$R/var/cache/flowpacer-test"
exec chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
    $E "$@"
"""


class Root:
    """A Debian root in `path` (unpacked from a base tar by `unpack`)."""

    def __init__(self, path: Path):
        self.path = path

    def unpack(self, tar: Path, release: str, extra_sources=()):
        run(["tar", "-C", str(self.path), "-xf", str(tar)], 300, "unpack the base root")
        shutil.copyfile("/etc/resolv.conf", self.path / "etc/resolv.conf")
        (self.path / "etc/apt/sources.list").write_text("\n".join(sources(release)) + "\n")
        if extra_sources:
            (self.path / "etc/apt/sources.list.d/extra.list").write_text("\n".join(extra_sources) + "\n")
        # no fsync per file: the root is thrown away (halves the unpacking time here)
        (self.path / "etc/dpkg/dpkg.cfg.d/test-unsafe-io").write_text("force-unsafe-io\n")

    def sh(self, script, timeout=300, what=None, check=True):
        argv = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--",
                "sh", "-ec", IN_ROOT, "sh", str(self.path), str(CACHE / "archives"),
                "sh", "-ec", script]
        return run(argv, timeout, what or script.strip().splitlines()[0], check=check)

    def host_sh(self, script, timeout=300, what=None, check=True, env=None):
        env = env or {}
        bad = [k for k, v in env.items()
               if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or re.search(r"\s", v)]
        assert not bad, f"environment entries that the root's shell would split: {bad}"
        env_args = " ".join(f"{k}={v}" for k, v in env.items())
        argv = ["unshare", "--mount", "--propagation", "private", "--",
                "sh", "-ec", ON_HOST, "sh", str(self.path), env_args, str(CACHE), "sh", "-ec", script]
        try:
            return run(argv, timeout, what or script.strip().splitlines()[0], check=check)
        finally:
            self.kill_processes()

    def processes(self):
        """Pids of the processes whose root directory is this root."""
        me = str(self.path.resolve())
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.readlink(f"/proc/{d}/root") == me:
                        pids.append(int(d))
                except OSError:
                    continue
        return pids

    def kill_processes(self, wait_s: float = 10):
        deadline = time.monotonic() + wait_s
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            time.sleep(0.1)
        left = self.processes()
        assert not left, f"processes left in {self.path}: {left}"

    def files(self):
        """Every path in the root (not /proc, /sys, /dev, /run, /tmp, the package cache)."""
        out = set()
        for dirpath, dirs, names in os.walk(self.path):
            rel = os.path.relpath(dirpath, self.path)
            if rel == ".":
                rel = ""
                dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev", "run", "tmp")]
            elif rel == "var/cache/apt":
                dirs[:] = [d for d in dirs if d != "archives"]
            out.update(os.path.join(rel, n) for n in dirs + names)
        return out


def mounts_under(path: Path):
    prefix = str(path) + "/"
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


def stub_deb(dest: Path, provides: list[tuple[str, str]]):
    """A package that Provides the kernel images (name, version) that headers packages depend on:
    only the headers are needed to build modules."""
    d = dest / "stub"
    (d / "DEBIAN").mkdir(parents=True)
    prov = ", ".join(f"{name} (= {version})" for name, version in provides)
    (d / "DEBIAN" / "control").write_text(
        "Package: flowpacer-test-image-stub\nVersion: 1\nArchitecture: all\n"
        "Maintainer: flowpacer tests <root@localhost>\n"
        f"Provides: {prov}\n"
        "Description: stands for kernel images in flowpacer's package test\n"
        " Only the headers are needed to build modules.\n")
    out = dest / "image-stub.deb"
    run(["dpkg-deb", "--root-owner-group", "--build", str(d), str(out)], 60, "dpkg-deb --build stub")
    shutil.rmtree(d)
    return out
