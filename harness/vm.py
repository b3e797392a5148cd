"""The qemu test VM, as tests and benchmarks use it: a thin facade over ``vm/run.py``.

    from harness import vm
    res = vm.run([sys.executable, "-m", "pytest", "tests/guest"], cwd=str(vm.REPO), timeout=900)
    if res.rc: ...                       # vm.VMError when the guest cannot boot or finish

``build_psp`` builds sch_psp.ko for the guest's kernel (``vm/kmod.py``). The VM is shared by
everybody on the machine: hold ``vm.LOCK`` (``flock /tmp/flowpacer-vm.lock ...``) around a run.
"""
from __future__ import annotations

from pathlib import Path

from vm.kmod import KmodError, build_psp
from vm.run import VMError, VMResult, dmesg_problems, run

REPO = Path(__file__).resolve().parents[1]
LOCK = "/tmp/flowpacer-vm.lock"
GUEST_TESTS = REPO / "tests" / "guest"


def in_vm() -> bool:
    """True inside the test VM (vm/run.py sets FLOWPACER_IN_VM=1 for the guest's command)."""
    import os
    return os.environ.get("FLOWPACER_IN_VM") == "1"


__all__ = ["run", "VMError", "VMResult", "dmesg_problems", "build_psp", "KmodError", "REPO",
           "LOCK", "GUEST_TESTS", "in_vm"]
