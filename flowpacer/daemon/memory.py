"""Giving memory back to the kernel: the daemon's transient peaks (bcc's compile, a 10 000-flow
batch or scrape) would otherwise stay in its RSS, because glibc keeps freed heap."""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

MADV_PAGEOUT = 21


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
