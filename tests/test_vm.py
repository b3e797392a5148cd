"""Host-side bridge to the tests that run inside the qemu TCG VM (Debian's 6.1 kernel, or
``FLOWPACER_VM_KERNEL=6.12``).

The VM boots twice per pytest session (``guest_runs``, each boot only when a selected test
needs it): in virtual time (``vm.run.Clock.VIRTUAL``: exact guest time, one vCPU) for the
pacing tests (``VIRTUAL_FILES``), in plain TCG with two vCPUs for the rest; each boot runs its
share of ``pytest tests/guest``;
each guest test is one host test here (``test_guest[<guest test id>]``), collected on the
host with ``FLOWPACER_COLLECT_GUEST=1 pytest --collect-only -q tests/guest``. A VM that
cannot boot fails every test, with the console log; it never skips.

Before the boot the psp module is built on the host against the guest's kernel, from a copy of
``flowpacer/kernel/kmod`` in the session's tmp dir (so a build here never races one in the repo); the
guest tests load it from there (``FLOWPACER_PSP_KO``). ``test_psp_module_builds`` reports a
failed build with its log; the guest tests that need the module then fail too, never skip.
The departure capture's BPF object (``harness.xmitstamp.build_object``, clang) is built then
too, into the repo's cache the guest reads (``test_xmitstamp_object_builds``).

Extra kernels (``FLOWPACER_VM_EXTRA_KERNELS``, default "7.3": trixie-backports' kernel, which
tools/setup.sh unpacks; empty: none) get one more boot each, in real time, running the module,
netlink fuzz and daemon files (``EXTRA_KERNEL_FILES``) on that kernel with the module built for
it: ``test_guest_on_kernel[<series>:<guest test id>]`` and
``test_guest_run_clean_on_kernel[<series>]``, selectable on their own
(``-k on_kernel``, or deselected with ``-k "not on_kernel"``). A series equal to the main boot's
(``FLOWPACER_VM_KERNEL``) is not booted twice.

A guest kernel that reports a hung task panics (vm/run.py) and the run fails at once; the guest
writes its report after every test, so the tests that finished before keep their outcome, the
one that was running fails with the kernel's lines, the rest fail as not run.

Only the selected guest tests are run in the VM (``-k`` works as on the host).
``FLOWPACER_VM_TIMEOUT`` (seconds, default 2400) bounds the guest run: a hang's bound, not a
speed target (the virtual-clock batch took 1 221 s under load in rehearsal ci28 and passed 1 500
in ci29, at load 5, after it grew). The guest's result
files (guest.xml, guest-report.json, pacing-figures.txt, console.log, dmesg.txt) stay in the
session's pytest tmp dir (``vm-virtual0``, ``vm-real0``); ``test_guest_run_clean`` prints
where, and the figures.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUEST_REL = "tests/guest"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vm import build as vmbuild  # noqa: E402
from vm import kmod as vmkmod  # noqa: E402
from vm import run as vmrun  # noqa: E402
from harness import vm as hvm  # noqa: E402

pytestmark = pytest.mark.vm

if os.environ.get("FLOWPACER_IN_VM"):
    pytest.skip("this is the VM already: the bridge runs on the host", allow_module_level=True)

SELF_TEST_LINE = "flowpacer dmesg self-test"   # written on purpose by a guest test
TIMEOUT_S = float(os.environ.get("FLOWPACER_VM_TIMEOUT", "2400"))


def host_import_s(runs: int = 3) -> float:
    """Seconds a fresh interpreter takes here to import the daemon (best of ``runs``): the guest
    measures the same and so knows how much slower TCG runs the daemon than this host."""
    best = float("inf")
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import flowpacer.daemon.app"], cwd=REPO, check=True,
                       timeout=120)
        best = min(best, time.monotonic() - t)
    return best
# a boot that hangs or regresses badly, not a speed target (bench/ has those): the virtual-clock
# boot runs in make test's low-priority lane, where a busy host may slow it a few times
BOOT_LIMIT_S = 150.0


def _collect_guest_ids():
    env = dict(os.environ, FLOWPACER_COLLECT_GUEST="1")
    env.pop("FLOWPACER_IN_VM", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             GUEST_REL], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return [], "collecting tests/guest on the host took over 300 s"
    ids = [ln.strip() for ln in proc.stdout.splitlines()
           if ln.startswith(GUEST_REL + "/") and "::" in ln]
    if proc.returncode != 0 or not ids:
        return [], f"collecting {GUEST_REL} failed (exit {proc.returncode}):\n" \
                   f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    return ids, ""


GUEST_IDS, COLLECT_ERROR = _collect_guest_ids()


# Guest test files run in virtual time (vm/run.py Clock.VIRTUAL: exact guest time, one vCPU),
# the boot of make test's untimed lane: every pacing test (each of these modules also fails by
# itself outside virtual time), and the UDP idle-out and first-byte hook tests, which mostly
# wait for the daemon's timers: idle time costs no host time there (measured: 29.6 s against
# 50 s in real time for the hooks; the two UDP files 4.5 min with their own boot against 2.2
# min of the real-time run's), and their outcome no longer depends on the host's load.
VIRTUAL_FILES = ("test_psp_pacing.py", "test_stock_pacing.py", "test_udp_pacing.py",
                 "test_psp_aggregates.py", "test_access_pacing.py", "test_psp_udp_daemon.py",
                 "test_udp_tracer.py", "test_firstbyte_hooks.py", "test_bond_pacing.py",
                 "test_bond_vlan.py", "test_psp_upload.py", "test_psp_flashcrowd.py",
                 "test_vrf.py")


# Guest test files also run on each extra kernel (FLOWPACER_VM_EXTRA_KERNELS): the module, its
# netlink fuzzer and the daemon on psp; all in real time.
EXTRA_KERNEL_FILES = ("test_psp_module.py", "test_psp_fuzz.py", "test_psp_daemon.py")


def _main_series() -> str:
    try:
        return vmbuild.find_kernel().version
    except vmbuild.BuildError:
        return ""


def _extra_kernels():
    """The extra kernel series to boot, without the main boot's own."""
    want = [k.strip() for k in os.environ.get("FLOWPACER_VM_EXTRA_KERNELS", "7.3").split(",")
            if k.strip()]
    main = _main_series()
    return [k for k in want if not main.startswith(k.rstrip(".") + ".")]


