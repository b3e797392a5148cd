"""Backends: which one runs here, and why.

``choose(kind)`` answers (codec, reason). ``auto`` prefers psp when the sch_psp module is loaded
or loadable and falls back to htb otherwise; the reason is logged and shown by
``flowpacer status``. ``fallback(kind, lost)`` answers what replaces a backend whose qdisc was
lost and cannot be made again: only ``auto`` falls back, from psp to htb, when the module is gone.
The kinds, their codecs and modules are registered in ``registry.py``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional, Tuple

from flowpacer.errors import BackendError
from flowpacer.model import BackendKind
from flowpacer.kernel.backend import registry


# Where an admin reads how to sign sch_psp for a kernel that refuses unsigned modules.
SIGNING_DOCS = ("see \"Module signing\" in docs/packaging.md "
                "(/usr/share/doc/flowpacer/operating.md, \"Locked-down kernels\")")
SIG_ENFORCE = "/sys/module/module/parameters/sig_enforce"
LOCKDOWN = "/sys/kernel/security/lockdown"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def signature_policy(sig_enforce: str = SIG_ENFORCE, lockdown: str = LOCKDOWN) -> str:
    """What this kernel demands of a module's signature, in words: "module.sig_enforce=1",
    "lockdown=integrity", both, or "" (unsigned modules load, tainting the kernel)."""
    parts = []
    if _read(sig_enforce) in ("Y", "1"):
        parts.append("module.sig_enforce=1")
    m = re.search(r"\[(\w+)\]", _read(lockdown))
    if m and m.group(1) != "none":
        parts.append(f"lockdown={m.group(1)}")
    return ", ".join(parts)


def module_signer(module: str) -> str:
    """Who signed the file modprobe would load for ``module``: "signed by SIGNER (key ID)",
    "unsigned", or "" when modinfo cannot tell (no such module, no modinfo)."""
    modinfo = shutil.which("modinfo") or "/sbin/modinfo"
    try:
        p = subprocess.run([modinfo, module],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if p.returncode != 0:
        return ""
    fields = {}
    for line in p.stdout.splitlines():
        k, sep, v = line.partition(":")
        if sep and k.strip() in ("filename", "signer", "sig_key"):
            fields[k.strip()] = v.strip()
    if not fields.get("signer"):
        return "unsigned" if fields.get("filename") else ""
    key = f" (key {fields['sig_key']})" if fields.get("sig_key") else ""
    return f"signed by {fields['signer']}{key}"


# modprobe's words for the kernel refusing a module's signature (EKEYREJECTED, ENOKEY,
# EKEYREVOKED, EBADMSG) or, under lockdown, any unsigned module (EPERM)
_SIG_ERRORS = ("Key was rejected by service", "Required key not available",
               "Key has been revoked", "Bad message")


def refusal(module: str, error: str, policy: str, signer: str) -> str:
    """One line for a module the kernel would not load because of its signature, or "" when
    ``error`` (modprobe's last line) is some other failure. ``policy``: ``signature_policy()``;
    ``signer``: ``module_signer()``."""
    kernel = next((e for e in _SIG_ERRORS if e in error), "")
    if not kernel and policy and "Operation not permitted" in error:
        kernel = "Operation not permitted"
    if not kernel:
        return ""
    what = f"the {module} module is {signer}" if signer else f"the {module} module"
    why = f"the kernel requires signed modules ({policy})" if policy else \
        "the kernel refused its signature"
    return (f"the kernel refused {module}: {kernel} ({why}; {what}, with no key the kernel "
            f"trusts): sign it with the DKMS MOK key and enroll that key, {SIGNING_DOCS}")


def module_report(module: str) -> str:
    """One line on ``module``'s file and this kernel's signature policy, for ``flowpacer
    status``: "sch_psp: signed by SIGNER (key ID), loaded; the kernel requires signed modules
    (module.sig_enforce=1)"; "" when there is no such module here."""
    signer = module_signer(module)
    loaded = os.path.isdir(f"/sys/module/{module}")
    if not signer and not loaded:
        return ""
    policy = signature_policy()
    parts = [f"{module}: {signer or 'file not found'}", "loaded" if loaded else "not loaded"]
    text = ", ".join(parts)
    if policy:
        text += f"; the kernel requires signed modules ({policy})"
        if signer == "unsigned" and not loaded:
            text += f": it will not load, {SIGNING_DOCS}"
    return text


def module_available(module: str) -> Tuple[bool, str]:
    """Whether kernel module ``module`` is loaded, or loadable now; and why, in one line (the
    kernel's refusal, e.g. "Key was rejected by service" on a kernel that enforces module
    signatures, with what to do about it)."""
    sys_dir = f"/sys/module/{module}"
    if os.path.isdir(sys_dir):
        return True, f"{module} module is loaded"
    modprobe = shutil.which("modprobe") or "/sbin/modprobe"
    try:
        # not -q: it hides the insert error ("could not insert 'sch_psp': Key was rejected by
        # service"), which is what the admin needs to read
        p = subprocess.run([modprobe, module], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run modprobe {module}: {e}"
    if p.returncode == 0 and os.path.isdir(sys_dir):
        return True, f"{module} module loaded by modprobe"
    why = (p.stderr.strip().splitlines() or [f"modprobe {module} exited {p.returncode}"])[-1]
    if not os.path.isdir("/proc/sys/kernel") or not os.path.exists("/proc/modules"):
        return False, "this kernel cannot load modules"
    refused = refusal(module, why, signature_policy(), module_signer(module))
    return False, refused or why


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
