"""cgroup v2 BPF attachment helpers shared by the flow sources that attach cgroup programs
(first-byte's sock_ops, the tracer's UDP sock_addr/sock programs): where the cgroup v2 root is,
bpf(BPF_LINK_CREATE), and this network namespace's cookie."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
from typing import Optional, Tuple

from flowpacer.errors import TracerUnavailable

_SYS_BPF = 321             # x86-64
_BPF_LINK_CREATE = 28
SO_NETNS_COOKIE = 71
# enum bpf_attach_type (linux/bpf.h)
BPF_CGROUP_INET_EGRESS = 1
BPF_CGROUP_INET4_CONNECT = 10
BPF_CGROUP_INET6_CONNECT = 11
BPF_CGROUP_UDP4_SENDMSG = 14
BPF_CGROUP_UDP6_SENDMSG = 15
BPF_CGROUP_INET_SOCK_RELEASE = 34


def cgroup2_root(mounts: str = "/proc/self/mounts") -> Optional[str]:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified when hybrid);
    None when this mount namespace shows none (``ip netns exec`` remounts /sys)."""
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


def open_cgroup2_root(err=TracerUnavailable) -> Tuple[int, str]:
    """An fd of the cgroup v2 root directory and what it is. When no cgroup2 is mounted here, it
    is mounted on a private temporary directory, opened and detached at once (the fd keeps it)."""
    root = cgroup2_root()
    if root is not None:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), root
    import tempfile
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    d = tempfile.mkdtemp(prefix="fp-cgroup2-")
    try:
        if libc.mount(b"cgroup2", d.encode(), b"cgroup2", 0, None) != 0:
            no = ctypes.get_errno()
            raise err(f"cgroup v2 is not mounted and mounting it failed: {os.strerror(no)}")
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            libc.umount2(d.encode(), 2)     # MNT_DETACH
    finally:
        os.rmdir(d)
    return fd, "cgroup2 (mounted privately)"


def netns_cookie(err=TracerUnavailable) -> int:
    """The cookie of this process's network namespace (SO_NETNS_COOKIE, Linux 5.14)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8)
        except OSError as e:
            raise err(f"no network namespace cookie (SO_NETNS_COOKIE): {e.strerror}") from None
    return struct.unpack("<Q", raw)[0]


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """bpf(BPF_LINK_CREATE): an attachment that ends when its fd is closed."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    attr = (ctypes.c_uint32 * 16)(prog_fd, target_fd, attach_type, 0)
    fd = libc.syscall(ctypes.c_long(_SYS_BPF), ctypes.c_int(_BPF_LINK_CREATE), ctypes.byref(attr),
                      ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def netns_cookie_of(ino: int, err=TracerUnavailable) -> int:
    """The cookie of the network namespace with inode ``ino``: this process's, or one named in
    /run/netns or held by a process (read from a socket made in it by a short-lived thread that
    enters it; setns moves only the calling thread)."""
    if os.stat("/proc/self/ns/net").st_ino == ino:
        return netns_cookie(err)
    paths = [os.path.join("/run/netns", n) for n in _listdir("/run/netns")]
    paths += [f"/proc/{p}/ns/net" for p in _listdir("/proc") if p.isdigit()]
    for path in paths:
        try:
            if os.stat(path).st_ino != ino:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        out: list = []

        def enter_and_ask():
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                if libc.setns(fd, 0x40000000) != 0:          # CLONE_NEWNET
                    out.append(OSError(ctypes.get_errno(), "setns"))
                    return
                out.append(netns_cookie(err))
            except Exception as e:  # handed to the caller's thread
                out.append(e)
        import threading
        t = threading.Thread(target=enter_and_ask, name="netns-cookie")
        t.start()
        t.join()
        os.close(fd)
        if out and isinstance(out[0], int):
            return out[0]
        raise err(f"no cookie for network namespace {ino}: {out[0] if out else 'no answer'}")
    raise err(f"network namespace {ino} is not named in /run/netns nor held by a process")


def _listdir(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:
        return []
