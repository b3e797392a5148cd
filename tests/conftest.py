"""Fixtures of the host tests; the harness they use is the top-level ``harness`` package."""
import os

import pytest

from harness import checkmode

try:
    from hypothesis import HealthCheck, settings
except ImportError:          # hypothesis comes with the venv's test extra; guest runs lack it
    settings = None
else:
    # Property tests judge results, not speed: on a loaded 2-core machine (the VM lane runs
    # beside the host lane in `make test`) a slow example is not a failure. A test's own
    # @settings still sets max_examples; this only removes the timing checks.
    settings.register_profile("flowpacer", deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("flowpacer")

# Fixtures that need root and the running kernel (namespaces, qdiscs, the daemon): a test that
# uses one, directly or through another fixture, is marked `kernel` when collected, so `make
# check` leaves it out without anyone having to remember the marker.
KERNEL_FIXTURES = frozenset({"root", "testbed", "module_testbed", "daemon", "make_daemon"})

# Tests under tests/guest run inside the qemu VM (tests/test_vm.py boots it and runs them there).
if os.environ.get("FLOWPACER_IN_VM"):
    collect_ignore = ["test_vm.py"]          # the bridge runs on the host only
elif not os.environ.get("FLOWPACER_COLLECT_GUEST"):
    collect_ignore = ["guest"]


@pytest.hookimpl(tryfirst=True)          # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if KERNEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kernel)


def pytest_sessionstart(session):
    """make test's lanes (harness/lanes.py) each start with their guest phase: the timed lane
    holds vm.apart from its start until its real-clock guests are done; the untimed lane takes it
    when its virtual-clock guest is done and holds it to its end, so that the server VM and the
    Debian roots' builds never run beside a real-clock guest (harness/vm.py: why)."""
    from harness import lanes
    # taken out of the environment: a pytest this one starts (collections, the guest) is not
    # the lane and must not wait for the lock this process holds
    session.config._flowpacer_phase = lanes.GuestPhase(os.environ.pop(lanes.LANE_ENV, None))
    session.config._flowpacer_phase.start()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    phase = getattr(item.config, "_flowpacer_phase", None)
    if phase is not None:
        phase.before(item.nodeid)


def pytest_sessionfinish(session):
    phase = getattr(session.config, "_flowpacer_phase", None)
    if phase is not None:
        phase.finish()


def pytest_configure(config):
    """`make check` (FLOWPACER_CHECK=1): whatever needs root or the VM fails with the marker the
    test lacks (harness/checkmode.py)."""
    if checkmode.active():
        config._flowpacer_check_bin = checkmode.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """`make check`: a test that ran over checkmode.SLOW_LIMIT_S without the slow marker fails."""
    outcome = yield
    if not checkmode.active() or call.when != "call":
        return
    rep = outcome.get_result()
    why = checkmode.too_slow(item, call.duration)
    if why and rep.passed:
        rep.outcome = "failed"
        rep.longrepr = why


def pytest_unconfigure(config):
    bindir = getattr(config, "_flowpacer_check_bin", None)
    if bindir is not None:
        checkmode.uninstall_shims(bindir)


@pytest.fixture(scope="session")
def root():
    if checkmode.active():
        checkmode.refuse("use the root fixture")
    if os.geteuid() != 0:
        pytest.fail("these tests need root: they create network namespaces and qdiscs")


@pytest.fixture
def testbed(root):
    """A fresh two-namespace testbed (``harness.testbed.Testbed``), deleted after the test."""
    from harness.testbed import Testbed
    with Testbed() as tb:
        yield tb


@pytest.fixture(scope="module")
def module_testbed(root):
    """One testbed shared by the tests of a module (a suite that sets up real servers once)."""
    from harness.testbed import Testbed
    with Testbed() as tb:
        yield tb


@pytest.fixture
def daemon(testbed, tmp_path):
    """The daemon with ``harness.daemon.RULES`` in ``testbed`` (not started; stopped after)."""
    from harness.daemon import RULES, Daemon
    d = Daemon(testbed, tmp_path, RULES)
    yield d
    d.stop()


@pytest.fixture
def make_daemon(tmp_path):
    """``make_daemon(tb, rules_text, *extra, **kw)``: a ``harness.daemon.Daemon`` (not started)
    in the test's tmp_path (a second one in a sub-directory); stopped after the test."""
    from harness.daemon import Daemon
    made = []

    def make(tb, rules=None, *extra, **kw):
        d = tmp_path if not made else tmp_path / f"daemon{len(made)}"
        d.mkdir(exist_ok=True)
        made.append(Daemon(tb, d, rules, *extra, **kw))
        return made[-1]
    yield make
    for d in made:
        d.stop()


@pytest.fixture
def tmux(tmp_path):
    """A private tmux server (``harness.terminal.Tmux``), killed after the test."""
    from harness.terminal import Tmux
    t = Tmux(tmp_path)
    yield t
    t.close()
