"""Kernels that refuse unsigned modules (issue 27.5), the parts that need no VM.

The kernel's side (a guest booted with module.sig_enforce=1 refusing the unsigned sch_psp, the
daemon falling back to htb and shaping) is tests/guest/test_psp_signing.py, run by
tests/test_vm.py; the DKMS build signing the module with its MOK key is in tests/test_deb.py.
Here: the one line made of modprobe's error and the kernel's policy, the signer read by the
real modinfo from real module files (one of the VM kernel's signed modules and the same file
with its signature cut off), and the fall-back as status and metrics show it.
"""
import glob
import os
import shutil

import pytest

from flowpacer.kernel import backend
from flowpacer.model import BackendKind, Match, Rule, RuleSet
from harness.fakes import FakeFactory, FakeSockDiag, inprocess_daemon
from harness.testbed import wait_for
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowpacer.model import (BackendHealth, DaemonCounters, DaemonView, EventCounts,
                             FlowSourceMode, FlowSourceStatus, Histogram)

KEY_REJECTED = "modprobe: ERROR: could not insert 'sch_psp': Key was rejected by service"
LOCKED = "modprobe: ERROR: could not insert 'sch_psp': Operation not permitted"
NOT_FOUND = "modprobe: FATAL: Module sch_psp not found in directory /lib/modules/6.12.117+deb13-amd64"
MARKER = b"~Module signature appended~\n"


def test_a_rejected_signature_is_one_line_with_the_kernels_words_and_the_docs():
    line = backend.refusal("sch_psp", KEY_REJECTED, "module.sig_enforce=1", "unsigned")
    assert "\n" not in line
    assert "Key was rejected by service" in line
    assert "module.sig_enforce=1" in line and "sch_psp module is unsigned" in line
    assert "docs/packaging.md" in line and "Module signing" in line


def test_lockdown_refuses_with_eperm_only_when_the_kernel_is_locked_down():
    line = backend.refusal("sch_psp", LOCKED, "lockdown=integrity", "unsigned")
    assert "Operation not permitted" in line and "lockdown=integrity" in line
    # EPERM without a lockdown is something else (not root): no word about signatures
    assert backend.refusal("sch_psp", LOCKED, "", "unsigned") == ""


def test_other_modprobe_failures_are_not_called_signature_problems():
    assert backend.refusal("sch_psp", NOT_FOUND, "module.sig_enforce=1", "") == ""


def test_signature_policy_reads_sig_enforce_and_lockdown(tmp_path):
    enf, lock = tmp_path / "sig_enforce", tmp_path / "lockdown"
    enf.write_text("N\n")
    lock.write_text("[none] integrity confidentiality\n")
    assert backend.signature_policy(str(enf), str(lock)) == ""
    enf.write_text("Y\n")
    assert backend.signature_policy(str(enf), str(lock)) == "module.sig_enforce=1"
    lock.write_text("none [integrity] confidentiality\n")
    assert backend.signature_policy(str(enf), str(lock)) == \
        "module.sig_enforce=1, lockdown=integrity"
    # a kernel without either file (no lockdown LSM, modules built in)
    assert backend.signature_policy(str(tmp_path / "x"), str(tmp_path / "y")) == ""


def _signed_module():
    hits = sorted(glob.glob("/lib/modules/*/kernel/drivers/net/veth.ko"))
    if not hits or shutil.which("modinfo") is None:
        if os.environ.get("FLOWPACER_CHECK"):     # make check: make deps has not run
            pytest.skip("needs a Debian kernel's modules (the VM's, tools/setup.sh) and modinfo")
        pytest.fail("no Debian kernel module or no modinfo: make deps (tools/setup.sh) installs "
                    "the VM's kernels and kmod")
    return hits[-1]


