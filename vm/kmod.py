"""Build flowpacer's psp module (``flowpacer/kernel/kmod``) for the test VM's kernel, on the host.

    from vm import kmod
    ko = kmod.build_psp(Path("/tmp/x/kmod"))     # -> /tmp/x/kmod/sch_psp.ko, or raises

The sources are copied to ``dest`` first, so a build for the VM never races another build in
the repo (or leaves objects there). The kernel version is the one ``vm/build.py`` boots; its
headers must be installed: ``/lib/modules/<version>/build`` (Debian's linux-headers package), or,
for a kernel of another release (trixie-backports' 7.3, whose headers need gcc-14; on a Debian
13 host bookworm's 6.1, whose headers need gcc-12), in the root of that release tools/setup.sh
makes (``KBUILD_ROOTS``, or ``$FLOWPACER_KBUILD_ROOT``): the build then runs chrooted there, in a
private mount namespace (its ``/proc`` for objtool, ``dest`` bound at ``/mnt/kmod``), as root.
Only the standard library is used.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

if __package__:
    from . import build as vmbuild
else:  # imported with vm/ as sys.path[0]
    import build as vmbuild  # type: ignore[no-redef]

SOURCES = ("Kbuild", "Makefile", "sch_psp.c", "psp_compat.h", "psp_sched.h", "psp_tree.h", "uapi")
KMOD_DIR = Path(__file__).resolve().parents[1] / "flowpacer" / "kernel" / "kmod"


KBUILD_ROOTS = tuple(Path(p) for p in (
    [os.environ["FLOWPACER_KBUILD_ROOT"]] if os.environ.get("FLOWPACER_KBUILD_ROOT")
    else ["/var/cache/flowpacer/trixie-kbuild", "/var/cache/flowpacer/bookworm-kbuild"]))
ROOT_SRC = "/mnt/kmod"     # where the sources are bound inside a build root


class KmodError(Exception):
    """The module could not be built; the message has the reason and the build log's tail."""


def make_argv(dest: Path, kver: str, strict: bool) -> List[str]:
    """The command that builds ``dest`` for ``kver``: make chrooted in the build root that has
    the kernel's headers (its /lib/modules/<version>/build on the host points there too, for
    bcc, but the host's compiler cannot use them), else make on the host with its build
    directory; KmodError when neither has them."""
    extra = ["W=1"] if strict else []
    hdr = f"/usr/src/linux-headers-{kver}"
    kroot = next((r for r in KBUILD_ROOTS if (r / hdr.lstrip("/") / "Makefile").is_file()), None)
    if kroot is not None:
        root = shlex.quote(str(kroot))
        inner = shlex.join(["chroot", str(kroot), "make", "-C", ROOT_SRC, f"KVER={kver}",
                            f"KDIR={hdr}", *extra])
        script = (f"mkdir -p {root}{ROOT_SRC} && mount -t proc proc {root}/proc && "
                  f"mount --bind {shlex.quote(str(dest))} {root}{ROOT_SRC} && exec {inner}")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    if (Path("/lib/modules") / kver / "build" / "Makefile").is_file():
        return ["make", "-C", str(dest), f"KVER={kver}", *extra]
    raise KmodError(f"no headers for {kver}: neither /lib/modules/{kver}/build nor {hdr} in "
                    f"{' or '.join(map(str, KBUILD_ROOTS))} (tools/setup.sh test makes them)")


def build_psp(dest: Path, timeout: float = 600, series: Optional[str] = None,
              strict: bool = False) -> Path:
    """Build sch_psp.ko for the VM's kernel (or the newest installed kernel of ``series``,
    e.g. "6.12") in ``dest``; returns the module file. ``strict``: build with ``W=1`` and
    refuse any compiler warning."""
    try:
        kver = vmbuild.find_kernel(series).version
    except vmbuild.BuildError as e:
        raise KmodError(f"no kernel for the VM: {e}") from None
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        src = KMOD_DIR / name
        if src.is_dir():
            shutil.copytree(src, dest / name, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    argv = make_argv(dest.resolve(), kver, strict)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KmodError(f"{' '.join(argv)}: {e}") from None
    ko = dest / "sch_psp.ko"
    if proc.returncode != 0 or not ko.is_file():
        raise KmodError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n"
                        f"{(proc.stdout + proc.stderr)[-4000:]}")
    warnings = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "warning:" in ln]
    if strict and warnings:
        raise KmodError(f"{' '.join(argv)}: {len(warnings)} warnings:\n" + "\n".join(warnings[:20]))
    return ko
