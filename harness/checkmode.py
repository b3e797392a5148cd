"""The guard of ``make check``: the fast subset must need no root, no VM and no Debian root.

``make check`` selects the tests that carry none of the markers kernel, vm, heavy and deb and sets
``FLOWPACER_CHECK=1``; tests/conftest.py then calls :func:`install`, and from there on any attempt
to make a network namespace, enter one, boot the qemu VM, start the daemon or compile a bcc
program fails the test at once with a message that names the marker it lacks. A test that needs
one of them is thereby found the first time it runs in the fast subset, not by the next
contributor who runs ``make check`` without root.

Three layers, because the test and its children reach the kernel in different ways:
- in this process: the harness' entry points (``Testbed.create``, the daemon launcher,
  ``vm.run``), pyroute2's namespace calls and ``bcc.BPF`` are replaced by a refusal;
- ``subprocess.Popen`` refuses the commands below (``ip netns``, ``unshare``, qemu ...);
- child processes find the same commands first in PATH as small scripts that refuse them.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import pytest

log = logging.getLogger(__name__)

ENV = "FLOWPACER_CHECK"

# command -> (what it does, the marker a test that runs it needs)
REFUSED_COMMANDS = {
    "unshare": ("make namespaces", "kernel"),
    "nsenter": ("enter a namespace", "kernel"),
    "qemu-system-x86_64": ("boot the qemu VM", "vm"),
    "mmdebstrap": ("build a Debian root", "deb"),
    "dpkg-buildpackage": ("build the Debian packages", "deb"),
    "modprobe": ("load a kernel module", "kernel"),
    "insmod": ("load a kernel module", "kernel"),
}
# `ip` stays usable for reading; these arguments make or enter a namespace
IP_NETNS_ARGS = ("netns", "-n", "-netns", "--netns")


# A test of the fast subset that runs longer than this (wall clock, its call phase) without the
# ``slow`` marker fails: `make check` stays a few minutes because nothing long slips into it
# unmarked. The longest unmarked test took 4.7 s on the quiet 2-core machine (10 s for one that
# waits out its readers' timeouts, now marked slow); the margin is for the trixie root's
# `make check`, which runs beside the rest of `make test`.
SLOW_LIMIT_S = float(os.environ.get("FLOWPACER_CHECK_SLOW_S", "20"))   # the env: for its test


def active() -> bool:
    return os.environ.get(ENV) == "1"


def message(what: str, marker: str) -> str:
    return (f"make check: this test tried to {what}, which needs root or the VM: mark this test "
            f"{marker} (pytest.mark.{marker}, or use a fixture of tests/conftest.py that marks it)")


def refuse(what: str, marker: str = "kernel"):
    pytest.fail(message(what, marker), pytrace=False)


def refused_argv(argv) -> Optional[tuple]:
    """(what, marker) when ``argv`` (a Popen args value) is a command the fast subset may not
    run, else None."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        words = os.fsdecode(argv).split()
    else:
        words = [os.fsdecode(a) for a in argv]
    if not words:
        return None
    prog = os.path.basename(words[0])
    if prog in REFUSED_COMMANDS:
        return REFUSED_COMMANDS[prog]
    if prog == "ip" and any(w in IP_NETNS_ARGS for w in words[1:]):
        return ("make or enter a network namespace (ip netns)", "kernel")
    return None


class GuardedPopen(subprocess.Popen):
    """``subprocess.Popen`` that refuses what :func:`refused_argv` names."""

    def __init__(self, args, *a, **kw):
        why = refused_argv(args)
        if why is not None:
            refuse(*why)
        super().__init__(args, *a, **kw)


SHIM = """#!/bin/sh
# make check (harness/checkmode.py): refuse what needs root or the VM
{test}
echo "{msg}" >&2
exit 126
"""


def write_shims(bindir: Path) -> None:
    """Scripts named like the refused commands, for child processes (first in their PATH)."""
    for prog, (what, marker) in REFUSED_COMMANDS.items():
        _shim(bindir / prog, "", message(what, marker))
    real_ip = shutil.which("ip")
    netns = " ".join(IP_NETNS_ARGS)
    test = ("for a in \"$@\"; do case \" " + netns + " \" in *\" $a \"*) refuse=1;; esac; done\n"
            + ("[ -z \"$refuse\" ] && exec " + real_ip + " \"$@\"" if real_ip
               else "[ -z \"$refuse\" ] && { echo 'ip: not installed' >&2; exit 127; }"))
    _shim(bindir / "ip", test, message("make or enter a network namespace (ip netns)", "kernel"))


def _shim(path: Path, test: str, msg: str) -> None:
    path.write_text(SHIM.format(test=test, msg=msg.replace('"', "'")))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _replace(obj, name: str, what: str, marker: str = "kernel") -> None:
    def refused(*a, **kw):
        refuse(what, marker)
    setattr(obj, name, refused)


def install() -> Path:
    """Put every layer in place for the rest of this process (a pytest session); returns the
    directory of the PATH scripts."""
    from harness import testbed
    for name in ("__enter__", "create"):
        _replace(testbed.Testbed, name, "create network namespaces (Testbed)")
    _replace(testbed.Daemon, "start", "start the daemon (eBPF tracer, tc on a testbed)")
    import harness.vm
    import vm.run
    _replace(vm.run, "run", "boot the qemu VM", "vm")
    _replace(harness.vm, "run", "boot the qemu VM", "vm")
    import pyroute2.netns
    what = "make or enter a network namespace (pyroute2)"
    for name in ("create", "setns", "pushns", "attach"):
        _replace(pyroute2.netns, name, what)
    # every pyroute2 socket is made here; only one in another namespace is refused
    plain_socket = pyroute2.netns.create_socket

    def create_socket(netns=None, *a, **kw):
        if netns is not None:
            refuse(what)
        return plain_socket(None, *a, **kw)
    pyroute2.netns.create_socket = create_socket
    try:
        import bcc
    except ImportError:       # no bcc here: nothing can compile a program in this process
        bcc = None
    if bcc is not None:
        _replace(bcc.BPF, "__init__", "compile and load a bcc program")
    subprocess.Popen = GuardedPopen
    bindir = Path(tempfile.mkdtemp(prefix="flowpacer-check-"))
    write_shims(bindir)
    os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    log.info("make check guard installed (PATH scripts in %s)", bindir)
    return bindir


def uninstall_shims(bindir: Path) -> None:
    shutil.rmtree(bindir, ignore_errors=True)


__all__ = ["ENV", "active", "install", "uninstall_shims", "refused_argv", "message",
           "REFUSED_COMMANDS"]


def too_slow(item, duration_s: float) -> Optional[str]:
    """The failure message for a test of the fast subset that took ``duration_s`` without the
    ``slow`` marker, else None."""
    if duration_s <= SLOW_LIMIT_S or item.get_closest_marker("slow") is not None:
        return None
    return (f"make check: this test ran {duration_s:.1f} s, over the fast subset's "
            f"{SLOW_LIMIT_S:.0f} s: mark it slow (pytest.mark.slow; make test still runs it)")
