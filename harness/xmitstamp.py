"""Packet departure times from the kernel itself: ``XmitStamps`` (harness/bpf/xmitstamp.c).

A BTF tracepoint program (tp_btf) on ``net_dev_start_xmit`` writes the time and headers of
every skb one device hands its driver into a BPF array; nothing runs in user space per packet
(about 255 ns of kernel time per packet on the host). That is where
tcpdump's egress tap stamps too, without tcpdump's process competing with the traffic for a
one-vCPU guest. The array holds ``slots`` records; what did not fit is counted in ``drops`` (a
run with drops is not a result, as with tcpdump).

    with XmitStamps(ns, dev) as xs:
        ...                                     # traffic
    xs.records  # [XmitRecord(ts_ns, length, gso_size, sport, dport, proto, l4_off, l4_hdr), ...]

The program is a CO-RE object: ``build_object()`` compiles it once with clang (no kernel
headers; cached under ``harness/bpf/build/`` by the source's hash, so the host builds it before
a VM boots and the guest finds it over its read-only view of the host's root), and libbpf
(Debian's ``libbpf.so.1``, over ctypes) fits its field offsets to the running kernel's BTF at
load. Each capture loads its own copy (the array sized to ``slots``), attaches it for the
``with`` block, reads the records in one BPF_MAP_LOOKUP_BATCH and closes everything, so nothing
stays in the kernel after ``stop()``. Errors are one-line ``XmitStampError``s.
"""
from __future__ import annotations

import ctypes as ct
import dataclasses
import hashlib
import logging
import os
import shutil
import socket
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional

from harness.testbed import in_netns

log = logging.getLogger(__name__)

BPF_SRC = Path(__file__).with_name("bpf") / "xmitstamp.c"
CACHE_DIR = BPF_SRC.parent / "build"
CLANG = "clang"
CFLAGS = ("-target", "bpf", "-O2", "-g", "-Wall", "-Werror")
PROG = b"xs_start_xmit"
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


# ------------------------------------------------------------------------------ the object

def object_path(cache_dir: Optional[Path] = None) -> Path:
    """Where the object of the current source is (or will be) cached."""
    key = hashlib.sha256(BPF_SRC.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return Path(cache_dir or CACHE_DIR) / f"xmitstamp-{key}.o"


def build_object(cache_dir: Optional[Path] = None) -> Path:
    """The compiled object, built now if the cache has none for this source (clang; a
    temporary file renamed into place, so builds running at once do not see half a file)."""
    obj = object_path(cache_dir)
    if obj.is_file():
        return obj
    clang = shutil.which(CLANG)
    if clang is None:
        raise XmitStampError(f"{CLANG} not found: it builds {BPF_SRC.name} "
                             "(Debian package clang, tools/setup.sh)")
    try:
        obj.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=obj.stem + ".", suffix=".tmp", dir=obj.parent)
        os.close(fd)
    except OSError as e:
        raise XmitStampError(f"cannot write the object to {obj.parent}: {e.strerror}") from None
    try:
        proc = subprocess.run([clang, *CFLAGS, "-c", str(BPF_SRC), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln),
                         proc.stderr.strip()[:300])
            raise XmitStampError(f"clang failed on {BPF_SRC.name} (exit {proc.returncode}): {first}")
        os.replace(tmp, obj)
    except subprocess.TimeoutExpired:
        raise XmitStampError(f"clang took over 600 s on {BPF_SRC.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", obj)
    return obj


# ------------------------------------------------------------------------------ libbpf