EXTRA_KERNELS = _extra_kernels()
EXTRA_IDS = [f"{k}:{i[len(GUEST_REL) + 1:]}" for k in EXTRA_KERNELS for i in GUEST_IDS
             if i[len(GUEST_REL) + 1:].split("::", 1)[0] in EXTRA_KERNEL_FILES]


def clock_of(guest_id: str) -> vmrun.Clock:
    """The VM clock a guest test runs under (its file decides)."""
    name = guest_id.split("::", 1)[0].rsplit("/", 1)[-1]
    return vmrun.Clock.VIRTUAL if name in VIRTUAL_FILES else vmrun.Clock.REAL


class GuestRun:
    """One VM boot running the selected guest tests of one clock (and kernel)."""

    def __init__(self, clock: vmrun.Clock, series: str = ""):
        self.clock = clock
        self.series = series     # "" : FLOWPACER_VM_KERNEL's; else an extra kernel series
        self.result = None       # vmrun.VMResult
        self.error = None        # vmrun.VMError
        self.report = None       # {"exitstatus": int|None, "running": id|None, "tests": {...}}
        self.selected = []
        self.error_shown = False

    def output_tail(self, n: int = 60) -> str:
        out = self.result.output if self.result else (self.error.output if self.error else "")
        return "\n".join(out.rstrip().splitlines()[-n:])

    def finished_entry(self, guest_id: str):
        """This test's entry in the guest's report once it finished, else None (also for the
        test that was running when the guest died)."""
        if self.report is None:
            return None
        nodeid = f"{GUEST_REL}/{guest_id}"
        if self.error is not None and self.report.get("running") == nodeid:
            return None
        return self.report["tests"].get(nodeid)

    def fail_if_no_vm(self, guest_id: str = ""):
        if self.error is not None:
            running = (self.report or {}).get("running")
            where = ""
            if guest_id and running == f"{GUEST_REL}/{guest_id}":
                where = "the VM died while this test ran: "
            elif guest_id and running:
                where = f"not run: the VM died while {running} ran: "
            if not self.error_shown:
                self.error_shown = True
                pytest.fail(where + self.error.details(80), pytrace=False)
            pytest.fail(f"{where}{self.error} (console log: see the first failing test_vm test)",
                        pytrace=False)