def test_module_signer_reads_the_signer_of_a_real_module_file(tmp_path):
    ko = _signed_module()
    data = open(ko, "rb").read()
    assert data.endswith(MARKER), f"{ko} is not signed"
    signed = backend.module_signer(ko)
    assert signed.startswith("signed by ") and "(key " in signed, signed
    # the same file without its signature: [module][signature][12-byte info][marker], the
    # signature's length big-endian in the info's last 4 bytes
    sig_len = int.from_bytes(data[-len(MARKER) - 4:-len(MARKER)], "big")
    cut = tmp_path / "veth.ko"
    cut.write_bytes(data[:-(len(MARKER) + 12 + sig_len)])
    assert backend.module_signer(str(cut)) == "unsigned"
    assert backend.module_signer(str(tmp_path / "nothing.ko")) == ""


def _rules(kind):
    return RuleSet("fake0", kind, 125_000_000,
                   (Rule("web", Match(process=("nginx",)), 1_000_000),))


@pytest.mark.parametrize("psp", [False, True])
def test_auto_fallback_is_in_status_and_metrics(tmp_path, psp):
    fac = FakeFactory(psp=psp)
    with inprocess_daemon(tmp_path, _rules(BackendKind.AUTO), factory=fac,
                          sockdiag=FakeSockDiag(), tracer_enabled=False) as d:
        wait_for(lambda: d.status()["backend"] is not None, 5, what="a backend")
        st = d.status()
        assert st["backend_wanted"] == "auto"
        if psp:
            assert st["backend"] == "psp" and st["backend_fallback"] == ""
        else:
            assert st["backend"] == "htb" and st["backend_fallback"] == st["backend_reason"] != ""


def test_explicit_htb_is_no_fallback(tmp_path):
    with inprocess_daemon(tmp_path, _rules(BackendKind.HTB), factory=FakeFactory(),
                          sockdiag=FakeSockDiag(), tracer_enabled=False) as d:
        wait_for(lambda: d.status()["backend"] is not None, 5, what="a backend")
        assert d.status()["backend_wanted"] == "htb" and d.status()["backend_fallback"] == ""


def _view(**kw) -> DaemonView:
    v = dict(backend="htb", backend_reason="", interface="eth0", backend_health=BackendHealth.OK,
             backend_problem="", link_rate_bps=125_000_000, rules_path="/r.yaml", rule_names=(),
             flow_source=FlowSourceStatus(FlowSourceMode.NO_TRACER), tracer=None, live_flows=0,
             flows=(), stages=(), events=EventCounts(),
             counters=DaemonCounters(applies=0, op_errors=0, reloads_ok=0, reloads_failed=0,
                                     backend_rebuild_failures=0,
                                     apply_hist=Histogram((("+Inf", 0),), 0.0)))
    v.update(kw)
    return DaemonView(**v)


def _fallback_samples(view: DaemonView):
    from flowpacer.surfaces.metrics import FlowpacerCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FlowpacerCollector(lambda: view, lambda: {}))
    return [s for fam in text_string_to_metric_families(generate_latest(reg).decode())
            for s in fam.samples if s.name == "flowpacer_backend_fallback"]


def test_fallback_metric_names_wanted_used_and_reason():
    why = backend.refusal("sch_psp", KEY_REJECTED, "module.sig_enforce=1", "unsigned")
    reason = f"auto: psp unavailable ({why}), using htb"
    [s] = _fallback_samples(_view(backend_wanted="auto", backend_fallback=reason))
    assert s.labels == {"wanted": "psp", "used": "htb", "reason": reason,
                        "interface": "eth0"} and s.value == 1
    [s] = _fallback_samples(_view(backend="psp", backend_wanted="auto"))
    assert s.labels == {"wanted": "psp", "used": "psp", "reason": "", "interface": "eth0"} \
        and s.value == 0
    [s] = _fallback_samples(_view(backend="htb", backend_wanted="htb"))
    assert s.labels == {"wanted": "htb", "used": "htb", "reason": "", "interface": "eth0"} \
        and s.value == 0
