"""Packet departure times from the kernel itself: ``XmitStamps`` (bcc, ``harness/bpf/xmitstamp.c``).

A raw tracepoint on ``net_dev_start_xmit`` writes the time and headers of every skb one device
hands its driver into a BPF array; nothing runs in user space per packet. That is where
tcpdump's egress tap stamps too, without tcpdump's process competing with the traffic for a
one-vCPU guest. The array holds ``slots`` records; what did not fit is counted in ``drops`` (a
run with drops is not a result, as with tcpdump).

    with XmitStamps(ns, dev) as xs:
        ...                                     # traffic
    xs.records  # [XmitRecord(ts_ns, length, gso_size, sport, dport, proto, l4_off, l4_hdr), ...]
"""
from __future__ import annotations

import ctypes as ct
import dataclasses
import logging
import os
import socket
import struct
from pathlib import Path
from typing import List, Optional

from flowpacer.testbed import in_netns

log = logging.getLogger(__name__)

BPF_SRC = Path(__file__).with_name("bpf") / "xmitstamp.c"
_REC = struct.Struct("<QIHHHHHBB")     # struct xs_rec


class XmitStampError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class XmitRecord:
    ts_ns: int          # CLOCK_MONOTONIC
    length: int         # skb->len (frame bytes, all segments of a GSO skb)
    gso_size: int
    sport: int
    dport: int
    proto: int          # 6 TCP, 17 UDP, 0 other
    l4_off: int         # L4 header offset from the frame's start, 0: not TCP/UDP over IP
    l4_hdr: int

    @property
    def payload(self) -> int:
        return self.length - self.l4_off - self.l4_hdr if self.l4_off else 0


def _ifindex(ns: str, dev: str) -> int:
    with in_netns(ns):
        return socket.if_nametoindex(dev)


_COMPILED: dict = {}     # slots -> the loaded bcc.BPF (compiling costs minutes in the TCG guest)


def _program(slots: int):
    b = _COMPILED.get(slots)
    if b is None:
        try:
            import bcc
        except Exception as e:
            raise XmitStampError(f"bcc is not importable: {e}") from None
        try:
            b = bcc.BPF(src_file=str(BPF_SRC).encode(), cflags=[f"-DXS_SLOTS={slots}"])
        except Exception as e:
            raise XmitStampError(f"xmitstamp.c did not load: {e}") from None
        # bcc attached RAW_TRACEPOINT_PROBE at load; each capture attaches it for its own span
        b.detach_raw_tracepoint(b"net_dev_start_xmit")
        _COMPILED[slots] = b
    return b


class XmitStamps:
    """One capture: the program (compiled once per process and size) is pointed at ``dev`` in
    ``ns``, its counters cleared, attached for the ``with`` block and detached at the end."""

    def __init__(self, ns: str, dev: str, slots: int = 1 << 20):
        self.ns, self.dev, self.slots = ns, dev, slots
        self.records: List[XmitRecord] = []
        self.drops = 0
        self._bpf = None

    def __enter__(self) -> "XmitStamps":
        idx = _ifindex(self.ns, self.dev)
        b = _program(self.slots)
        conf, cnt = b["xs_conf"], b["xs_count"]
        cnt[ct.c_int(0)] = ct.c_uint64(0)
        cnt[ct.c_int(1)] = ct.c_uint64(0)
        conf[ct.c_int(0)] = ct.c_uint64(idx)
        b.attach_raw_tracepoint(tp=b"net_dev_start_xmit", fn_name=b"raw_tracepoint__net_dev_start_xmit")
        self._bpf = b
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> List[XmitRecord]:
        """Detach and read the records (idempotent)."""
        b, self._bpf = self._bpf, None
        if b is None:
            return self.records
        b.detach_raw_tracepoint(b"net_dev_start_xmit")
        b["xs_conf"][ct.c_int(0)] = ct.c_uint64(0)
        cnt = b["xs_count"]
        written = cnt[ct.c_int(0)].value
        self.drops = cnt[ct.c_int(1)].value
        self.records = self._read(b["xs_recs"], min(written, self.slots))
        return self.records

    @staticmethod
    def _read(table, n: int) -> List[XmitRecord]:
        """The first ``n`` records in one BPF_MAP_LOOKUP_BATCH (an array's batch goes in key
        order), unpacked from the raw buffer: no Python object per map entry until the end."""
        if n == 0:
            return []
        from bcc.libbcc import lib
        size = ct.sizeof(table.Leaf)
        if size != _REC.size:
            raise XmitStampError(f"struct xs_rec is {size} bytes, {_REC.size} expected")
        keys = (ct.c_uint32 * n)()
        vals = ct.create_string_buffer(size * n)
        out_batch = ct.c_uint32(0)
        got, buf = 0, memoryview(vals)
        while got < n:
            count = ct.c_uint32(n - got)
            res = lib.bpf_lookup_batch(table.map_fd, ct.byref(out_batch) if got else None,
                                       ct.byref(out_batch), ct.byref(keys, 4 * got),
                                       ct.byref(vals, size * got), ct.byref(count))
            err = ct.get_errno()
            got += count.value
            if res != 0:
                if err == 2 or count.value:   # ENOENT: the end of the array
                    break
                raise XmitStampError(f"BPF_MAP_LOOKUP_BATCH failed: {os.strerror(err)}")
            if count.value == 0:
                break
        return [XmitRecord(ts_ns=ts, length=ln, gso_size=gso, sport=sp, dport=dp, proto=pr,
                           l4_off=off, l4_hdr=hl)
                for ts, ln, gso, off, sp, dp, hl, pr, _ in
                _REC.iter_unpack(bytes(buf[:size * min(got, n)]))]