class _Libbpf:
    """The few libbpf 1.x calls used, typed. libbpf returns NULL with errno set or a negative
    errno; its log lines (the verifier's, relocation failures) go to ``logging`` and the
    last warning is kept for the error message."""

    def __init__(self):
        try:
            lib = ct.CDLL("libbpf.so.1", use_errno=True)
        except OSError as e:
            raise XmitStampError(f"libbpf.so.1 (Debian package libbpf1): {e}") from None
        P, I, U32, V = ct.c_void_p, ct.c_int, ct.c_uint32, None
        for name, res, args in (
                ("bpf_object__open_file", P, [ct.c_char_p, P]),
                ("bpf_object__load", I, [P]),
                ("bpf_object__close", V, [P]),
                ("bpf_object__find_map_by_name", P, [P, ct.c_char_p]),
                ("bpf_object__find_program_by_name", P, [P, ct.c_char_p]),
                ("bpf_map__set_max_entries", I, [P, U32]),
                ("bpf_map__value_size", U32, [P]),
                ("bpf_map__fd", I, [P]),
                ("bpf_program__attach", P, [P]),
                ("bpf_link__destroy", I, [P]),
                ("bpf_map_update_elem", I, [I, P, P, ct.c_uint64]),
                ("bpf_map_lookup_elem", I, [I, P, P]),
                ("bpf_map_lookup_batch", I, [I, P, P, P, P, ct.POINTER(U32), P]),
                ("libbpf_set_print", P, [P]),
                ("libbpf_strerror", I, [I, ct.c_char_p, ct.c_size_t])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib
        self._libc = ct.CDLL(None)
        self._libc.vsnprintf.argtypes = [ct.c_char_p, ct.c_size_t, ct.c_char_p, ct.c_void_p]
        self.last_warning = ""
        # int (*)(enum libbpf_print_level, const char *fmt, va_list ap): on x86-64 a va_list
        # argument is a pointer, which vsnprintf takes as it is
        self._print = ct.CFUNCTYPE(ct.c_int, ct.c_int, ct.c_char_p, ct.c_void_p)(self._on_print)

    def _on_print(self, level: int, fmt: bytes, ap) -> int:
        buf = ct.create_string_buffer(1024)
        self._libc.vsnprintf(buf, len(buf), fmt, ap)
        text = buf.value.decode(errors="replace").rstrip()
        if level == 0 and text and not text.startswith("--"):    # LIBBPF_WARN
            self.last_warning = text
        log.debug("libbpf: %s", text)
        return 0

    def logging_to_python(self):
        """A ``with`` block during which libbpf logs here (the process' previous printer,
        e.g. bcc's, is put back after)."""
        lb = self

        class _Ctx:
            def __enter__(self):
                lb.last_warning = ""
                self.prev = lb.lib.libbpf_set_print(ct.cast(lb._print, ct.c_void_p))

            def __exit__(self, *exc):
                lb.lib.libbpf_set_print(self.prev)
        return _Ctx()

    def error(self, what: str, err: int) -> XmitStampError:
        err = abs(err)
        buf = ct.create_string_buffer(256)
        # errno text, or libbpf's own for its codes (4000 up: not an ELF file, bad relocation...)
        why = buf.value.decode() if err and self.lib.libbpf_strerror(err, buf, len(buf)) == 0 \
            else (os.strerror(err) if err else "failed")
        extra = f" ({self.last_warning})" if self.last_warning else ""
        return XmitStampError(f"{what}: {why}{extra}")


_LIB: Optional[_Libbpf] = None


def _libbpf() -> _Libbpf:
    global _LIB
    if _LIB is None:
        _LIB = _Libbpf()
    return _LIB


# ------------------------------------------------------------------------------ the capture

def _device(ns: str, dev: str):
    """(ifindex, namespace inode) of ``dev`` in ``ns``: what the program matches."""
    try:
        inum = os.stat(f"/run/netns/{ns}").st_ino
        with in_netns(ns):
            return socket.if_nametoindex(dev), inum
    except OSError as e:
        raise XmitStampError(f"device {dev} in namespace {ns}: {e.strerror or e}") from None


class XmitStamps:
    """One capture: the program loaded with an array of ``slots`` records, pointed at ``dev``
    in ``ns``, attached for the ``with`` block; ``stop()`` detaches, reads and unloads it."""

    def __init__(self, ns: str, dev: str, slots: int = 1 << 20, obj: Optional[Path] = None):
        if slots < 1:
            raise XmitStampError(f"slots must be at least 1, not {slots}")
        self.ns, self.dev, self.slots = ns, dev, slots
        self.obj_path = obj         # None: build_object()'s
        self.records: List[XmitRecord] = []
        self.drops = 0
        self._obj = None
        self._link = None
        self._fds: dict = {}

    def __enter__(self) -> "XmitStamps":
        idx, inum = _device(self.ns, self.dev)
        self._load()
        try:
            self._update("xs_count", 0, 0)
            self._update("xs_count", 1, 0)
            self._update("xs_conf", 1, inum)
            self._update("xs_conf", 0, idx)
            lb = _libbpf()
            prog = lb.lib.bpf_object__find_program_by_name(self._obj, PROG)
            if not prog:
                raise lb.error(f"no program {PROG.decode()} in the object", ct.get_errno())
            with lb.logging_to_python():
                link = lb.lib.bpf_program__attach(prog)
            if not link:
                raise lb.error("attaching to tracepoint net_dev_start_xmit", ct.get_errno())
            self._link = link
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> List[XmitRecord]:
        """Detach, read the records and unload (idempotent)."""
        if self._obj is None:
            return self.records
        try:
            self._detach()
            claimed = self._lookup("xs_count", 0)
            self.drops = self._lookup("xs_count", 1)
            self.records = self._read(min(claimed, self.slots))
        finally:
            self._close()
        return self.records

    # -- libbpf steps

    def _load(self) -> None:
        path = Path(self.obj_path) if self.obj_path else build_object()
        lb = _libbpf()
        with lb.logging_to_python():
            obj = lb.lib.bpf_object__open_file(str(path).encode(), None)
            if not obj:
                raise lb.error(f"opening {path}", ct.get_errno())
            self._obj = obj
            try:
                recs = lb.lib.bpf_object__find_map_by_name(obj, b"xs_recs")
                if not recs:
                    raise XmitStampError(f"{path}: no map xs_recs")
                if lb.lib.bpf_map__value_size(recs) != _REC.size:
                    raise XmitStampError(f"struct xs_rec is {lb.lib.bpf_map__value_size(recs)} "
                                         f"bytes, {_REC.size} expected")
                err = lb.lib.bpf_map__set_max_entries(recs, self.slots)
                if err:
                    raise lb.error(f"sizing xs_recs to {self.slots} slots", err)
                err = lb.lib.bpf_object__load(obj)
                if err:
                    raise lb.error(f"loading {path.name} into the kernel", err)
                for name in (b"xs_recs", b"xs_count", b"xs_conf"):
                    m = lb.lib.bpf_object__find_map_by_name(obj, name)
                    self._fds[name.decode()] = lb.lib.bpf_map__fd(m) if m else -1
            except BaseException:
                self._close()
                raise

    def _update(self, mapname: str, key: int, value: int) -> None:
        k, v = ct.c_uint32(key), ct.c_uint64(value)
        lb = _libbpf()
        err = lb.lib.bpf_map_update_elem(self._fds[mapname], ct.byref(k), ct.byref(v), 0)
        if err:
            raise lb.error(f"writing {mapname}[{key}]", err)

    def _lookup(self, mapname: str, key: int) -> int:
        k, v = ct.c_uint32(key), ct.c_uint64(0)
        lb = _libbpf()
        err = lb.lib.bpf_map_lookup_elem(self._fds[mapname], ct.byref(k), ct.byref(v))
        if err:
            raise lb.error(f"reading {mapname}[{key}]", err)
        return v.value

    def _detach(self) -> None:
        link, self._link = self._link, None
        if link:
            err = _libbpf().lib.bpf_link__destroy(link)
            if err:
                raise _libbpf().error("detaching from net_dev_start_xmit", err)

    def _close(self) -> None:
        """Unload: the link (if still there), the maps and the program go with the object."""
        try:
            self._detach()
        finally:
            obj, self._obj = self._obj, None
            self._fds = {}
            if obj:
                _libbpf().lib.bpf_object__close(obj)

    def _read(self, n: int) -> List[XmitRecord]:
        """The first ``n`` records in one BPF_MAP_LOOKUP_BATCH (an array's batch goes in key
        order), unpacked from the raw buffer: no Python object per map entry until the end."""
        if n == 0:
            return []
        lb, fd, size = _libbpf(), self._fds["xs_recs"], _REC.size
        keys = (ct.c_uint32 * n)()
        vals = ct.create_string_buffer(size * n)
        out_batch = ct.c_uint32(0)
        got = 0
        while got < n:
            count = ct.c_uint32(n - got)
            err = lb.lib.bpf_map_lookup_batch(fd, ct.byref(out_batch) if got else None,
                                              ct.byref(out_batch), ct.byref(keys, 4 * got),
                                              ct.byref(vals, size * got), ct.byref(count), None)
            got += count.value
            if err:
                if -err == 2:           # ENOENT: the end of the array
                    break
                raise lb.error("BPF_MAP_LOOKUP_BATCH on xs_recs", err)
            if count.value == 0:
                break
        return [XmitRecord(ts_ns=ts, length=ln, gso_size=gso, sport=sp, dport=dp, proto=pr,
                           l4_off=off, l4_hdr=hl)
                for ts, ln, gso, off, sp, dp, hl, pr, _ in
                _REC.iter_unpack(memoryview(vals)[:size * min(got, n)])]