class GuestRuns:
    """The session's VM boots, one per clock, each made when a test first needs it."""

    def __init__(self, request, tmp_path_factory):
        self.tmp = tmp_path_factory
        items = [it for it in request.session.items if getattr(it, "callspec", None)]
        selected = [f"{GUEST_REL}/{it.callspec.params['guest_id']}"
                    for it in items if "guest_id" in it.callspec.params]
        self.selected = selected or list(GUEST_IDS)
        extra = [it.callspec.params["kernel_guest_id"] for it in items
                 if "kernel_guest_id" in it.callspec.params]
        self.extra_selected = extra or list(EXTRA_IDS)   # "<series>:<guest id>"
        self.runs: dict = {}
        self.psp_ko = None       # the module built for the guest
        self.psp_build_error = None
        self.xmitstamp_build_error = None
        self.extra_ko: dict = {}        # series -> module file or KmodError text
        self._built = False

    def _build_extra(self, series: str):
        if series not in self.extra_ko:
            try:
                self.extra_ko[series] = vmkmod.build_psp(self.tmp.mktemp(f"kmod-{series}"),
                                                         series=series)
            except vmkmod.KmodError as e:
                self.extra_ko[series] = str(e)
        return self.extra_ko[series]

    def _build(self):
        if not self._built:
            self._built = True
            try:
                self.psp_ko = vmkmod.build_psp(self.tmp.mktemp("kmod"))
            except vmkmod.KmodError as e:
                self.psp_build_error = str(e)
            # the departure capture's BPF object, cached in the repo where the guest finds it
            # (tests/guest/test_xmitstamp.py fails when it is missing)
            from harness.xmitstamp import XmitStampError, build_object
            try:
                build_object()
            except XmitStampError as e:
                self.xmitstamp_build_error = str(e)

    def clocks(self):
        return sorted({clock_of(i[len(GUEST_REL) + 1:]) for i in self.selected},
                      key=lambda c: c.value)

    def get(self, clock: vmrun.Clock, series: str = "") -> GuestRun:
        if (clock, series) not in self.runs:
            self.runs[(clock, series)] = self._boot(clock, series)
        return self.runs[(clock, series)]

    def _boot(self, clock: vmrun.Clock, series: str = "") -> GuestRun:
        gr = GuestRun(clock, series)
        if series:     # an extra kernel: its share of EXTRA_KERNEL_FILES, real time
            gr.selected = [f"{GUEST_REL}/{i.split(':', 1)[1]}" for i in self.extra_selected
                           if i.split(":", 1)[0] == series]
            mine = [f"{GUEST_REL}/{i.split(':', 1)[1]}" for i in EXTRA_IDS
                    if i.split(":", 1)[0] == series]
        else:
            gr.selected = [i for i in self.selected if clock_of(i[len(GUEST_REL) + 1:]) is clock]
            mine = [i for i in GUEST_IDS if clock_of(i[len(GUEST_REL) + 1:]) is clock]
        if set(gr.selected) >= set(mine):      # the whole group: by file, as collected there
            targets = sorted({i.split("::", 1)[0] for i in mine})
        else:
            targets = gr.selected
        self._build()
        out = self.tmp.mktemp(f"vm-{clock.value}" + (f"-{series}-" if series else ""))
        report = out / "guest-report.json"
        env = {k: v for k, v in os.environ.items()
               if k.startswith("FLOWPACER_")
               and k not in ("FLOWPACER_COLLECT_GUEST", "FLOWPACER_IN_VM", "FLOWPACER_VM_CLOCK")}
        env["FLOWPACER_GUEST_REPORT"] = str(report)
        ko = self._build_extra(series) if series else self.psp_ko
        env["FLOWPACER_PSP_KO"] = str(ko if isinstance(ko, Path) else out / "kmod" / "sch_psp.ko")
        if series:
            env["FLOWPACER_VM_KERNEL"] = series
        # the guest scales host time limits by how much slower the emulator runs the daemon's code
        env.setdefault("FLOWPACER_HOST_IMPORT_S", f"{host_import_s():.4f}")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
               f"--junitxml={out / 'guest.xml'}", *targets]
        # a real-clock guest never shares the host with the server VM (harness/vm.apart)
        held = (hvm.apart(f"the {series or 'main'} kernel's real-clock guest")
                if clock is vmrun.Clock.REAL else contextlib.nullcontext())
        try:
            with held:
                gr.result = vmrun.run(cmd, cwd=str(REPO), timeout=TIMEOUT_S, env=env,
                                      out_dir=out, clock=clock, kernel=series or None)
        except vmrun.VMError as e:
            gr.error = e
        try:    # after a crash too: what the guest reported before it died
            gr.report = json.loads(report.read_text())
        except (OSError, ValueError):
            gr.report = None
        return gr


