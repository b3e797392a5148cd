"""The BPF objects (programs, maps, links) a process holds, and whether they still exist.

``held(pid)`` reads ``/proc/PID/fdinfo`` (a bpf fd's fdinfo names its ``prog_id``,
``map_id`` or ``link_id``); ``alive(held)`` asks the kernel for each by id
(``BPF_*_GET_FD_BY_ID``): after the process ended, whatever is still alive was left behind.
Parallel-safe: other daemons' objects (other tests, other users of the cgroup root) are never
looked at.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Dict, Set

_SYS_BPF = 321                 # x86-64
_GET_FD_BY_ID = {"prog": 13, "map": 14, "link": 30}
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def held(pid: int) -> Dict[str, Set[int]]:
    """kind ("prog", "map", "link") -> ids of the BPF objects ``pid`` has fds of. A link's
    fdinfo also names its program (counted as a program held)."""
    out: Dict[str, Set[int]] = {k: set() for k in _GET_FD_BY_ID}
    d = f"/proc/{pid}/fdinfo"
    for fd in os.listdir(d):
        try:
            with open(f"{d}/{fd}") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, val = line.partition(":")
            kind = key.strip()[:-3] if key.strip().endswith("_id") else ""
            if kind in out and val.strip().isdigit():
                out[kind].add(int(val))
    return out


def exists(kind: str, obj_id: int) -> bool:
    attr = (ctypes.c_uint32 * 4)(obj_id, 0, 0, 0)
    fd = _LIBC.syscall(ctypes.c_long(_SYS_BPF), ctypes.c_int(_GET_FD_BY_ID[kind]),
                       ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if fd >= 0:
        os.close(fd)
        return True
    err = ctypes.get_errno()
    if err != errno.ENOENT:
        raise OSError(err, f"bpf {kind} {obj_id}: {os.strerror(err)}")
    return False


def alive(objs: Dict[str, Set[int]]) -> Dict[str, Set[int]]:
    """The objects of ``objs`` that still exist (empty sets: nothing left)."""
    return {k: {i for i in ids if exists(k, i)} for k, ids in objs.items()}
