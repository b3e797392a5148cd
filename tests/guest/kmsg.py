"""Read the kernel log from a point on (/dev/kmsg) and find lines that mean a kernel bug."""
from __future__ import annotations

import errno
import os
import re
from typing import List

BAD = re.compile(r"WARNING|BUG|Oops|general protection|KASAN|refcount_t")


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