@pytest.fixture(scope="session")
def guest_runs(request, tmp_path_factory):
    """The VM boots of this session (``GuestRuns.get(clock)`` boots on first use)."""
    return GuestRuns(request, tmp_path_factory)


def _check_guest_test(guest_run: GuestRun, guest_id: str) -> None:
    ent = guest_run.finished_entry(guest_id)
    if guest_run.error is not None and ent is None:
        guest_run.fail_if_no_vm(guest_id)
    if guest_run.error is not None:
        _check_entry(ent)
        return
    res = guest_run.result
    if res.timed_out:
        pytest.fail(f"the guest test run hit its {TIMEOUT_S:.0f} s timeout:\n"
                    f"{guest_run.output_tail()}", pytrace=False)
    if guest_run.report is None:
        pytest.fail(f"the guest pytest wrote no report (exit {res.rc}):\n{guest_run.output_tail()}",
                    pytrace=False)
    if ent is None:
        pytest.fail(f"the guest did not report this test (exit {res.rc}):\n"
                    f"{guest_run.output_tail()}", pytrace=False)
    _check_entry(ent)


def _check_entry(ent: dict) -> None:
    if ent["outcome"] == "failed":
        pytest.fail(f"failed in the VM ({ent['duration']:.1f} s):\n{ent['text']}", pytrace=False)
    if ent["outcome"] == "skipped":
        pytest.skip(f"skipped in the VM: {ent['text']}")
    if ent["outcome"] == "xfailed":
        pytest.xfail(f"xfailed in the VM: {ent['text']}")
    assert ent["outcome"] == "passed"


def _guest_param(guest_id: str):
    """A guest test's id; on the virtual clock its figures do not depend on the host's load."""
    if guest_id != "collection" and clock_of(guest_id) is vmrun.Clock.VIRTUAL:
        return pytest.param(guest_id, marks=pytest.mark.untimed)
    return guest_id


@pytest.mark.parametrize("guest_id", [_guest_param(i[len(GUEST_REL) + 1:]) for i in GUEST_IDS]
                         or ["collection"])
def test_guest(guest_runs, guest_id):
    if COLLECT_ERROR:
        pytest.fail(COLLECT_ERROR, pytrace=False)
    _check_guest_test(guest_runs.get(clock_of(guest_id)), guest_id)


@pytest.mark.parametrize("kernel_guest_id", EXTRA_IDS or ["none"])
def test_guest_on_kernel(guest_runs, kernel_guest_id):
    """The module, fuzz and daemon guest tests again on an extra kernel (trixie-backports' 7.3:
    the qdisc's init once deadlocked there), one boot per kernel."""
    if COLLECT_ERROR:
        pytest.fail(COLLECT_ERROR, pytrace=False)
    if not EXTRA_IDS:
        pytest.skip("no extra kernel to boot (FLOWPACER_VM_EXTRA_KERNELS)")
    series, guest_id = kernel_guest_id.split(":", 1)
    guest_run = guest_runs.get(vmrun.Clock.REAL, series)
    ko = guest_runs.extra_ko.get(series)
    if not isinstance(ko, Path) and ko is not None:
        pytest.fail(f"the psp module does not build for {series}:\n{ko}", pytrace=False)
    _check_guest_test(guest_run, guest_id)


