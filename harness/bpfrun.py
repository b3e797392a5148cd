"""Run a loaded BPF program once with ``BPF_PROG_TEST_RUN`` (bpf(2) command 10), without
attaching it: for programs of a type the kernel test-runs without packet data (raw_tracepoint,
syscall). The program's return value is returned; what it computed is in its maps."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_SYS_BPF = 321                 # x86-64
_BPF_PROG_TEST_RUN = 10
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


class _TestAttr(ctypes.Structure):
    """union bpf_attr, the BPF_PROG_TEST_RUN member (uapi/linux/bpf.h)."""
    _fields_ = [("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
                ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
                ("batch_size", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


def run_once(prog_fd: int) -> int:
    """Run the program once (no context, no data); its return value. OSError on refusal."""
    attr = _TestAttr(prog_fd=prog_fd)
    if _LIBC.syscall(ctypes.c_long(_SYS_BPF), ctypes.c_int(_BPF_PROG_TEST_RUN),
                     ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr))) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN: {os.strerror(err)}")
    return attr.retval
