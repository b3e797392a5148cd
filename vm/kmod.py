"""Build flowpacer's psp module (``flowpacer/kmod``) for the test VM's kernel, on the host.

    from vm import kmod
    ko = kmod.build_psp(Path("/tmp/x/kmod"))     # -> /tmp/x/kmod/sch_psp.ko, or raises

The sources are copied to ``dest`` first, so a build for the VM never races another build in
the repo (or leaves objects there). The kernel version is the one ``vm/build.py`` boots; its
headers must be installed (``/lib/modules/<version>/build``, Debian's linux-headers package).
Only the standard library is used.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional

if __package__:
    from . import build as vmbuild
else:  # imported with vm/ as sys.path[0]
    import build as vmbuild  # type: ignore[no-redef]

SOURCES = ("Kbuild", "Makefile", "sch_psp.c", "psp_compat.h", "psp_sched.h", "psp_tree.h", "uapi")
KMOD_DIR = Path(__file__).resolve().parents[1] / "flowpacer" / "kmod"


class KmodError(Exception):
    """The module could not be built; the message has the reason and the build log's tail."""


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
    argv = ["make", "-C", str(dest), f"KVER={kver}"] + (["W=1"] if strict else [])
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