@pytest.mark.parametrize("series", EXTRA_KERNELS or ["none"])
def test_guest_run_clean_on_kernel(guest_runs, series, record_property):
    """Each extra kernel's boot started in time, ran to the end, and its whole kernel log has no
    WARNING/BUG/Oops/hung task/lockdep line."""
    if COLLECT_ERROR:
        pytest.fail(COLLECT_ERROR, pytrace=False)
    if not EXTRA_KERNELS:
        pytest.skip("no extra kernel to boot (FLOWPACER_VM_EXTRA_KERNELS)")
    if not any(i.split(":", 1)[0] == series for i in guest_runs.extra_selected):
        pytest.skip(f"no guest test selected on {series}")
    _check_run_clean(guest_runs.get(vmrun.Clock.REAL, series), record_property,
                     f"vm_{series}_real")


@pytest.mark.untimed
@pytest.mark.parametrize("series", vmbuild.KERNEL_SERIES)
def test_psp_module_builds_without_warnings(series, tmp_path):
    """The module builds at W=1 without a warning against each kernel the project supports
    (Debian 12's 6.1, Debian 13's 6.12); the VM suite runs on FLOWPACER_VM_KERNEL's (6.1 in
    make test)."""
    ko = vmkmod.build_psp(tmp_path / "kmod", series=series, strict=True)
    assert ko.is_file()


def test_psp_module_builds(guest_runs):
    """The psp module builds against the guest's kernel headers (the guest tests load it)."""
    guest_runs._build()
    assert guest_runs.psp_build_error is None, guest_runs.psp_build_error
    assert guest_runs.psp_ko is not None and guest_runs.psp_ko.is_file()


def test_xmitstamp_object_builds(guest_runs):
    """The capture's CO-RE object builds on the host (the guest loads it, never compiles)."""
    guest_runs._build()
    assert guest_runs.xmitstamp_build_error is None, guest_runs.xmitstamp_build_error


@pytest.mark.parametrize("clock", [pytest.param(c, marks=pytest.mark.untimed)
                                   if c is vmrun.Clock.VIRTUAL else c for c in vmrun.Clock],
                         ids=[c.value for c in vmrun.Clock])
def test_guest_run_clean(guest_runs, clock, record_property):
    """Each VM boot (one per clock) started in time, its pytest ran to the end, and the whole
    kernel log of the run (boot, tests, module unloads after the tests) has no
    WARNING/BUG/Oops/... line."""
    if COLLECT_ERROR:
        pytest.fail(COLLECT_ERROR, pytrace=False)
    if clock not in guest_runs.clocks():
        pytest.skip(f"no guest test of the {clock.value} clock selected")
    _check_run_clean(guest_runs.get(clock), record_property, f"vm_{clock.value}")


def _check_run_clean(guest_run: GuestRun, record_property, prop: str) -> None:
    clock = guest_run.clock
    guest_run.fail_if_no_vm()
    res = guest_run.result
    record_property(f"{prop}_boot_s", round(res.boot_s, 2))
    record_property(f"{prop}_wall_s", round(res.wall_s, 2))
    print(f"VM ({res.kernel}, {clock.value} clock): command started {res.boot_s:.1f} s after "
          f"qemu, whole run {res.wall_s:.1f} s; files in {res.out_dir}")
    figures = res.out_dir / "pacing-figures.txt"
    if figures.exists():
        print(figures.read_text())
    assert res.boot_s < BOOT_LIMIT_S, f"boot took {res.boot_s:.1f} s"
    bad = [ln for ln in res.dmesg_problems() if SELF_TEST_LINE not in ln]
    assert not bad, "guest kernel log:\n" + "\n".join(bad[:40])
    assert guest_run.report is not None, guest_run.output_tail()
    assert guest_run.report["exitstatus"] in (0, 1), guest_run.output_tail()
    unknown = [n for n in guest_run.report["tests"]
               if n not in GUEST_IDS and n.startswith(GUEST_REL)]
    wrong = [n for n in guest_run.report["tests"]
             if n.startswith(GUEST_REL) and not guest_run.series
             and clock_of(n[len(GUEST_REL) + 1:]) is not clock]
    assert not wrong, f"guest tests run under the wrong clock: {wrong}"
    assert not unknown, f"guest tests the host did not collect: {unknown}"
    collect_errors = {n: e["text"] for n, e in guest_run.report["tests"].items()
                      if n.startswith("collect:")}
    assert not collect_errors, f"collection errors in the VM: {collect_errors}"


