"""The departure capture (``harness.xmitstamp``: a CO-RE BPF program on net_dev_start_xmit,
loaded through libbpf) on the host's kernel; tests/guest/test_xmitstamp.py runs the same checks
(``harness.xmitcases``) on Debian's 6.1 and 6.12 in the VM."""
from __future__ import annotations

import pytest

from harness import xmitcases, xmitstamp
from harness.xmitstamp import XmitStampError, XmitStamps, build_object, object_path


def test_records_exactly_the_datagrams_sent(testbed):
    xmitcases.check_exact(testbed)


def test_full_array_counts_drops(testbed):
    xmitcases.check_overflow(testbed)


def test_gso_size_of_tcp_skbs(testbed):
    xmitcases.check_tcp_gso(testbed)


def test_nothing_left_in_the_kernel(testbed):
    xmitcases.check_nothing_left(testbed)


def test_errors_are_one_line(testbed, tmp_path):
    with pytest.raises(XmitStampError, match=r"^device nosuchdev in namespace .*: ") as e:
        XmitStamps(testbed.server_ns, "nosuchdev").__enter__()
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.o"
    bad.write_bytes(build_object().read_bytes()[:200])      # a truncated ELF file
    with pytest.raises(XmitStampError) as e:
        XmitStamps(testbed.server_ns, testbed.server_if, obj=bad).__enter__()
    assert "\n" not in str(e.value) and str(bad) in str(e.value), str(e.value)


def test_object_cached_by_source_hash(tmp_path, monkeypatch):
    """Built once per source into the cache (what the host does before a VM boot); without
    clang a one-line reason, not a traceback."""
    obj = build_object(tmp_path)
    assert obj == object_path(tmp_path) and obj.read_bytes()[:4] == b"\x7fELF"
    mtime = obj.stat().st_mtime_ns
    assert build_object(tmp_path) == obj and obj.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [obj.name]       # no temporary file left
    monkeypatch.setattr(xmitstamp, "CLANG", "no-such-clang")
    with pytest.raises(XmitStampError, match=r"^no-such-clang not found: .*clang"):
        build_object(tmp_path / "empty")
