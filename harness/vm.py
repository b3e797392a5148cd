"""The qemu test VM, as tests and benchmarks use it: a thin facade over ``vm/run.py``.

    from harness import vm
    res = vm.run([sys.executable, "-m", "pytest", "tests/guest"], cwd=str(vm.REPO), timeout=900)
    if res.rc: ...                       # vm.VMError when the guest cannot boot or finish

``build_psp`` builds sch_psp.ko for the guest's kernel (``vm/kmod.py``). The VM is shared by
everybody on the machine: hold ``vm.LOCK`` (``flock /tmp/flowpacer-vm.lock ...``) around a run.
"""
from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from vm.kmod import KmodError, build_psp
from vm.run import VMError, VMResult, dmesg_problems, run

REPO = Path(__file__).resolve().parents[1]
LOCK = "/tmp/flowpacer-vm.lock"
# Held around every real-clock guest run and the untimed lane's heavy work (``apart``)
APART_LOCK = "/tmp/flowpacer-vm-apart.lock"
GUEST_TESTS = REPO / "tests" / "guest"


_apart_owner = {"thread": None}      # the thread of this process that holds APART_LOCK


@contextlib.contextmanager
def apart(what: str):
    """Run ``what`` never beside another holder of APART_LOCK: the timed lane holds it through
    its real-clock guests (each of which takes it too, for runs outside the lanes), the untimed
    lane from the end of its virtual-clock guest to its end, i.e. through the Debian 13 server VM
    and the Debian roots' builds (harness/lanes.GuestPhase). Rehearsals ci22 and ci23: the
    real-clock guest (two emulated CPUs) beside the server VM, or beside the roots' builds (dpkg,
    gcc, mmdebstrap), was starved: its UDP sender offered 15 and then 7.6 Mbit/s where it must
    offer 15+, its borrowing upload reached 84 % of the ceil. Beside the virtual-clock guest alone
    it passed (stop 33). Waits as long as the other holder runs; the wait is printed. Re-entrant
    within one thread."""
    me = threading.current_thread()      # not its ident: a later thread may reuse that
    if _apart_owner["thread"] is me:
        yield 0.0
        return
    with open(APART_LOCK, "a") as f:
        t = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.monotonic() - t
        if waited >= 1:
            print(f"[vm] {what}: waited {waited:.0f} s for {APART_LOCK}", file=sys.stderr,
                  flush=True)
        _apart_owner["thread"] = me
        try:
            yield waited
        finally:
            _apart_owner["thread"] = None


def in_vm() -> bool:
    """True inside the test VM (vm/run.py sets FLOWPACER_IN_VM=1 for the guest's command)."""
    import os
    return os.environ.get("FLOWPACER_IN_VM") == "1"


def module_index(ko: Path, kver: str, tmp: Path) -> Path:
    """depmod's indexes of the guest kernel's modules with ``ko`` in updates/dkms/ (where DKMS
    puts it), made here on a hard-linked copy of the tree: the guest copies them into its
    overlay (depmod there reads every module over 9p under TCG, minutes)."""
    base = tmp / "modroot"
    tree = base / "lib/modules" / kver
    tree.parent.mkdir(parents=True)
    subprocess.run(["cp", "-al", f"/lib/modules/{kver}", str(tree)], check=True, timeout=120)
    for f in tree.glob("modules.*"):   # hard links to the host's files: copies instead
        data = f.read_bytes()
        f.unlink()
        f.write_bytes(data)
    (tree / "updates/dkms").mkdir(parents=True, exist_ok=True)
    shutil.copy(ko, tree / "updates/dkms/sch_psp.ko")
    subprocess.run(["depmod", "-b", str(base), kver], check=True, timeout=300)
    out = tmp / "modindex"
    out.mkdir()
    for f in tree.glob("modules.*"):
        shutil.copy(f, out / f.name)
    shutil.rmtree(base)
    return out


__all__ = ["run", "VMError", "VMResult", "dmesg_problems", "build_psp", "KmodError", "REPO",
           "LOCK", "APART_LOCK", "GUEST_TESTS", "apart", "in_vm", "module_index"]