def test_kernel_log_checks_catch_hung_tasks_and_lockdep():
    """The guest's per-test check (tests/guest/kmsg.py) and the host's whole-log check use one
    pattern, and it fails a run on the hung-task detector's and lockdep's reports (and a panic),
    not on the kernel's echo of the command line that sets the hung-task timeout."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("guest_kmsg", REPO / GUEST_REL / "kmsg.py")
    guest_kmsg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guest_kmsg)
    assert guest_kmsg.BAD is vmrun.DMESG_BAD
    bad = ["[   42.1] INFO: task python3:812 blocked for more than 20 seconds.",
           "[   42.1]       Tainted: G           OE      7.3.4+deb13-amd64 #1 Debian",
           "WARNING: possible circular locking dependency detected",
           "WARNING: possible recursive locking detected",
           "WARNING: inconsistent lock state",
           "BUG: sleeping function called from invalid context at kernel/locking/mutex.c:580",
           "[   60.0] Kernel panic - not syncing: hung_task: blocked tasks"]
    fine = [f"Kernel command line: console=ttyS0 panic=-1 {vmrun._hung_task_append(c)}"
            for c in vmrun.Clock] + ["veth0: link becomes ready", "sch_psp: loading out-of-tree"]
    found = vmrun.dmesg_problems("\n".join(bad + fine))
    assert found == [ln for ln in bad if "Tainted" not in ln]
    assert guest_kmsg.problems(bad + fine) == found


def test_guest_outcomes_after_the_guest_died():
    """When the guest dies mid-run (a hung task panics it), the tests it reported finished keep
    their outcome, the one that was running fails with the kernel's lines, the rest fail as not
    run: nothing passes or skips for lack of a result."""
    gr = GuestRun(vmrun.Clock.REAL, "7.3")
    gr.error = vmrun.VMError("VM run failed: the guest stopped before the command finished; "
                             "the guest kernel reported: INFO: task python3:812 blocked for "
                             "more than 20 seconds.", console="console tail")
    gr.report = {"exitstatus": None, "running": f"{GUEST_REL}/test_m.py::test_hangs",
                 "tests": {f"{GUEST_REL}/test_m.py::test_ok": {"outcome": "passed", "text": "",
                                                               "duration": 1.0},
                           f"{GUEST_REL}/test_m.py::test_hangs": {"outcome": "passed",
                                                                  "text": "", "duration": 0.0}}}
    _check_guest_test(gr, "test_m.py::test_ok")          # finished before: passes
    with pytest.raises(pytest.fail.Exception, match="died while this test ran.*blocked for more"):
        _check_guest_test(gr, "test_m.py::test_hangs")
    with pytest.raises(pytest.fail.Exception, match="not run: the VM died while .*test_hangs"):
        _check_guest_test(gr, "test_m.py::test_later")


def test_kernel_version_differences_only_in_psp_compat_h():
    """Kernel version tests live in one small header (flowpacer/kernel/kmod/psp_compat.h), on the
    kernel's own macros; the module's other sources have none (no LINUX_VERSION_CODE, no
    __has_include guessing), and the ethtool read that deadlocked on 7.2+ goes through it."""
    kmod = REPO / "flowpacer" / "kernel" / "kmod"
    for name in ("sch_psp.c", "psp_sched.h", "psp_tree.h", "uapi/pkt_sch_psp.h"):
        text = (kmod / name).read_text()
        assert "LINUX_VERSION_CODE" not in text and "__has_include" not in text, name
        assert not re.search(r"__ethtool_get_link_ksettings\(\s*\w", text), name   # no call
    compat = (kmod / "psp_compat.h").read_text()
    assert "KERNEL_VERSION(7, 2, 0)" in compat and "netif_get_link_ksettings" in compat
    assert '#include "psp_compat.h"' in (kmod / "sch_psp.c").read_text()
    assert "psp_compat.h" in vmkmod.SOURCES
