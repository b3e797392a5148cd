"""The delivery server of the access benchmark (issue 30): one process, one thread, a dual-stack
listener per port, each port serving one kind of traffic to whoever connects.

    python -m harness.accesssrv SPEC.json     # in the server's namespace

SPEC: ``{"ports": [{"port": 5700, "mode": "download"|"stream", "max_pacing_rate": 0,
"bitrate": 250000, "preroll_s": 2.0, "chunk_s": 0.1}, ...], "cc": "cubic", "hold": PATH,
"seconds": 300}``. Rates in bytes/s.

Each connection reads an HTTP/1.1 request (up to its blank line) and is answered ``200`` with a
large Content-Length, then:

- ``download``: body bytes as fast as the socket takes them (a long download);
- ``stream``: a live stream of ``bitrate`` bytes/s: ``preroll_s`` of it at once, then a chunk
  of ``bitrate x chunk_s`` bytes every ``chunk_s`` (a music service's player fetch: a burst
  ahead, then the track's bitrate). A chunk the socket cannot take yet waits, so the stream's
  server side never falls behind its bitrate on its own.

``max_pacing_rate`` (bytes/s, 0: none): SO_MAX_PACING_RATE on the accepted socket, the EDT way
of capping a flow (fq paces it; Cilium's bandwidth manager does the same). ``cc``: the
listeners' TCP_CONGESTION. ``hold``: send nothing (not even the response's head) before that
file exists (so that a pacer can classify the connection first). Everything ends after
``seconds`` or on SIGTERM; a client that closes just ends its connection.
"""
from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Dict, Optional

SO_MAX_PACING_RATE = 47               # asm-generic/socket.h
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        b"Content-Length: 68719476736\r\nConnection: close\r\n\r\n")
ZEROS = memoryview(bytes(256 * 1024))


class Conn:
    def __init__(self, sock: socket.socket, spec: dict):
        self.sock, self.spec = sock, spec
        self.request = b""
        self.started: Optional[float] = None         # monotonic time of the response's start
        self.pending = 0                             # stream bytes due but not yet sent
        self.chunks = 0                              # stream chunks added after the preroll
        self.head = memoryview(HEAD)
        self.sent = 0

    @property
    def stream(self) -> bool:
        return self.spec["mode"] == "stream"

    def start(self, now: float) -> None:
        self.started = now
        if self.stream:
            self.pending = int(self.spec["bitrate"] * self.spec.get("preroll_s", 2.0))

    def due(self, now: float) -> None:
        """Add the stream chunks that are due by ``now``."""
        step = self.spec.get("chunk_s", 0.1)
        n = int((now - self.started) / step)
        if n > self.chunks:
            self.pending += int(self.spec["bitrate"] * step) * (n - self.chunks)
            self.chunks = n

    def wants_write(self) -> bool:
        return self.started is not None and (len(self.head) > 0 or not self.stream
                                             or self.pending > 0)

    def write(self) -> None:
        """Send what may go now; raises OSError when the peer is gone."""
        while True:
            if len(self.head):
                n = self.sock.send(self.head)
                self.head = self.head[n:]
                continue
            want = len(ZEROS) if not self.stream else min(len(ZEROS), self.pending)
            if want <= 0:
                return
            n = self.sock.send(ZEROS[:want])
            self.sent += n
            if self.stream:
                self.pending -= n
            if n < want:
                return


def listener(port: int, spec: dict, cc: str) -> socket.socket:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    if cc:
        s.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, cc.encode())
    s.bind(("::", port))
    s.listen(64)
    s.setblocking(False)
    return s


def serve(spec: dict) -> int:
    sel = selectors.DefaultSelector()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    for p in spec["ports"]:
        sel.register(listener(p["port"], p, spec.get("cc", "")), selectors.EVENT_READ, p)
    conns: Dict[int, Conn] = {}
    hold = spec.get("hold")
    released = not hold
    end = time.monotonic() + float(spec.get("seconds", 300))

    def drop(c: Conn) -> None:
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        conns.pop(c.sock.fileno(), None)
        c.sock.close()

    def interest(c: Conn) -> None:
        ev = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.wants_write() else 0)
        sel.modify(c.sock, ev, c)

    while not stop and time.monotonic() < end:
        now = time.monotonic()
        if not released and os.path.exists(hold):
            released = True
            for c in conns.values():
                if b"\r\n\r\n" in c.request and c.started is None:
                    c.start(now)
                    interest(c)
        for c in list(conns.values()):
            if c.started is not None and c.stream:
                before = c.pending
                c.due(now)
                if before == 0 and c.pending > 0 and len(c.head) == 0:
                    interest(c)
        timeout = 0.01 if (any(c.stream for c in conns.values()) or not released) else 0.2
        for key, ev in sel.select(timeout):
            obj = key.data
            if isinstance(obj, dict):                      # a listener
                try:
                    s, _ = key.fileobj.accept()
                except BlockingIOError:
                    continue
                s.setblocking(False)
                if obj.get("max_pacing_rate"):
                    s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(obj["max_pacing_rate"]))
                c = Conn(s, obj)
                conns[s.fileno()] = c
                sel.register(s, selectors.EVENT_READ, c)
                continue
            c = obj
            try:
                if ev & selectors.EVENT_READ:
                    data = c.sock.recv(4096)
                    if not data:
                        drop(c)
                        continue
                    if c.started is None:
                        c.request += data
                        if b"\r\n\r\n" in c.request and released:
                            c.start(time.monotonic())
                if ev & selectors.EVENT_WRITE:
                    c.write()
                interest(c)
            except OSError as e:
                if e.errno in (errno.EAGAIN,):
                    interest(c)
                    continue
                drop(c)
    for c in list(conns.values()):
        drop(c)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    return serve(spec)


if __name__ == "__main__":
    sys.exit(main())


NGINX_SERVER = """\
    server {{
        listen [::]:{port} ipv6only=off;
        root {dir}/www;
        limit_rate {rate};
    }}
"""


def nginx_conf(workdir: str, port_rates: Dict[int, int]) -> str:
    """An nginx configuration serving ``workdir``/www on each port (dual stack) with
    ``limit_rate`` at that port's rate (bytes/s, nginx's unit; 0: no limit)."""
    servers = "".join(NGINX_SERVER.format(port=p, dir=workdir, rate=int(r))
                      for p, r in sorted(port_rates.items()))
    from harness.servers import NGINX_HEAD
    return NGINX_HEAD.format(dir=workdir, workers=1) + servers + "}\n"
