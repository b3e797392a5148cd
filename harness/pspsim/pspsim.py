"""ctypes driver of the psp scheduling simulator (``psp_sim.c`` + ``../psp_sched.h`` +
``../psp_tree.h``, the module's own scheduling and ordering code).

The simulator is the kernel module's scheduling core compiled for userspace and run on a virtual
clock: time only moves when the caller says so, so every run is exactly reproducible. ``Sim``
wraps one simulated qdisc; rates are bytes/s, times ns, lengths bytes (as in the kernel).

``build()`` compiles the shared library with gcc when it is missing or older than its sources; it
writes to a temporary file and renames it, so concurrent test runs cannot see a half-written file.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Tuple

# numpy's OpenBLAS spins worker threads that steal CPU from the timed C loops on small machines
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

log = logging.getLogger(__name__)

SIM_DIR = Path(__file__).resolve().parent
KMOD_DIR = SIM_DIR.parents[1] / "flowpacer" / "kernel" / "kmod"
SOURCES = (SIM_DIR / "psp_sim.c", KMOD_DIR / "psp_sched.h", KMOD_DIR / "psp_tree.h",
           SIM_DIR / "kshim.h", KMOD_DIR / "uapi" / "pkt_sch_psp.h")
LIB_PATH = SIM_DIR / "build" / "libpspsim.so"
CFLAGS = ("-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared")

# enum psp_send (psp_sched.h)
NONE, PACED, UNPACED, BORROW = 0, 1, 2, 3
NSEC = 1_000_000_000


class SimError(Exception):
    """The simulator could not be built or refused a call."""


class Pkt(ctypes.Structure):
    _fields_ = [("t", ctypes.c_uint64), ("cls", ctypes.c_uint32), ("len", ctypes.c_uint32),
                ("kind", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


PKT_DTYPE = np.dtype([("t", "<u8"), ("cls", "<u4"), ("len", "<u4"), ("kind", "<u4"), ("pad", "<u4")])


class XStats(ctypes.Structure):
    """struct tc_psp_xstats (uapi/pkt_sch_psp.h)."""
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "link_rate", "rate_sum", "paced_pkts", "borrowed_pkts", "unpaced_pkts", "late_ns_total",
        "late_ns_max", "clamps", "timer_fires", "timer_late_ns_max", "gso_split",
        "longest_run")] + [
        ("classes", ctypes.c_uint32), ("active", ctypes.c_uint32)]


class ClassXStats(ctypes.Structure):
    """struct tc_psp_class_xstats (uapi/pkt_sch_psp.h)."""
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "rate", "ceil", "eff_rate", "rate_est", "borrowed_bytes", "borrowed_pkts", "clamps",
        "late_ns_max")] + [("clock_ns", ctypes.c_int64), ("limit", ctypes.c_uint32),
                           ("flags", ctypes.c_uint32), ("group_sum", ctypes.c_uint64),
                           ("group_held", ctypes.c_uint64), ("members", ctypes.c_uint32),
                           ("pad", ctypes.c_uint32)]


def _stale() -> bool:
    if not LIB_PATH.exists():
        return True
    built = LIB_PATH.stat().st_mtime
    return any(src.stat().st_mtime > built for src in SOURCES)


def build(force: bool = False) -> Path:
    """Compile the simulator library if needed; returns its path."""
    if not force and not _stale():
        return LIB_PATH
    LIB_PATH.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libpspsim.", suffix=".so", dir=LIB_PATH.parent)
    os.close(fd)
    cmd = ["gcc", *CFLAGS, "-I", str(KMOD_DIR), "-o", tmp, str(SOURCES[0])]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise SimError("building the psp simulator failed: " + " | ".join(
                p.stderr.strip().splitlines()[:5]))
        os.replace(tmp, LIB_PATH)
    except OSError as e:
        raise SimError(f"cannot run gcc to build the psp simulator: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", LIB_PATH)
    return LIB_PATH


_lib: Optional[ctypes.CDLL] = None


def load() -> ctypes.CDLL:
    """The simulator library, built on first use."""
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(str(build()))
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    vp, ip, lp = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    sig = {
        "psp_sim_new": (vp, [u64, u32]),
        "psp_sim_free": (None, [vp]),
        "psp_sim_set_link": (None, [vp, u64, u32]),
        "psp_sim_set_catchup": (None, [vp, u64]),
        "psp_sim_add_class": (ip, [vp, u64, u64, u32]),
        "psp_sim_change_class": (ip, [vp, ip, u64, u64, u32, u64]),
        "psp_sim_del_class": (ip, [vp, ip]),
        "psp_sim_enqueue": (ip, [vp, ip, u32, u64]),
        "psp_sim_set_greedy": (ip, [vp, ip, u32, u64]),
        "psp_sim_dequeue": (ip, [vp, u64, ctypes.POINTER(Pkt)]),
        "psp_sim_run": (lp, [vp, u64, u64, u64, vp, lp, ctypes.POINTER(u64)]),
        "psp_sim_xstats": (None, [vp, ctypes.POINTER(XStats)]),
        "psp_sim_class_xstats": (ip, [vp, ip, u64, ctypes.POINTER(ClassXStats)]),
        "psp_sim_class_counts": (ip, [vp, ip, ctypes.POINTER(u64 * 4)]),
        "psp_sim_sizeof": (u32, [ip]),
        "psp_sim_tree_check": (lp, [u64, u32, u32]),
        "psp_sim_add_group": (ip, [vp, ip, u64]),
        "psp_sim_set_group_rate": (ip, [vp, ip, u64]),
        "psp_sim_del_group": (ip, [vp, ip]),
        "psp_sim_set_class_group": (ip, [vp, ip, ip, u64]),
        "psp_sim_group_stats": (ip, [vp, ip, u64, ctypes.POINTER(u64 * 7)]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    for which, struct in enumerate((Pkt, XStats, ClassXStats)):
        if lib.psp_sim_sizeof(which) != ctypes.sizeof(struct):
            raise SimError(f"{struct.__name__}: C says {lib.psp_sim_sizeof(which)} bytes, "
                           f"ctypes {ctypes.sizeof(struct)}")
    _lib = lib
    return lib


def tree_check(seed: int, nodes: int, ops: int) -> int:
    """Random inserts, erases and requeues on one of the module's trees (``psp_tree.h`` on the
    simulator's rbtree), each checked against a brute-force minimum and the red-black rules:
    0, or the 1-based number of the first operation that went wrong."""
    r = load().psp_sim_tree_check(seed, nodes, ops)
    if r < 0:
        raise SimError("tree check: out of memory")
    return r


class Sim:
    """One simulated psp qdisc. Classes are numbered 0, 1, ... in the order they are added."""

    def __init__(self, link_rate: int, overhead: int = 0):
        self._lib = load()
        self._h = self._lib.psp_sim_new(link_rate, overhead)
        if not self._h:
            raise SimError(f"bad link rate {link_rate}")
        self.now = 0

    def close(self) -> None:
        if self._h:
            self._lib.psp_sim_free(self._h)
            self._h = None

    def __enter__(self) -> "Sim":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -------------------------------------------------------------- setup
    def set_link(self, link_rate: int, overhead: int = 0) -> None:
        self._lib.psp_sim_set_link(self._h, link_rate, overhead)

    def set_catchup(self, catchup_ns: int) -> None:
        """The qdisc's catch-up window (TCA_PSP_CATCHUP); a new Sim has the module's default."""
        self._lib.psp_sim_set_catchup(self._h, catchup_ns)

    def add_class(self, rate: int, ceil: int = 0, limit: int = 0) -> int:
        """rate 0: unpaced (like the module's default class). ceil 0: equal to rate."""
        c = self._lib.psp_sim_add_class(self._h, rate, ceil, limit)
        if c < 0:
            raise SimError(f"cannot add class rate={rate} ceil={ceil}")
        return c

    def change_class(self, cls: int, rate: int, ceil: int = 0, limit: int = 0,
                     now: Optional[int] = None) -> None:
        if self._lib.psp_sim_change_class(self._h, cls, rate, ceil, limit,
                                          self.now if now is None else now):
            raise SimError(f"cannot change class {cls}")

    def del_class(self, cls: int) -> None:
        if self._lib.psp_sim_del_class(self._h, cls):
            raise SimError(f"no class {cls}")

    # ------------------------------------------------------------- groups
    def add_group(self, rate: int, parent: Optional[int] = None) -> int:
        """A group (aggregate cap ``rate``) under group ``parent`` (None: the link); its id.
        Groups are numbered 0, 1, ... apart from the classes."""
        g = self._lib.psp_sim_add_group(self._h, -1 if parent is None else parent, rate)
        if g < 0:
            raise SimError(f"cannot add group rate={rate} parent={parent}")
        return g

    def set_group_rate(self, grp: int, rate: int) -> None:
        if self._lib.psp_sim_set_group_rate(self._h, grp, rate):
            raise SimError(f"cannot set group {grp}'s rate to {rate}")

    def del_group(self, grp: int) -> None:
        """Refused (SimError) while it has members, as in the module."""
        if self._lib.psp_sim_del_group(self._h, grp):
            raise SimError(f"cannot delete group {grp}")

    def set_class_group(self, cls: int, grp: Optional[int], now: Optional[int] = None) -> None:
        if self._lib.psp_sim_set_class_group(self._h, cls, -1 if grp is None else grp,
                                             self.now if now is None else now):
            raise SimError(f"cannot put class {cls} into group {grp}")

    def group_stats(self, grp: int, now: Optional[int] = None) -> dict:
        """rate, sum (demand of its busy members), active, members, clock_ns (clock - now),
        rate_est, held (times a member waited for the group's clock)."""
        out = (ctypes.c_uint64 * 7)()
        now = self.now if now is None else now
        if self._lib.psp_sim_group_stats(self._h, grp, now, ctypes.byref(out)):
            raise SimError(f"no group {grp}")
        d = dict(zip(("rate", "sum", "active", "members", "clock_ns", "rate_est", "held"), out))
        d["clock_ns"] = ctypes.c_int64(d["clock_ns"]).value
        return d

    # ------------------------------------------------------------ traffic
    def enqueue(self, cls: int, length: int, now: Optional[int] = None) -> bool:
        """Queue one packet; False when the class's limit dropped it."""
        r = self._lib.psp_sim_enqueue(self._h, cls, length, self.now if now is None else now)
        if r < 0:
            raise SimError(f"cannot enqueue to class {cls}")
        return r == 0

    def greedy(self, cls: int, length: int, now: Optional[int] = None) -> None:
        """Make a class an endless source of ``length``-byte packets (0: stop)."""
        if self._lib.psp_sim_set_greedy(self._h, cls, length, self.now if now is None else now):
            raise SimError(f"no class {cls}")

    def dequeue(self, now: int) -> Tuple[Optional[Pkt], int]:
        """(packet, 0) if one leaves at ``now``, else (None, next wake time or 0 when idle)."""
        p = Pkt()
        self.now = now
        if self._lib.psp_sim_dequeue(self._h, now, ctypes.byref(p)):
            return p, 0
        return None, p.t

    def run(self, until: int, start: Optional[int] = None, late_ns: int = 0,
            max_log: int = 1_000_000, log: bool = True):
        """Run the event loop from ``start`` (default: where the last run ended) up to ``until``.

        Every time nothing may leave, the clock jumps to the next wake time plus ``late_ns`` (a
        timer that always fires late). Returns the departures as a numpy array with fields t,
        cls, len, kind (the first ``max_log``), or their count when ``log`` is False.
        """
        begin = self.now if start is None else start
        end = ctypes.c_uint64(0)
        if log:
            buf = np.zeros(max_log, dtype=PKT_DTYPE)
            n = self._lib.psp_sim_run(self._h, begin, until, late_ns,
                                      buf.ctypes.data_as(ctypes.c_void_p), max_log,
                                      ctypes.byref(end))
            self.now = end.value
            return buf[:min(n, max_log)]
        n = self._lib.psp_sim_run(self._h, begin, until, late_ns, None, 0, ctypes.byref(end))
        self.now = end.value
        return n

    # -------------------------------------------------------------- stats
    def xstats(self) -> XStats:
        st = XStats()
        self._lib.psp_sim_xstats(self._h, ctypes.byref(st))
        return st

    def class_xstats(self, cls: int, now: Optional[int] = None) -> ClassXStats:
        xs = ClassXStats()
        if self._lib.psp_sim_class_xstats(self._h, cls, self.now if now is None else now,
                                          ctypes.byref(xs)):
            raise SimError(f"no class {cls}")
        return xs

    def counts(self, cls: int) -> dict:
        """pkts, bytes, drops, qlen of a class."""
        out = (ctypes.c_uint64 * 4)()
        if self._lib.psp_sim_class_counts(self._h, cls, ctypes.byref(out)):
            raise SimError(f"no class {cls}")
        return dict(zip(("pkts", "bytes", "drops", "qlen"), out))
