"""Backends: which one runs here, and why.

``choose(kind)`` answers (codec, reason). ``auto`` prefers psp when the sch_psp module is loaded
or loadable and falls back to htb otherwise; the reason is logged and shown by
``flowpacer status``. ``fallback(kind, lost)`` answers what replaces a backend whose qdisc was
lost and cannot be made again: only ``auto`` falls back, from psp to htb, when the module is gone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional, Tuple

from ..errors import BackendError
from ..model import BackendKind


def psp_available() -> Tuple[bool, str]:
    if os.path.isdir("/sys/module/sch_psp"):
        return True, "sch_psp module is loaded"
    modprobe = shutil.which("modprobe") or "/sbin/modprobe"
    try:
        p = subprocess.run([modprobe, "-q", "sch_psp"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run modprobe sch_psp: {e}"
    if p.returncode == 0 and os.path.isdir("/sys/module/sch_psp"):
        return True, "sch_psp module loaded by modprobe"
    why = (p.stderr.strip().splitlines() or [f"modprobe sch_psp exited {p.returncode}"])[-1]
    if not os.path.isdir("/proc/sys/kernel") or not os.path.exists("/proc/modules"):
        why = "this kernel cannot load modules"
    return False, why


def choose(kind: BackendKind):
    """(codec, reason) for the requested backend kind."""
    from .htb import HtbCodec
    if kind is BackendKind.HTB:
        return HtbCodec(), "htb requested"
    ok, why = psp_available()
    if ok:
        from .psp import PspCodec
        return PspCodec(), why if kind is BackendKind.PSP else f"auto: {why}"
    if kind is BackendKind.PSP:
        raise BackendError(f"backend psp requested but the module is not available: {why}")
    return HtbCodec(), f"auto: psp unavailable ({why}), using htb"


def fallback(kind: BackendKind, lost: str) -> Optional[tuple]:
    """(codec, reason) to use instead of the backend ``lost`` (its kind name) whose qdisc cannot
    be rebuilt, or None to keep retrying it. Only ``auto`` falls back, and only from psp when
    the module is no longer available; an explicit ``psp`` waits for the module to return."""
    if kind is not BackendKind.AUTO or lost != "psp":
        return None
    ok, why = psp_available()
    if ok:
        return None
    from .htb import HtbCodec
    return HtbCodec(), f"auto: psp unavailable since it was lost ({why}), using htb until a reload or restart"
