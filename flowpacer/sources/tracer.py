"""eBPF (bcc) flow tracer: TCP and UDP flow OPEN/CLOSE events of target processes.

The BPF program is ``flowpacer/sources/bpf/flowtrace.c`` (its header comment explains the
hooks and the per-socket state machine) with ``udptrace.c`` compiled into it (UDP:
connected sockets from connect(), each peer of an unconnected socket from its send
calls, close at socket release; its header comment explains them). This module checks what bcc needs,
compiles and attaches the program, keeps the in-kernel watch filter up to date
and turns ring buffer records into :class:`model.FlowEvent`.

Only tracepoints are used for TCP (``sock:inet_sock_set_state`` and
``syscalls:sys_exit_accept{,4}``): they exist on every kernel we target, unlike
kprobes (absent here) and fentry (refused here). UDP adds the tracepoints
``syscalls:sys_{enter,exit}_connect`` and three cgroup programs on the cgroup v2
root (sendmsg4/6, sock_release; bpf_link, so they go with the daemon); when those
cannot attach, the tracer carries on with TCP and connected UDP sockets only.  The few kernel struct offsets
the program needs (socket -> network namespace, fd table -> socket) are read
from the running kernel's BTF, so the program is right even when bcc compiles
against another kernel version's headers.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import ipaddress
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Set, Tuple

from flowpacer.sources import cgroupbpf
from flowpacer import model
from flowpacer.errors import TracerUnavailable

log = logging.getLogger(__name__)

BPF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bpf")
BPF_SRC = os.path.join(BPF_DIR, "flowtrace.c")
BPF_UDP_SRC = os.path.join(BPF_DIR, "udptrace.c")     # compiled after flowtrace.c, one text
BTF_VMLINUX = "/sys/kernel/btf/vmlinux"
TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
COMM_LEN = 16
MAX_WATCH = 1024

# flowtrace.h
FT_OPEN, FT_CLOSE, FT_RELEASE, FT_WAKE = 1, 2, 3, 4
FT_DIR = {0: model.Direction.ANY, 1: model.Direction.OUTBOUND, 2: model.Direction.INBOUND}
FT_F_ATTRIBUTED, FT_F_UNTRACKED, FT_F_CONNECTED = 0x01, 0x02, 0x04
FT_C_LOST, FT_C_FILTERED, FT_C_UNATTRIBUTED, FT_C_ACCEPT_UNTRACKED, FT_C_MAX = range(5)
# struct ft_event: ts_ns cgroup_id netns_ino pid tid uid family lport rport
#                  kind direction flags protocol pad[6] laddr[16] raddr[16] comm[16] cookie
#                  mark bound_if
EVENT = struct.Struct("<QQIIIIHHHBBBB6x16s16s16sQII")
assert EVENT.size == 112
# udptrace.h: struct ft_udp_peer (cookie raddr[16] rport family pad), ft_udp_seen (last, open)
UDP_PEER = struct.Struct("<Q16sHH4x")
IPPROTO_UDP = 17
AF_INET, AF_INET6 = 2, 10
UDP_SWEEP_S = 1.0          # how often the last-send times of UDP peers are read

# The struct members flowtrace.c reads, as (-D name, BTF struct, member path).
BTF_FIELDS = (
    ("FT_OFF_SK_NET", "sock", "__sk_common.skc_net.net"),
    ("FT_OFF_NET_INUM", "net", "ns.inum"),
    ("FT_OFF_TASK_FILES", "task_struct", "files"),
    ("FT_OFF_FILES_FDT", "files_struct", "fdt"),
    ("FT_OFF_FDT_MAX_FDS", "fdtable", "max_fds"),
    ("FT_OFF_FDT_FD", "fdtable", "fd"),
    ("FT_OFF_FILE_PRIVATE", "file", "private_data"),
    ("FT_OFF_SOCKET_SK", "socket", "sk"),
    # a TCP socket's mark and bound device at OPEN (issue 29: its route)
    ("FT_OFF_SK_MARK", "sock", "sk_mark"),
    ("FT_OFF_SKC_BOUND_DEV_IF", "sock", "__sk_common.skc_bound_dev_if"),
    # udptrace.c: a connected UDP socket's protocol and tuple
    ("FT_OFF_SK_PROTOCOL", "sock", "sk_protocol"),
    ("FT_OFF_SKC_FAMILY", "sock", "__sk_common.skc_family"),
    ("FT_OFF_SKC_DADDR", "sock", "__sk_common.skc_daddr"),
    ("FT_OFF_SKC_RCV_SADDR", "sock", "__sk_common.skc_rcv_saddr"),
    ("FT_OFF_SKC_DPORT", "sock", "__sk_common.skc_dport"),
    ("FT_OFF_SKC_NUM", "sock", "__sk_common.skc_num"),
    ("FT_OFF_SKC_V6_DADDR", "sock", "__sk_common.skc_v6_daddr"),
    ("FT_OFF_SKC_V6_RCV_SADDR", "sock", "__sk_common.skc_v6_rcv_saddr"),
)


# ----------------------------------------------------------------------- BTF

class BTFError(Exception):
    pass


class BTF:
    """Just enough of a BTF reader to find struct member byte offsets.

    Format: include/uapi/linux/btf.h (header, type section, string section).
    """
    # extra bytes after struct btf_type for each kind
    _KIND_INT, _KIND_PTR, _KIND_ARRAY, _KIND_STRUCT, _KIND_UNION = 1, 2, 3, 4, 5
    _KIND_ENUM, _KIND_FWD, _KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST = 6, 7, 8, 9, 10
    _KIND_RESTRICT, _KIND_FUNC, _KIND_FUNC_PROTO, _KIND_VAR, _KIND_DATASEC = 11, 12, 13, 14, 15
    _KIND_FLOAT, _KIND_DECL_TAG, _KIND_TYPE_TAG, _KIND_ENUM64 = 16, 17, 18, 19

    def __init__(self, data: bytes):
        if len(data) < 24:
            raise BTFError("too short")
        magic, version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != 0xEB9F:
            raise BTFError(f"bad magic 0x{magic:x} (big-endian or not BTF)")
        if version != 1:
            raise BTFError(f"unknown version {version}")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        self._data = data
        self._types_start = hdr_len + type_off
        self._types_end = self._types_start + type_len
        self._str_start = hdr_len + str_off
        self._str_end = self._str_start + str_len
        if self._types_end > len(data) or self._str_end > len(data):
            raise BTFError("sections past the end of the data")
        self._offsets: List[int] = [0]  # type id -> byte offset (id 0 = void)
        self._by_name: Dict[Tuple[str, int], int] = {}
        self._index()

    @classmethod
    def from_file(cls, path: Optional[str] = None) -> "BTF":
        with open(path or BTF_VMLINUX, "rb") as f:
            return cls(f.read())

    def _str(self, off: int) -> str:
        start = self._str_start + off
        end = self._data.index(b"\0", start, self._str_end)
        return self._data[start:end].decode("ascii", "replace")

    def _index(self) -> None:
        data, pos, end = self._data, self._types_start, self._types_end
        unpack = struct.unpack_from
        wanted = {"sock", "net", "task_struct", "files_struct", "fdtable", "file", "socket"}
        wanted_off = {}
        # name offsets of wanted names are found lazily: compare strings only
        # for struct kinds, which keeps the pass over ~100k types quick
        while pos < end:
            name_off, info, _ = unpack("<III", data, pos)
            kind = (info >> 24) & 0x1F
            vlen = info & 0xFFFF
            self._offsets.append(pos)
            size = 12
            if kind in (self._KIND_INT, self._KIND_VAR, self._KIND_DECL_TAG):
                size += 4
            elif kind == self._KIND_ARRAY:
                size += 12
            elif kind in (self._KIND_STRUCT, self._KIND_UNION):
                size += 12 * vlen
                if name_off:
                    name = wanted_off.get(name_off)
                    if name is None:
                        name = self._str(name_off)
                        wanted_off[name_off] = name
                    if name in wanted:
                        self._by_name.setdefault((name, kind), len(self._offsets) - 1)
            elif kind in (self._KIND_ENUM, self._KIND_FUNC_PROTO):
                size += 8 * vlen
            elif kind in (self._KIND_DATASEC, self._KIND_ENUM64):
                size += 12 * vlen
            elif kind in (self._KIND_PTR, self._KIND_FWD, self._KIND_TYPEDEF,
                          self._KIND_VOLATILE, self._KIND_CONST, self._KIND_RESTRICT,
                          self._KIND_FUNC, self._KIND_FLOAT, self._KIND_TYPE_TAG):
                pass
            else:
                raise BTFError(f"unknown BTF kind {kind} at type {len(self._offsets) - 1}")
            pos += size

    def _type(self, tid: int) -> Tuple[str, int, int, bool, int, int]:
        """(name, kind, vlen, kind_flag, size_or_type, byte offset of the btf_type)"""
        if not 0 < tid < len(self._offsets):
            raise BTFError(f"bad type id {tid}")
        pos = self._offsets[tid]
        name_off, info, st = struct.unpack_from("<III", self._data, pos)
        return (self._str(name_off) if name_off else "", (info >> 24) & 0x1F,
                info & 0xFFFF, bool(info >> 31), st, pos)

    def _strip(self, tid: int) -> int:
        """Follow typedef/const/volatile/restrict/type_tag to the real type."""
        for _ in range(64):
            _n, kind, _v, _kf, st, _p = self._type(tid)
            if kind in (self._KIND_TYPEDEF, self._KIND_VOLATILE, self._KIND_CONST,
                        self._KIND_RESTRICT, self._KIND_TYPE_TAG):
                tid = st
            else:
                return tid
        raise BTFError("typedef loop")

    def _members(self, tid: int):
        _n, kind, vlen, kflag, _st, pos = self._type(tid)
        if kind not in (self._KIND_STRUCT, self._KIND_UNION):
            raise BTFError("not a struct or union")
        for i in range(vlen):
            m_name, m_type, m_off = struct.unpack_from("<III", self._data, pos + 12 + 12 * i)
            bits = m_off & 0xFFFFFF if kflag else m_off
            yield (self._str(m_name) if m_name else ""), m_type, bits

    def _find_member(self, tid: int, name: str, depth: int = 0) -> Optional[Tuple[int, int]]:
        """(bit offset, type id) of member ``name``, looking into anonymous members."""
        if depth > 8:
            return None
        for m_name, m_type, bits in self._members(tid):
            if m_name == name:
                return bits, m_type
            if not m_name:
                inner = self._strip(m_type)
                if self._type(inner)[1] in (self._KIND_STRUCT, self._KIND_UNION):
                    found = self._find_member(inner, name, depth + 1)
                    if found:
                        return bits + found[0], found[1]
        return None

    def offsetof(self, struct_name: str, path: str) -> int:
        """Byte offset of ``path`` ("a.b.c") in ``struct struct_name``."""
        tid = self._by_name.get((struct_name, self._KIND_STRUCT))
        if tid is None:
            raise BTFError(f"no struct {struct_name}")
        total = 0
        for part in path.split("."):
            tid = self._strip(tid)
            if self._type(tid)[1] not in (self._KIND_STRUCT, self._KIND_UNION):
                raise BTFError(f"struct {struct_name}: {part!r} is inside a non-struct")
            found = self._find_member(tid, part)
            if found is None:
                raise BTFError(f"struct {struct_name} has no member {path}")
            bits, tid = found
            if bits % 8:
                raise BTFError(f"struct {struct_name}.{path} is a bitfield")
            total += bits // 8
        return total


def btf_offsets(path: Optional[str] = None) -> Dict[str, int]:
    """The FT_OFF_* values for flowtrace.c from the kernel's BTF; raises BTFError/OSError."""
    btf = BTF.from_file(path or BTF_VMLINUX)
    return {macro: btf.offsetof(st, member) for macro, st, member in BTF_FIELDS}


