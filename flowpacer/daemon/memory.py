"""Giving memory back to the kernel: the daemon's transient peaks (bcc's compile, a 10 000-flow
batch or scrape) would otherwise stay in its RSS, because glibc keeps freed heap."""
from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

MADV_PAGEOUT = 21

# The cyclic collector's thresholds once the daemon runs: (allocations between generation-0
# passes, generation-0 passes between generation-1 passes, generation-1 passes between full
# ones). With Python's (700, 10, 10) a burst of new flows (a dozen tracked objects each: flow,
# key, records, requests) runs a full collection every ~70 000 allocations, each a walk of every
# live flow's objects: at 10 000 flows 32 us of a new flow's ~110 us of CPU went to the
# collector, 22 of it in full collections (issue 26, measured with gc.callbacks). The daemon
# frees its flows by reference counting (they hold no cycles), so fewer passes cost nothing
# but a later reclaim of the rare cycle: with these, 9 us a flow, no full collection in a burst.
GC_THRESHOLDS = (20_000, 20, 10)


def trim_heap() -> None:
    """Hand freed heap back to the kernel (glibc keeps it after big transient batches)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_compiler_memory() -> None:
    """Give back what bcc's one-off compile left behind (~170 MB of RSS otherwise).

    The LLVM/clang heap is returned with malloc_trim, and the pages of the LLVM and clang
    libraries (clean, file-backed, needed again only for another compile) are paged out.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.malloc_trim(0)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or not any(n in parts[5] for n in ("libLLVM", "libclang")):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                libc.madvise(lo, hi - lo, MADV_PAGEOUT)
    except (OSError, AttributeError) as e:
        log.debug("release_compiler_memory: %s", e)


def tune_gc() -> None:
    """After start-up: collect once, freeze what is there (bcc, the rules: out of every later
    collection's work) and space the collector's passes out (``GC_THRESHOLDS``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
