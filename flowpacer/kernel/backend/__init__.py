"""Backends: which one runs here, and why.

``choose(kind)`` answers (codec, reason). ``auto`` prefers psp when the sch_psp module is loaded
or loadable and falls back to htb otherwise; the reason is logged and shown by
``flowpacer status``. ``fallback(kind, lost)`` answers what replaces a backend whose qdisc was
lost and cannot be made again: only ``auto`` falls back, from psp to htb, when the module is gone.
The kinds, their codecs and modules are registered in ``registry.py``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional, Tuple

from flowpacer.errors import BackendError
from flowpacer.model import BackendKind
from flowpacer.kernel.backend import registry


def module_available(module: str) -> Tuple[bool, str]:
    """Whether kernel module ``module`` is loaded, or loadable now; and why."""
    sys_dir = f"/sys/module/{module}"
    if os.path.isdir(sys_dir):
        return True, f"{module} module is loaded"
    modprobe = shutil.which("modprobe") or "/sbin/modprobe"
    try:
        p = subprocess.run([modprobe, "-q", module], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run modprobe {module}: {e}"
    if p.returncode == 0 and os.path.isdir(sys_dir):
        return True, f"{module} module loaded by modprobe"
    why = (p.stderr.strip().splitlines() or [f"modprobe {module} exited {p.returncode}"])[-1]
    if not os.path.isdir("/proc/sys/kernel") or not os.path.exists("/proc/modules"):
        why = "this kernel cannot load modules"
    return False, why


def available(kind: BackendKind) -> Tuple[bool, str]:
    """Whether a kind can be set up here (its module, if it needs one), and why."""
    s = registry.spec(kind)
    if s.module is None:
        return True, f"{s.kind.value} needs no module"
    return module_available(s.module)


def choose(kind: BackendKind):
    """(codec, reason) for the requested backend kind."""
    if kind is not BackendKind.AUTO:
        s = registry.spec(kind)
        if s.module is None:
            return s.codec(), f"{s.kind.value} requested"
        ok, why = available(kind)
        if not ok:
            raise BackendError(f"backend {s.kind.value} requested but the module is not "
                               f"available: {why}")
        return s.codec(), why
    skipped = []
    for s in registry.auto_order():
        ok, why = available(s.kind)
        if ok and s.module is None and skipped:
            return s.codec(), f"auto: {'; '.join(skipped)}, using {s.kind.value}"
        if ok:
            return s.codec(), f"auto: {why}" if s.module else f"auto: {s.kind.value}"
        skipped.append(f"{s.kind.value} unavailable ({why})")
    raise BackendError(f"no backend available: {'; '.join(skipped)}")


def fallback(kind: BackendKind, lost) -> Optional[tuple]:
    """(codec, reason) to use instead of the backend of kind ``lost`` whose qdisc cannot be
    rebuilt, or None to keep retrying it. Only ``auto`` falls back, and only from a kind whose
    module is no longer available, to the next kind in auto's order that is; an explicit kind
    waits for its module to return."""
    if kind is not BackendKind.AUTO:
        return None
    try:
        lost_spec = registry.spec(lost)
    except ValueError:
        return None
    if lost_spec.module is None:
        return None
    ok, why = available(lost_spec.kind)
    if ok:
        return None
    for s in registry.auto_order():
        if s.auto_rank > lost_spec.auto_rank and available(s.kind)[0]:
            return s.codec(), (f"auto: {lost_spec.kind.value} unavailable since it was lost "
                               f"({why}), using {s.kind.value} until a reload or restart")
    return None