# --------------------------------------------------------------- pre-checks

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


def check_privileges(status_path: str = "/proc/self/status") -> None:
    """BPF tracing needs CAP_SYS_ADMIN, or CAP_BPF with CAP_PERFMON."""
    caps = 0
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
    except (OSError, ValueError):
        return          # cannot tell: let the kernel decide
    if caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1):
        return
    raise TracerUnavailable(
        f"not privileged: the tracer needs root (CAP_SYS_ADMIN, or CAP_BPF+CAP_PERFMON); "
        f"effective capabilities are 0x{caps:x}")


@functools.lru_cache(maxsize=1)
def _libc():
    """libc, loaded once: ``find_library`` runs ``ldconfig -p`` (a process) at each call, and
    ``stats`` (every status and metrics scrape) asked for it once a BPF program."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def find_tracefs(mount: bool = True, dirs: Iterable[str] = TRACEFS_DIRS) -> str:
    """Where tracefs is; mounts it on the first directory if it is nowhere."""
    dirs = tuple(dirs)
    for d in dirs:
        if os.path.isdir(os.path.join(d, "events")):
            return d
    target = dirs[0]
    if not mount:
        raise TracerUnavailable(f"tracefs is not mounted (looked in {', '.join(dirs)})")
    if not os.path.isdir(target):
        raise TracerUnavailable(f"tracefs is not mounted and {target} does not exist to mount it on")
    libc = _libc()
    if libc.mount(b"tracefs", target.encode(), b"tracefs", 0, None) != 0:
        err = ctypes.get_errno()
        raise TracerUnavailable(
            f"tracefs is not mounted at {target} and mounting it failed: {os.strerror(err)}")
    if not os.path.isdir(os.path.join(target, "events")):
        raise TracerUnavailable(f"tracefs mounted at {target} but it has no events/ (tracing disabled?)")
    log.info("mounted tracefs on %s", target)
    return target


def check_kernel_headers(release: Optional[str] = None, modules_dir: str = "/lib/modules") -> str:
    """The kernel build directory bcc compiles against, or TracerUnavailable naming the package."""
    release = release or os.uname().release
    build = os.path.join(modules_dir, release, "build")
    if not os.path.isdir(os.path.join(build, "include")):
        what = "is a dangling link" if os.path.islink(build) else "does not exist"
        raise TracerUnavailable(
            f"kernel headers missing: {build} {what} (install linux-headers-{release})")
    return build


def headers_release(build: str) -> str:
    """The kernel release the headers in ``build`` are for ("" when unknown)."""
    try:
        with open(os.path.join(build, "include/generated/utsrelease.h")) as f:
            text = f.read()
    except OSError:
        return ""
    start = text.find('"')
    end = text.find('"', start + 1)
    return text[start + 1:end] if 0 <= start < end else ""


# ------------------------------------------------------------ event helpers

_ADDR_CACHE: Dict[Tuple[int, bytes], model.IPAddress] = {}


def _addr(family: int, raw: bytes) -> model.IPAddress:
    """The address of an event as the kernel gave it, IPv4-mapped or not (``FlowKey.wire``
    maps it; cached: a host has few addresses of its own)."""
    a = _ADDR_CACHE.get((family, raw))
    if a is None:
        a = ipaddress.IPv4Address(raw[:4]) if family == AF_INET else ipaddress.IPv6Address(raw)
        if len(_ADDR_CACHE) >= 8192:
            _ADDR_CACHE.clear()
        _ADDR_CACHE[(family, raw)] = a
    return a


_WIRE_CACHE: Dict[Tuple[int, bytes], model.IPAddress] = {}


def _wire(family: int, raw: bytes) -> model.IPAddress:
    """``FlowKey.wire_address`` of an event's address (cached as ``_addr`` is)."""
    a = _WIRE_CACHE.get((family, raw))
    if a is None:
        a = model.FlowKey.wire_address(_addr(family, raw))
        if len(_WIRE_CACHE) >= 8192:
            _WIRE_CACHE.clear()
        _WIRE_CACHE[(family, raw)] = a
    return a


