"""Read the kernel log from a point on (/dev/kmsg) and find lines that mean a kernel bug:
WARNING/BUG/Oops, KASAN, refcount_t, the hung-task detector's "INFO: task ... blocked for more
than N seconds", lockdep's "possible circular locking dependency" and the like (the pattern is
``vm.run.DMESG_BAD``, which the host checks each VM run's whole log against too)."""
from __future__ import annotations

import errno
import os
from typing import List

from vm.run import DMESG_BAD as BAD


def problems(lines: List[str]) -> List[str]:
    return [ln for ln in lines if BAD.search(ln)]


class KmsgReader:
    """Opened at the end of the log: ``read_new()`` returns the messages logged since."""

    def __init__(self) -> None:
        self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)

    def read_new(self) -> List[str]:
        out: List[str] = []
        while True:
            try:
                rec = os.read(self.fd, 16384)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten before we read it: go on
                    out.append("(kmsg: some messages were lost, the log wrapped)")
                    continue
                raise
            if not rec:
                break
            text = rec.decode(errors="replace")
            head, _, body = text.partition(";")
            # continuation lines (" KEY=value") carry device metadata, not text
            msg = body.split("\n", 1)[0]
            out.append(msg)
        return out

    def close(self) -> None:
        os.close(self.fd)
