"""The departure capture (``harness.xmitstamp``, the CO-RE program the VM pacing benchmarks
use with ``--capture bpf``) on Debian's kernels (6.1; 6.12 with FLOWPACER_VM_KERNEL=6.12):
the same checks as tests/test_xmitstamp.py on the host (``harness.xmitcases``). The object is
built on the host before the boot (tests/test_vm.py); libbpf fits it to this kernel's BTF."""
from __future__ import annotations

import time

import pytest

from harness import xmitcases
from harness.testbed import Testbed
from harness.xmitstamp import XmitStamps, build_object, object_path


@pytest.fixture
def bed():
    with Testbed() as t:
        yield t


def test_object_prebuilt_and_loads(bed):
    """The host built the object (no clang run under TCG) and it loads and attaches here."""
    assert object_path().is_file(), f"{object_path()} not built on the host"
    assert build_object() == object_path()
    t = time.monotonic()
    with XmitStamps(bed.server_ns, bed.server_if, slots=1 << 20):
        loaded = time.monotonic() - t
    print(f"xmitstamp load+attach with 2^20 slots: {loaded:.3f} s")


def test_records_exactly_the_datagrams_sent(bed):
    xmitcases.check_exact(bed)


def test_full_array_counts_drops(bed):
    xmitcases.check_overflow(bed)


def test_gso_size_of_tcp_skbs(bed):
    xmitcases.check_tcp_gso(bed)


def test_nothing_left_in_the_kernel(bed):
    xmitcases.check_nothing_left(bed)