_NO_OWNER = model.ProcessInfo(pid=0)     # a flow whose process the kernel did not say


def _comm(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _exe(pid: int) -> str:
    if pid <= 0:
        return ""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _comm_key(comm: str) -> bytes:
    """A watch comm as the kernel stores task comms: at most 15 bytes, NUL padded."""
    raw = comm.encode("utf-8")[:COMM_LEN - 1]
    return raw.ljust(COMM_LEN, b"\0")


def _validate_watch(comms, uids) -> Tuple[Optional[Set[bytes]], Optional[Set[int]]]:
    ckeys = None
    if comms is not None:
        if isinstance(comms, (str, bytes)):
            raise ValueError("set_watch: comms must be a set of process names, not one string")
        ckeys = set()
        for c in comms:
            if not isinstance(c, str) or not c or "\0" in c:
                raise ValueError(f"set_watch: bad process name {c!r}")
            if len(c.encode("utf-8")) > COMM_LEN - 1:
                log.info("watch %r: the kernel keeps 15 bytes of a process name, matching %r",
                         c, c.encode("utf-8")[:COMM_LEN - 1].decode("utf-8", "replace"))
            ckeys.add(_comm_key(c))
        if len(ckeys) > MAX_WATCH:
            raise ValueError(f"set_watch: {len(ckeys)} process names, at most {MAX_WATCH}")
    ukeys = None
    if uids is not None:
        if isinstance(uids, int):
            raise ValueError("set_watch: uids must be a set of user ids, not one number")
        ukeys = set()
        for u in uids:
            if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < 0xFFFFFFFF:
                raise ValueError(f"set_watch: bad uid {u!r}")
            ukeys.add(u)
        if len(ukeys) > MAX_WATCH:
            raise ValueError(f"set_watch: {len(ukeys)} uids, at most {MAX_WATCH}")
    return ckeys, ukeys


# --------------------------------------------------------- bpf prog info

class _BpfAttrInfo(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32),
                ("info", ctypes.c_uint64)]


