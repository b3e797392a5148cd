"""A kernel that refuses unsigned modules (issue 27.5), in the qemu test VM.

The VM boots with ``module.sig_enforce=1`` on its command line (as Secure Boot's lockdown
would refuse it, with EPERM instead); the psp module built here is unsigned, so the kernel
refuses it ("Key was rejected by service"). tests/signing_guest.py then checks that
``backend: auto`` falls back to htb and says why in one line in the log, ``status`` and the
``flowpacer_backend_fallback`` metric, shapes an IPv4 and an IPv6 flow at their rules' rates,
and that ``backend: psp`` fails at start with that line. Its steps' results are in
signing_guest.json in the job directory. Debian's kernels (6.1, 6.12, 7.3) are built with
CONFIG_MODULE_SIG=y (not _FORCE): the parameter makes them enforce.
"""
import json
import os
import sys
from pathlib import Path

import pytest

from harness import vm
from vm import build as vmbuild

pytestmark = pytest.mark.vm


def test_unsigned_module_refused_auto_falls_back_to_htb(tmp_path, monkeypatch):
    ko = vm.build_psp(tmp_path / "kmod")
    index = vm.module_index(ko, vmbuild.find_kernel().version, tmp_path)
    monkeypatch.setenv("FLOWPACER_VM_APPEND",
                       (os.environ.get("FLOWPACER_VM_APPEND", "") + " module.sig_enforce=1").strip())
    out = tmp_path / "vm"
    try:
        with vm.apart("the signing guest"):          # a real-clock guest
            res = vm.run([sys.executable, str(vm.REPO / "tests/signing_guest.py")],
                         cwd=str(vm.REPO), timeout=600, out_dir=out,
                         env={"FLOWPACER_PSP_KO": str(ko), "FLOWPACER_MODULE_INDEX": str(index)})
    except vm.VMError as e:
        pytest.fail(f"the VM: {e.details()[-4000:]}", pytrace=False)
    report = out / "signing_guest.json"
    results = json.loads(report.read_text()) if report.exists() else {}
    print(json.dumps(results, indent=1))
    assert res.rc == 0 and results.get("ok"), \
        f"guest: {results.get('failed')}\n{res.output[-3000:]}"
    assert "module.sig_enforce=1" in res.dmesg or "sig_enforce" in res.console, res.dmesg[:2000]
    assert "Loading of unsigned module is rejected" in res.dmesg, res.dmesg[-3000:]
    assert not res.dmesg_problems(), res.dmesg_problems()
