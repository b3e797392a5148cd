import os

import pytest

# Tests under tests/guest run inside the qemu VM (tests/test_vm.py boots it and runs them there).
if os.environ.get("FLOWPACER_IN_VM"):
    collect_ignore = ["test_vm.py"]          # the bridge runs on the host only
elif not os.environ.get("FLOWPACER_COLLECT_GUEST"):
    collect_ignore = ["guest"]


@pytest.fixture(scope="session")
def root():
    if os.geteuid() != 0:
        pytest.fail("these tests need root: they create network namespaces and qdiscs")


@pytest.fixture
def testbed(root):
    from flowpacer.testbed import Testbed
    with Testbed() as tb:
        yield tb
