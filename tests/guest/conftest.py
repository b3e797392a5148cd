"""Fixtures for the tests that run inside the qemu test VM (tests/test_vm.py starts them).

- every test fails when the kernel logged a WARNING, BUG, Oops, a hung task ("blocked for more
  than"), a lockdep report, ... while it ran (``kmsg.BAD``; ``@pytest.mark.allow_dmesg(REGEX)``
  exempts matching lines);
- with ``FLOWPACER_GUEST_REPORT=FILE`` the outcome of every test is written to FILE (JSON)
  for the host-side bridge, after every test and with the test that is running, so that when
  the guest dies (a hung task panics it, vm/run.py) the host still knows what passed and which
  test was running;
- ``psp_module`` (sch_psp loaded), ``tb`` (a ``harness.testbed.Testbed`` with sch_psp loaded),
  ``bed`` (that testbed and a psp netlink socket in its sender namespace), ``big_rmem``.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kmsg  # noqa: E402
from harness import psplib  # noqa: E402

IN_VM = os.environ.get("FLOWPACER_IN_VM") == "1"


@pytest.fixture
def psp_module():
    """sch_psp is loaded (insmod'ed if it was not): a test that needs it fails, never skips,
    when the module file is missing or does not load."""
    try:
        psplib.ensure_loaded()
    except psplib.PspError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def tb(psp_module):
    """A two-namespace testbed (``harness.testbed.Testbed``) with sch_psp loaded; the module is
    loaded again after a test that unloaded it, as the next test expects."""
    from harness.testbed import Testbed
    with Testbed() as t:
        yield t
    psplib.ensure_loaded()


@pytest.fixture
def bed(tb):
    """(testbed, PspNl in its sender namespace): deleted after the test."""
    with psplib.PspNl(tb.sender_ns) as sock:
        yield tb, sock


@pytest.fixture
def big_rmem():
    """net.core.rmem_max at 4 MiB while the test runs (as on the project's host machines)."""
    with psplib.rmem_max(psplib.BIG_RMEM_MAX):
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_dmesg(regex): kernel log lines that may appear")


@pytest.fixture(autouse=True)
def dmesg_clean(request):
    """Fail the test if the kernel logged signs of a bug while it ran (teardown included)."""
    if not IN_VM:
        pytest.fail("tests/guest runs inside the test VM: use tests/test_vm.py or vm/run.py")
    reader = kmsg.KmsgReader()
    yield reader
    try:
        lines = reader.read_new()
    finally:
        reader.close()
    allowed = [re.compile(m.args[0]) for m in request.node.iter_markers("allow_dmesg")]
    bad = [ln for ln in kmsg.problems(lines) if not any(a.search(ln) for a in allowed)]
    if bad:
        pytest.fail("kernel log during the test:\n" + "\n".join(bad[:40]), pytrace=False)


# ----------------------------------------------------------------- report for the host

_REPORT = {}
_RUNNING = {"nodeid": None}


def _write_report(exitstatus):
    path = os.environ.get("FLOWPACER_GUEST_REPORT")
    if path:
        tmp = path + ".tmp"
        Path(tmp).write_text(json.dumps({"exitstatus": exitstatus, "running": _RUNNING["nodeid"],
                                         "tests": _REPORT}, indent=1))
        os.replace(tmp, path)


def pytest_runtest_logstart(nodeid, location):
    if os.environ.get("FLOWPACER_GUEST_REPORT"):
        _RUNNING["nodeid"] = nodeid
        _write_report(None)


def pytest_runtest_logfinish(nodeid, location):
    if os.environ.get("FLOWPACER_GUEST_REPORT"):
        _RUNNING["nodeid"] = None
        _write_report(None)


def pytest_runtest_logreport(report):
    if not os.environ.get("FLOWPACER_GUEST_REPORT"):
        return
    ent = _REPORT.setdefault(report.nodeid, {"outcome": "passed", "text": "", "duration": 0.0})
    ent["duration"] += report.duration
    if report.failed:
        ent["outcome"] = "failed"
        ent["text"] += f"--- {report.when} ---\n{report.longreprtext}\n"
    elif report.skipped and ent["outcome"] == "passed":
        if hasattr(report, "wasxfail"):
            ent["outcome"] = "xfailed"
            ent["text"] += report.wasxfail
        else:
            ent["outcome"] = "skipped"
            ent["text"] += (report.longrepr[2] if isinstance(report.longrepr, tuple)
                            else str(report.longrepr))
    for name, content in report.sections:
        if report.failed and content.strip():
            ent["text"] += f"--- {name} ---\n{content[-4000:]}\n"


def pytest_collectreport(report):
    if os.environ.get("FLOWPACER_GUEST_REPORT") and report.failed:
        _REPORT[f"collect:{report.nodeid}"] = {"outcome": "failed",
                                               "text": report.longreprtext, "duration": 0.0}


def pytest_sessionfinish(session, exitstatus):
    _RUNNING["nodeid"] = None
    _write_report(int(exitstatus))