_SYS_BPF = 321          # x86-64
_BPF_OBJ_GET_INFO_BY_FD = 15
_PROG_INFO_SIZE = 232   # sizeof(struct bpf_prog_info), linux 6.1 uapi
_OFF_RUN_TIME_NS, _OFF_RUN_CNT, _OFF_RECURSION_MISSES = 192, 200, 208


def prog_info(fd: int) -> Dict[str, int]:
    """run_time_ns, run_cnt (kernel.bpf_stats_enabled) and recursion_misses of a BPF program."""
    libc = _libc()
    buf = ctypes.create_string_buffer(_PROG_INFO_SIZE)
    attr = _BpfAttrInfo(fd, _PROG_INFO_SIZE, ctypes.addressof(buf))
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(_SYS_BPF), ctypes.c_int(_BPF_OBJ_GET_INFO_BY_FD),
                    ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr))) != 0:
        return {}
    raw = buf.raw
    return {"run_time_ns": struct.unpack_from("<Q", raw, _OFF_RUN_TIME_NS)[0],
            "run_cnt": struct.unpack_from("<Q", raw, _OFF_RUN_CNT)[0],
            "recursion_misses": struct.unpack_from("<Q", raw, _OFF_RECURSION_MISSES)[0]}


# ----------------------------------------------------------------- the tracer

