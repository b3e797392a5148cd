"""Where the daemon's log records go, and with what priority.

Under systemd (``JOURNAL_STREAM`` names the stream our stderr is, as systemd.exec(5) says),
records go to journald's native socket with their syslog priority and structured fields:
``PRIORITY``, ``SYSLOG_IDENTIFIER``, ``LOGGER``, ``CODE_FILE``/``CODE_LINE``/``CODE_FUNC``,
``THREAD_NAME`` and any ``FLOWPACER_*`` given in a call's ``extra`` (e.g. ``FLOWPACER_RULE``).
``journalctl -p warning -u flowpacer`` then shows warnings and worse, and
``journalctl -u flowpacer FLOWPACER_RULE=downloads`` one rule's records. When the socket cannot
be reached the record is written to stderr with a ``<N>`` prefix (sd-daemon(3)), which
journald reads as its priority. Anywhere else: plain lines with a time stamp on stderr.

``-v`` gives debug records of flowpacer's own loggers, ``-vv`` also of the libraries
(pyroute2).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import sys
from typing import Mapping, Optional, TextIO

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "flowpacer"
MAX_FIELD = 48 * 1024            # bytes of one field: a record stays one datagram

# syslog(3) priorities of Python's levels (between two levels, the more severe one's)
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
               (logging.INFO, 6))


def priority(levelno: int) -> int:
    """A record's level -> its syslog priority: ERROR 3, WARNING 4, INFO 6, DEBUG 7."""
    for level, prio in _PRIORITIES:
        if levelno >= level:
            return prio
    return 7


def under_journal(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is the journal stream systemd connected us to (``JOURNAL_STREAM`` is
    its "DEVICE:INODE"; a child that inherited the variable but not the stream says no)."""
    want = environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


class PriorityFormatter(logging.Formatter):
    """Each line of a record prefixed with ``<N>``, its syslog priority (a traceback's lines
    too: journald takes every line as an entry of its own)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.split("\n"))


def _field(name: str, value: object) -> bytes:
    data = str(value).encode("utf-8", "backslashreplace")[:MAX_FIELD]
    key = name.encode("ascii")
    if b"\n" in data:                 # the protocol's binary form: NAME\n, le64 size, data\n
        return key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key + b"=" + data + b"\n"


def _field_name(key: str) -> Optional[str]:
    """An ``extra`` key that names a journal field of ours: FLOWPACER_[A-Z0-9_]+."""
    if key.startswith("FLOWPACER_") and key.replace("_", "").isalnum() and key.isupper():
        return key
    return None


class JournalHandler(logging.Handler):
    """Records to journald's native socket (one datagram each), with structured fields. A
    record that cannot be sent goes to ``fallback`` (stderr with a priority prefix)."""

    def __init__(self, path: str = JOURNAL_SOCKET, fallback: Optional[logging.Handler] = None):
        super().__init__()
        self.path = path
        self.fallback = fallback
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def fields(self, record: logging.LogRecord) -> bytes:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        out = [_field("MESSAGE", message), _field("PRIORITY", priority(record.levelno)),
               _field("SYSLOG_IDENTIFIER", IDENTIFIER), _field("LOGGER", record.name),
               _field("CODE_FILE", record.pathname), _field("CODE_LINE", record.lineno),
               _field("CODE_FUNC", record.funcName), _field("THREAD_NAME", record.threadName)]
        for key, value in record.__dict__.items():
            name = _field_name(key)
            if name is not None:
                out.append(_field(name, value))
        return b"".join(out)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sock.sendto(self.fields(record), self.path)
        except OSError:
            if self.fallback is not None:
                self.fallback.handle(record)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def setup(verbose: int = 0, stream: Optional[TextIO] = None,
          environ: Optional[Mapping[str, str]] = None,
          journal_socket: str = JOURNAL_SOCKET) -> logging.Handler:
    """The root logger's one handler, as the module's docstring says; returns it."""
    stream = stream if stream is not None else sys.stderr
    environ = environ if environ is not None else os.environ
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    if under_journal(stream, environ):
        prefixed = logging.StreamHandler(stream)
        prefixed.setFormatter(PriorityFormatter("%(levelname)s %(name)s: %(message)s"))
        handler: logging.Handler = prefixed
        if os.path.exists(journal_socket):
            handler = JournalHandler(journal_socket, fallback=prefixed)
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("flowpacer").setLevel(logging.DEBUG if verbose else logging.NOTSET)
    if verbose > 1:
        root.setLevel(logging.DEBUG)
    logging.getLogger("pyroute2").setLevel(logging.NOTSET if verbose > 1 else logging.WARNING)
    return handler
