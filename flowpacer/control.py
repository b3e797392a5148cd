"""The control socket: one JSON request per connection, one JSON answer.

The socket is created with mode 0600 in a directory of mode 0700, and every peer's credentials
are checked (SO_PEERCRED): only root (or the daemon's own uid) may ask anything.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
from typing import Callable, Dict, Optional

from .errors import FlowpacerError

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/flowpacer/control.sock"
MAX_REQUEST = 64 * 1024


class ControlServer:
    def __init__(self, path: str, handler: Callable[[dict], dict]):
        self.path = path
        self.handler = handler
        d = os.path.dirname(path) or "."
        os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self.sock.listen(16)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def serve_one(self) -> None:
        """Accept one pending connection and answer it (called when the socket is readable)."""
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                pid, uid, gid = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                if uid not in (0, os.getuid()):
                    log.warning("control: refused uid %d (pid %d)", uid, pid)
                    conn.sendall(b'{"error": "permission denied"}\n')
                    return
                data = b""
                while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                try:
                    req = json.loads(data.decode() or "{}")
                    if not isinstance(req, dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    answer = {"error": f"bad request: {e}"}
                else:
                    answer = self.handler(req)
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError as e:
                log.debug("control: %s", e)

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def call(path: str, request: Dict, timeout: float = 30.0) -> dict:
    """Send one request to a running daemon; raises FlowpacerError with a one-line reason."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except OSError as e:
            raise FlowpacerError(f"no daemon answers on {path}: {e.strerror}") from None
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise FlowpacerError(f"control socket {path}: {e}") from None
    finally:
        s.close()
    try:
        answer = json.loads(data.decode())
    except ValueError:
        raise FlowpacerError(f"control socket {path}: unreadable answer") from None
    if "error" in answer:
        raise FlowpacerError(answer["error"])
    return answer