class Tracer:
    """TCP flow OPEN/CLOSE events from the kernel, filtered there by netns, comm and uid."""

    hooks: str = ""

    PROGRAMS = (  # (bcc function name, tracepoint)
        ("tracepoint__sock__inet_sock_set_state", "sock:inet_sock_set_state"),
        ("tracepoint__syscalls__sys_exit_accept4", "syscalls:sys_exit_accept4"),
        ("tracepoint__syscalls__sys_exit_accept", "syscalls:sys_exit_accept"),
        ("tracepoint__syscalls__sys_enter_connect", "syscalls:sys_enter_connect"),
        ("tracepoint__syscalls__sys_exit_connect", "syscalls:sys_exit_connect"),
    )
    # (function, program type name in bcc.BPF, attach type): udptrace.c's cgroup programs
    CGROUP_PROGRAMS = (
        ("ft_udp_sendmsg4", "CGROUP_SOCK_ADDR", cgroupbpf.BPF_CGROUP_UDP4_SENDMSG),
        ("ft_udp_sendmsg6", "CGROUP_SOCK_ADDR", cgroupbpf.BPF_CGROUP_UDP6_SENDMSG),
        ("ft_udp_release", "CGROUP_SOCK", cgroupbpf.BPF_CGROUP_INET_SOCK_RELEASE),
        ("ft_udp_connect4", "CGROUP_SOCK_ADDR", cgroupbpf.BPF_CGROUP_INET4_CONNECT),
        ("ft_udp_connect6", "CGROUP_SOCK_ADDR", cgroupbpf.BPF_CGROUP_INET6_CONNECT),
        ("ft_udp_egress", "CGROUP_SKB", cgroupbpf.BPF_CGROUP_INET_EGRESS),
    )

    def __init__(self, netns_ino: Optional[int] = None, ring_pages: int = 64, *,
                 max_flows: int = 65536):
        if netns_ino is None:
            netns_ino = os.stat("/proc/self/ns/net").st_ino
        if isinstance(netns_ino, bool) or not isinstance(netns_ino, int) or not 0 < netns_ino < 2**32:
            raise ValueError(f"netns_ino must be a network namespace inode number, not {netns_ino!r}")
        if (isinstance(ring_pages, bool) or not isinstance(ring_pages, int) or ring_pages < 1
                or ring_pages & (ring_pages - 1)):
            raise ValueError(f"ring_pages must be a power of two >= 1, not {ring_pages!r}")
        if isinstance(max_flows, bool) or not isinstance(max_flows, int) or not 16 <= max_flows <= 1 << 24:
            raise ValueError(f"max_flows must be 16..16777216, not {max_flows!r}")
        self.netns_ino = netns_ino
        self.ring_pages = ring_pages
        self.max_flows = max_flows
        self.hooks = ""
        self.offsets_from = ""
        self._bpf = None
        self._raw: List[bytes] = []
        self._counts = {"open": 0, "close": 0}
        self._unattributed_seen = 0
        self._late_open_dropped = 0
        self._bad_records = 0
        self._recent_close: "OrderedDict[model.FlowKey, int]" = OrderedDict()
        # UDP (issue 17): the flows of each unconnected socket (by cookie) and of each peer entry
        # of the kernel's udp_peers map; the idle bounds the rules give (set_udp_idle)
        self._udp_by_cookie: Dict[int, Set[model.FlowKey]] = {}
        self._udp_peer_flow: Dict[Tuple[int, int, bytes, int], model.Flow] = {}
        # connected UDP sockets (by cookie): their flow, and the last send time of the kernel's
        # udp_conn entry last reported IDLE (one report per silence)
        self._udp_conn_flow: Dict[int, model.Flow] = {}
        self._udp_conn_idle: Dict[int, int] = {}
        # connected sockets sock_diag listed (adopt_udp_connected): the newest list, taken by
        # poll(), and the cookies adopted from such lists
        self._udp_adopt: Optional[Dict[int, model.Flow]] = None
        self._udp_adopted: Set[int] = set()
        self._udp_idle_ns: Tuple[int, int] = (model.DEFAULT_IDLE_TIMEOUT_NS,
                                              model.DEFAULT_IDLE_TIMEOUT_NS)
        self._udp_links: List[int] = []
        self._udp_hooks = ""
        self._next_sweep = 0.0
        self._udp_counts = {"idle": 0, "released": 0, "forgotten": 0, "woken": 0,
                            "adopted": 0}
        # pid -> (comm, exe, monotonic s): exe of a busy target read once a second at most;
        # keyed with the comm too, so an exec (new comm) is seen at once
        self._exe_cache: Dict[int, Tuple[str, str, float]] = {}
        self._watch: Tuple[Optional[Set[bytes]], Optional[Set[int]]] = (None, None)
        # poll() may run in its own thread and waits in libbcc for up to its timeout: it holds
        # only _poll_lock there, so stats()/set_watch() (under _lock) never wait for it; close()
        # takes both (_poll_lock first), so the BPF object is never freed under either
        self._poll_lock = threading.Lock()
        self._lock = threading.RLock()

    # -------------------------------------------------------------- start-up

    def _cflags(self) -> List[str]:
        release = os.uname().release
        build = check_kernel_headers(release)
        flags = [f"-I{BPF_DIR}", f"-DFT_RING_PAGES={self.ring_pages}",
                 f"-DFT_MAX_FLOWS={self.max_flows}", f"-DFT_MAX_WATCH={MAX_WATCH}"]
        try:
            offs = btf_offsets()
            self.offsets_from = BTF_VMLINUX
        except (OSError, BTFError) as e:
            e = e.strerror if isinstance(e, OSError) and e.strerror else e
            hdr = headers_release(build)
            if hdr != release:
                raise TracerUnavailable(
                    f"cannot locate kernel struct fields: {BTF_VMLINUX}: {e}; and the headers in "
                    f"{build} are for {hdr or 'an unknown kernel'}, not {release} "
                    f"(need CONFIG_DEBUG_INFO_BTF or linux-headers-{release})") from None
            self.offsets_from = build
            log.info("no usable BTF (%s): struct offsets from the kernel headers", e)
            return flags + ["-DFT_OFFSETS_FROM_HEADERS"]
        log.debug("struct offsets from BTF: %s", offs)
        return flags + [f"-D{k}={v}" for k, v in offs.items()]

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._bpf is not None:
            return
        check_privileges()
        find_tracefs(mount=True)      # before importing bcc: it picks its tracefs path at import
        try:
            import bcc  # noqa: F401  (python3-bpfcc)
        except Exception as e:  # ImportError, or a broken libbcc
            raise TracerUnavailable(f"bcc is not importable (install python3-bpfcc): {e}") from None
        cflags = self._cflags()
        t0 = time.monotonic()
        try:
            text = "".join(open(p).read() + "\n" for p in (BPF_SRC, BPF_UDP_SRC))
            b = bcc.BPF(text=text.encode(), cflags=cflags)
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if "compile" in msg:
                raise TracerUnavailable(
                    f"BPF program does not compile against the headers in "
                    f"{check_kernel_headers()}: clang's errors are above") from None
            if "Permission denied" in msg or "Operation not permitted" in msg:
                msg += " (the kernel's verifier log is above)"
            raise TracerUnavailable(f"BPF load refused: {msg}") from None
        try:
            missing = [tp for _fn, tp in self.PROGRAMS if tp.encode() not in b.tracepoint_fds]
            if missing:
                raise TracerUnavailable(f"tracepoints not attached: {', '.join(missing)}")
            b[b"events"].open_ring_buffer(self._on_event)
            # until config[0] is written its netns is 0 and the program passes nothing;
            # the watch set before start() (or before a close()) goes in before it
            self._bpf = b
            c, u = self._watch
            self._set_watch_locked(c, u, watch_all=(c is None and u is None))
        except TracerUnavailable:
            self._bpf = None
            b.cleanup()
            raise
        except Exception as e:
            self._bpf = None
            b.cleanup()
            raise TracerUnavailable(f"BPF set-up failed: {e}") from None
        self._attach_udp(b)
        self.hooks = "tracepoints" + (f" + {self._udp_hooks}" if self._udp_hooks else "")
        log.info("tracer attached: hooks=%s (%s), netns %d, ring %d pages, %d flows max, "
                 "struct offsets from %s, compiled in %.2f s",
                 self.hooks, ", ".join(tp for _f, tp in self.PROGRAMS), self.netns_ino,
                 self.ring_pages, self.max_flows, self.offsets_from, time.monotonic() - t0)

    def _attach_udp(self, b) -> None:
        """udptrace.c's cgroup programs on the cgroup v2 root; without them UDP flows are the
        connected sockets only (said in the log and in ``hooks``)."""
        import bcc
        links: List[int] = []
        try:
            cookie = cgroupbpf.netns_cookie_of(self.netns_ino)
            fns = [(b.load_func(fn.encode(), getattr(bcc.BPF, pt), attach_type=at), at)
                   for fn, pt, at in self.CGROUP_PROGRAMS]
            cg, root = cgroupbpf.open_cgroup2_root()
            try:
                for f, at in fns:
                    links.append(cgroupbpf.link_create(f.fd, cg, at))
            finally:
                os.close(cg)
        except Exception as e:
            for fd in links:
                os.close(fd)
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            log.warning("UDP peers of unconnected sockets are not traced (cgroup sendmsg/"
                        "sock_release programs: %s): connected UDP sockets only", msg)
            self._udp_hooks = "udp connect only"
            return
        self._udp_links = links
        self._udp_cookie = cookie
        self._write_udp_config()
        self._udp_hooks = "cgroup udp sendmsg/release"
        log.info("UDP: cgroup sendmsg4/6 and sock_release attached to %s", root)

    def _write_udp_config(self) -> None:
        b = self._bpf
        if b is None or not self._udp_links:
            return
        t = b[b"udp_config"]
        t[ctypes.c_int(0)] = t.Leaf(self._udp_cookie, self._udp_idle_ns[0])

    def set_udp_idle(self, shortest_ns: int, longest_ns: int) -> None:
        """The rules' shortest and longest UDP idle_timeout (``engine.udp_idle_timeouts``): a
        peer silent for the shortest is reported IDLE at each sweep and announced again at its
        next datagram; one silent for the longest is forgotten by the kernel map."""
        if not 0 < shortest_ns <= longest_ns:
            raise ValueError(f"set_udp_idle: need 0 < shortest <= longest, not "
                             f"{shortest_ns}, {longest_ns}")
        with self._lock:
            self._udp_idle_ns = (int(shortest_ns), int(longest_ns))
            self._write_udp_config()

    # --------------------------------------------------------------- watch

    def set_watch(self, comms: Optional[Set[str]], uids: Optional[Set[int]],
                  all_: Optional[bool] = None) -> None:
        """Which processes are targets: comm in ``comms`` OR uid in ``uids``.

        ``None, None`` (or ``all_=True``) watches every process. Updated live in
        the kernel; flows opened before the change keep their old verdict.
        """
        ckeys, ukeys = _validate_watch(comms, uids)
        watch_all = bool(all_) if all_ is not None else (ckeys is None and ukeys is None)
        with self._lock:
            self._set_watch_locked(ckeys, ukeys, watch_all)

    def _set_watch_locked(self, ckeys, ukeys, watch_all: bool) -> None:
        if self._bpf is None:     # applied by start()
            self._watch = (None, None) if watch_all else (ckeys or set(), ukeys or set())
            return
        b = self._bpf
        cfg = b[b"config"]
        if watch_all:
            cfg[ctypes.c_int(0)] = cfg.Leaf(self.netns_ino, 1)
        comm_map, uid_map = b[b"watch_comms"], b[b"watch_uids"]
        want_c = ckeys or set()
        want_u = ukeys or set()
        # add the new targets first, then drop the old ones: no gap for a kept target
        for c in want_c:
            comm_map[comm_map.Key(c)] = comm_map.Leaf(1)
        for u in want_u:
            uid_map[uid_map.Key(u)] = uid_map.Leaf(1)
        for k in list(comm_map.keys()):
            if bytes(k.comm).ljust(COMM_LEN, b"\0") not in want_c:
                del comm_map[k]
        for k in list(uid_map.keys()):
            if k.value not in want_u:
                del uid_map[k]
        if not watch_all:
            cfg[ctypes.c_int(0)] = cfg.Leaf(self.netns_ino, 0)
        self._watch = (None, None) if watch_all else (want_c, want_u)
        log.info("watching %s", "all processes" if watch_all else
                 f"comms {sorted(_comm(c) for c in want_c)} uids {sorted(want_u)}")

    # ---------------------------------------------------------------- events

    def _on_event(self, _ctx, data, size) -> None:
        try:
            self._raw.append(ctypes.string_at(data, size))
        except Exception:  # never let an exception unwind into libbcc
            self._bad_records += 1

    def poll(self, timeout_ms: int) -> List[model.FlowEvent]:
        """Events that arrived (waits up to ``timeout_ms`` for the first one)."""
        with self._poll_lock:
            b = self._need()
            b.ring_buffer_poll(max(0, int(timeout_ms)))   # consumes all that is there
            raw, self._raw = self._raw, []
            adopt, self._udp_adopt = self._udp_adopt, None
            if adopt is not None:
                self._adopt_connected(adopt)
            idle = self._sweep_udp() if self._udp_links else []
        if not raw:
            return idle
        decoded = []
        for rec in raw:
            if len(rec) != EVENT.size:
                self._bad_records += 1
                continue
            decoded.append(EVENT.unpack_from(rec))
        decoded.sort(key=lambda r: r[0])   # OPEN before CLOSE when both are here
        out: List[model.FlowEvent] = []
        procs: Dict[tuple, model.ProcessInfo] = {}   # one ProcessInfo per owner a poll
        for r in decoded:
            if r[9] == FT_RELEASE:
                out.extend(self._released(r))
                continue
            if r[9] == FT_WAKE:
                ev = self._woken(r)
                if ev is not None:
                    out.append(ev)
                continue
            ev = self._to_event(r, procs)
            if ev is not None:
                out.append(ev)
        return out + idle

    def _sweep_udp(self) -> List[model.FlowEvent]:
        """Every UDP_SWEEP_S: IDLE for each peer silent for the shortest idle timeout (the
        engine decides per rule), and peers silent for the longest are forgotten."""
        now_s = time.monotonic()
        if now_s < self._next_sweep:
            return []
        self._next_sweep = now_s + UDP_SWEEP_S
        shortest, longest = self._udp_idle_ns
        now = time.monotonic_ns()
        peers = self._bpf[b"udp_peers"]
        out, gone = [], []
        for k in peers.keys():
            try:
                v = peers[k]
            except KeyError:        # evicted (LRU) or released meanwhile
                continue
            quiet = now - v.last_ns
            if quiet < shortest:
                continue
            ident = (k.cookie, k.family, bytes(k.raddr), k.rport)
            flow = self._udp_peer_flow.get(ident)
            if flow is not None:
                out.append(model.FlowEvent(model.EventKind.IDLE,
                                           model.Flow(flow.key, flow.direction, flow.proc,
                                                      flow.source, flow.netns_ino, v.last_ns)))
            if quiet >= longest or flow is None:
                gone.append((k, ident))
        for k, ident in gone:
            with contextlib.suppress(KeyError):     # evicted (LRU) or released meanwhile
                del peers[k]
            flow = self._udp_peer_flow.pop(ident, None)
            if flow is not None:
                keys = self._udp_by_cookie.get(ident[0])
                if keys is not None:
                    keys.discard(flow.key)
                    if not keys:
                        del self._udp_by_cookie[ident[0]]
        out += self._sweep_connected(now, shortest)
        self._udp_counts["idle"] += len(out)
        self._udp_counts["forgotten"] += len(gone)
        return out

    def _sweep_connected(self, now: int, shortest: int) -> List[model.FlowEvent]:
        """IDLE for each connected UDP socket silent for the shortest idle timeout, once per
        silence (its kernel entry stays until the socket closes: its next packet sends WAKE)."""
        conn = self._bpf[b"udp_conn"]
        out = []
        for k in conn.keys():
            try:
                v = conn[k]
            except KeyError:        # released meanwhile
                continue
            cookie = k.value
            flow = self._udp_conn_flow.get(cookie)
            if (flow is None or now - v.last_ns < shortest
                    or self._udp_conn_idle.get(cookie) == v.last_ns):
                continue
            self._udp_conn_idle[cookie] = v.last_ns
            out.append(model.FlowEvent(model.EventKind.IDLE,
                                       model.Flow(flow.key, flow.direction, flow.proc,
                                                  flow.source, flow.netns_ino, v.last_ns)))
        return out

    def adopt_udp_connected(self, socks: Dict[int, model.Flow]) -> None:
        """The connected UDP sockets sock_diag lists now (cookie -> flow): those the tracer did
        not see connect (opened before it) are followed from the next poll like its own: idle,
        woken, released. Cheap and thread-safe: poll() takes the newest list (one is kept
        while the tracer does not poll; one lost to a race is sent again by the next pass)."""
        self._udp_adopt = dict(socks)

    def _adopt_connected(self, socks: Dict[int, model.Flow]) -> None:
        b = self._bpf
        if b is None or not self._udp_links:
            return
        conn, held = b[b"udp_conn"], b[b"udp_socks"]
        now = time.monotonic_ns()
        for cookie, flow in socks.items():
            if not cookie or cookie in self._udp_conn_flow:
                continue
            conn[conn.Key(cookie)] = conn.Leaf(now, now)
            held[held.Key(cookie)] = held.Leaf(1)
            self._udp_conn_flow[cookie] = flow
            self._udp_by_cookie.setdefault(cookie, set()).add(flow.key)
            self._udp_adopted.add(cookie)
            self._udp_counts["adopted"] += 1
        for cookie in self._udp_adopted - socks.keys():
            # no longer listed: closed (its RELEASE may have come first) or no longer shaped
            self._udp_adopted.discard(cookie)
            if cookie in self._udp_conn_flow:
                self._udp_conn_flow.pop(cookie)
                self._udp_conn_idle.pop(cookie, None)
                self._udp_by_cookie.pop(cookie, None)
                for m in (conn, held):
                    with contextlib.suppress(KeyError):
                        del m[m.Key(cookie)]

    def _woken(self, r) -> Optional[model.FlowEvent]:
        """A connected UDP socket that was silent sends again: its flow is OPEN again."""
        ts, cookie = r[0], r[16]
        flow = self._udp_conn_flow.get(cookie)
        if flow is None:            # its OPEN was lost, or the socket is not a target's
            return None
        self._udp_counts["woken"] += 1
        self._udp_conn_idle.pop(cookie, None)
        flow = model.Flow(flow.key, flow.direction, flow.proc, flow.source, flow.netns_ino, ts)
        self._udp_conn_flow[cookie] = flow
        self._counts["open"] += 1
        return model.FlowEvent(model.EventKind.OPEN, flow)

    def _released(self, r) -> List[model.FlowEvent]:
        """A UDP socket with flows closed: CLOSE for each flow of its cookie."""
        ts, netns, cookie = r[0], r[2], r[16]
        keys = self._udp_by_cookie.pop(cookie, set())
        self._udp_conn_flow.pop(cookie, None)
        self._udp_conn_idle.pop(cookie, None)
        for ident in [i for i in self._udp_peer_flow if i[0] == cookie] if keys else ():
            del self._udp_peer_flow[ident]
        self._udp_counts["released"] += 1
        out = []
        for key in sorted(keys):
            flow = model.Flow(key=key, direction=model.Direction.ANY, proc=model.ProcessInfo(pid=0),
                              source=model.FlowSource.TRACER, netns_ino=netns, seen_ns=ts)
            self._counts["close"] += 1
            self._recent_close[key] = ts
            self._recent_close.move_to_end(key)
            out.append(model.FlowEvent(model.EventKind.CLOSE, flow))
        while len(self._recent_close) > 4096:
            self._recent_close.popitem(last=False)
        return out

    @staticmethod
    def _key(family, laddr, lport, raddr, rport, proto) -> model.FlowKey:
        la, ra = _wire(family, laddr), _wire(family, raddr)
        if la.version == ra.version:        # what FlowKey.wire gives, from cached addresses
            return model.FlowKey(la, lport, ra, rport, proto)
        return model.FlowKey.wire(_addr(family, laddr), lport, _addr(family, raddr), rport, proto)

    def _to_event(self, r, procs: Optional[Dict[tuple, model.ProcessInfo]] = None
                  ) -> Optional[model.FlowEvent]:
        """One record's event (None: dropped); ``procs``: the owners met in this poll, by
        their facts, so that a burst's events of one process share one ProcessInfo (one
        comm decode and exe lookup a process, not one an event)."""
        (ts, cgid, netns, pid, tid, uid, family, lport, rport,
         kind, direction, flags, proto, laddr, raddr, comm, cookie, mark, bound_if) = r
        if kind not in (FT_OPEN, FT_CLOSE) or family not in (AF_INET, AF_INET6):
            self._bad_records += 1
            return None
        udp = proto == IPPROTO_UDP
        key = self._key(family, laddr, lport, raddr, rport,
                        model.Protocol.UDP if udp else model.Protocol.TCP)
        if flags & FT_F_ATTRIBUTED:
            facts = (pid, tid, uid, cgid, comm, kind == FT_OPEN)
            proc = procs.get(facts) if procs is not None else None
            if proc is None:
                name = _comm(comm)
                proc = model.ProcessInfo(pid=pid, comm=name,
                                         exe=self._exe_of(pid, name) if kind == FT_OPEN else "",
                                         uid=uid, tid=tid, cgroup_id=cgid)
                if procs is not None:
                    procs[facts] = proc
        else:
            proc = _NO_OWNER
        flow = model.Flow(key=key, direction=FT_DIR.get(direction, model.Direction.ANY),
                          proc=proc, source=model.FlowSource.TRACER, netns_ino=netns, seen_ns=ts,
                          mark=mark, bound_if=bound_if)
        if kind == FT_OPEN and udp and cookie:
            # ended by the socket's release (and a peer of an unconnected socket by idleness)
            self._udp_by_cookie.setdefault(cookie, set()).add(key)
            if not flags & FT_F_CONNECTED:
                self._udp_peer_flow[(cookie, family, raddr, rport)] = flow
            else:       # (re)connected: idle by udp_conn (sweep), open again by FT_WAKE
                self._udp_conn_flow[cookie] = flow
                self._udp_conn_idle.pop(cookie, None)
        if kind == FT_OPEN:
            closed_at = self._recent_close.get(key)
            if closed_at is not None and closed_at >= ts:
                # its CLOSE was delivered in an earlier poll (CPUs raced): not a live flow
                self._late_open_dropped += 1
                log.debug("OPEN %s after its CLOSE: dropped", key)
                return None
            self._counts["open"] += 1
            return model.FlowEvent(model.EventKind.OPEN, flow)
        self._counts["close"] += 1
        self._recent_close[key] = ts
        self._recent_close.move_to_end(key)
        while len(self._recent_close) > 4096:
            self._recent_close.popitem(last=False)
        if flags & FT_F_UNTRACKED:
            self._unattributed_seen += 1
            log.debug("CLOSE %s of a flow opened before the tracer (or evicted): no owner", key)
        return model.FlowEvent(model.EventKind.CLOSE, flow)

    def _exe_of(self, pid: int, comm: str) -> str:
        now = time.monotonic()
        hit = self._exe_cache.get(pid)
        if hit is not None and hit[0] == comm and now - hit[2] < 1.0:
            return hit[1]
        exe = _exe(pid)
        if len(self._exe_cache) >= 4096:
            self._exe_cache.clear()
        self._exe_cache[pid] = (comm, exe, now)
        return exe

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict:
        """events (by kind), lost, unattributed, filtered, and a few more counters."""
        c = [0] * FT_C_MAX
        prog = {}
        with self._lock:
            b = self._bpf
            if b is not None:
                table = b[b"counters"]
                c = [int(sum(table[ctypes.c_int(i)])) for i in range(FT_C_MAX)]
                for fn, tp in self.PROGRAMS:
                    f = b.funcs.get(fn.encode())
                    prog[tp] = prog_info(f.fd) if f is not None else {}
        missed = sum(p.get("recursion_misses", 0) for p in prog.values())
        return {
            "hooks": self.hooks,
            "events": dict(self._counts),
            "lost": c[FT_C_LOST],
            "unattributed": c[FT_C_UNATTRIBUTED],
            "filtered": c[FT_C_FILTERED],
            "accept_untracked": c[FT_C_ACCEPT_UNTRACKED],
            "missed": missed,          # tracepoint hits the kernel skipped (BPF recursion guard)
            "late_open_dropped": self._late_open_dropped,
            "udp": dict(self._udp_counts, peers=len(self._udp_peer_flow),
                        connected=len(self._udp_conn_flow)),
            "bad_records": self._bad_records,
            "programs": prog,
        }

    # ---------------------------------------------------------------- close

    def _need(self):
        if self._bpf is None:
            raise RuntimeError("Tracer is not started")
        return self._bpf

    def close(self) -> None:
        with self._poll_lock, self._lock:
            b, self._bpf = self._bpf, None
            links, self._udp_links = self._udp_links, []
        for fd in links:
            os.close(fd)
        if b is not None:
            try:
                b.cleanup()
            finally:
                log.info("tracer detached")
                self.hooks = ""

    def __enter__(self) -> "Tracer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
