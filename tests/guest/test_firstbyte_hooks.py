"""Issue 16 on Debian's kernels (6.1, 6.12 with FLOWPACER_VM_KERNEL=6.12): the first-byte
programs load and attach there, and the cgroup bind/connect programs learn a socket's owner
(sock_ops on these kernels may not ask for the current task, so outbound rules naming a process
or user depend on them). One compile of the programs (minutes under TCG), no daemon: the owner
each hook stored is read back from the socket's storage (an sk_storage map is looked up by the
socket's fd), for IPv4, IPv6 and IPv4-mapped connects and for IPv4/IPv6 listeners, in a network
namespace of the test's own. The whole path (claims, pools, heads measured at the receiver) is
tests/test_firstbyte.py, on the host and by hand in the VM (docs/firstbyte.md)."""
from __future__ import annotations

import ctypes
import os
import socket
import struct

import pytest

from harness.testbed import in_netns

SYS_BPF, BPF_MAP_LOOKUP_ELEM = 321, 1
COMM = b"fp-up-cli"


def _owner(libc, map_fd: int, sock: socket.socket):
    """(pid, uid, comm) stored for ``sock``, or None."""
    key = ctypes.c_int(sock.fileno())
    val = ctypes.create_string_buffer(24)            # struct fb_owner
    attr = ctypes.create_string_buffer(struct.pack(
        "=IIQQQ", map_fd, 0, ctypes.addressof(key), ctypes.addressof(val), 0))
    if libc.syscall(ctypes.c_long(SYS_BPF), ctypes.c_int(BPF_MAP_LOOKUP_ELEM), attr,
                    ctypes.c_uint(len(attr))) != 0:
        return None
    pid, uid = struct.unpack_from("=II", val.raw)
    return pid, uid, val.raw[8:].split(b"\0", 1)[0]


@pytest.fixture
def netns():
    name = f"fpfbh{os.getpid() % 100000}"
    os.system(f"ip netns add {name} && ip -n {name} link set lo up")
    try:
        yield name
    finally:
        os.system(f"ip netns del {name}")


def test_bind_and_connect_hooks_tell_the_owner(netns):
    import bcc
    from flowpacer.sources import firstbyte
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    with in_netns(netns):
        fb = firstbyte.FirstByte()
        fb.start()                  # the netns cookie is this namespace's
    try:
        assert fb.owner_hooks == 4, "bind4/bind6/connect4/connect6 not all attached"
        map_fd = bcc.lib.bpf_table_fd(fb._bpf.module, b"fb_owner_st")
        old = ctypes.create_string_buffer(16)
        libc.prctl(16, old, 0, 0, 0)                     # PR_GET_NAME
        libc.prctl(15, COMM, 0, 0, 0)                    # PR_SET_NAME: the rule's process
        socks = []
        try:
            with in_netns(netns):
                socks += [socket.socket(socket.AF_INET), socket.socket(socket.AF_INET6)]
            socks[0].bind(("127.0.0.1", 7300))
            socks[1].bind(("::1", 7300))
            for s in socks:
                s.listen(8)
            for fam, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"),
                              (socket.AF_INET6, "::ffff:127.0.0.1")):
                with in_netns(netns):
                    c = socket.socket(fam)
                socks.append(c)
                c.connect((host, 7300))
            me = (os.getpid(), os.getuid(), COMM)
            got = [_owner(libc, map_fd, s) for s in socks]
            assert got == [me] * 5, got
            # a socket of another namespace is not looked at
            other = socket.socket()
            socks.append(other)
            other.bind(("127.0.0.1", 0))
            assert _owner(libc, map_fd, other) is None
        finally:
            libc.prctl(15, old, 0, 0, 0)
            for s in socks:
                s.close()
    finally:
        fb.close()
