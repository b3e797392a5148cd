"""The receivers of the access benchmark (issue 30): one process, one thread, one HTTP/1.1
download per client, each from inside its client's namespace (root: setns).

    python -m harness.accessclient SPEC.json OUT.json

SPEC: ``{"seconds": 8, "bin_s": 0.01, "clients": [{"index": 0, "ns": "fpa-x-c0",
"host": "10.90.0.1", "port": 5700, "path": "/big"}, ...]}``.

All connections start together (``t_start_ns``, CLOCK_REALTIME, the clock of the household
flows' stamps). Per connection it records the time to its first byte (the response's head:
``ttfb_s``, from the connect; to ~2 ms: it reads a pass every ``BATCH_S``) and the body bytes received in each ``bin_s`` bin from
``t_start_ns`` (``harness.accessfig`` turns them into goodput per second, time to first N KiB
and a player's stalls). After ``seconds`` it stops reading, prints ``done <ns>`` on stdout and
keeps the connections open (so the caller can read the server's counters first) until its
stdin closes (at most 120 s), then closes them and writes OUT.
"""
from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import sys
import time
from typing import List

from harness.testbed import in_netns

BATCH_S = 0.002


class Rx:
    def __init__(self, c: dict, sock: socket.socket, nbins: int):
        self.c, self.sock = c, sock
        self.head = b""
        self.in_body = False
        self.ttfb_s = None
        self.connected_s = None
        self.body = 0
        self.bins: List[int] = [0] * nbins
        self.error = None


def run(spec: dict) -> dict:
    seconds = float(spec["seconds"])
    bin_s = float(spec.get("bin_s", 0.01))
    nbins = int(round(seconds / bin_s))
    sel = selectors.DefaultSelector()
    rxs: List[Rx] = []
    for c in spec["clients"]:
        fam = socket.AF_INET6 if ":" in c["host"] else socket.AF_INET
        with in_netns(c["ns"]):
            s = socket.socket(fam, socket.SOCK_STREAM)
        s.setblocking(False)
        rxs.append(Rx(c, s, nbins))
    t0_ns = time.time_ns()
    m0 = time.monotonic()
    for r in rxs:
        try:
            r.sock.connect((r.c["host"], int(r.c["port"])))
        except BlockingIOError:
            pass
        sel.register(r.sock, selectors.EVENT_WRITE, r)
    end = m0 + seconds
    while True:
        now = time.monotonic()
        if now >= end:
            break
        events = sel.select(min(0.05, end - now))
        for key, ev in events:
            r = key.data
            now = time.monotonic()
            try:
                if ev & selectors.EVENT_WRITE:
                    err = r.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    r.connected_s = now - m0
                    r.sock.send(f"GET {r.c.get('path', '/big')} HTTP/1.1\r\nHost: server\r\n"
                                "\r\n".encode())
                    sel.modify(r.sock, selectors.EVENT_READ, r)
                    continue
                data = r.sock.recv(262144)
                if not data:
                    r.error = "closed by the server"
                    sel.unregister(r.sock)
                    continue
                if r.ttfb_s is None:
                    r.ttfb_s = now - m0
                if not r.in_body:
                    r.head += data
                    k = r.head.find(b"\r\n\r\n")
                    if k < 0:
                        continue
                    r.in_body = True
                    n = len(r.head) - k - 4
                    r.head = r.head[:k]
                else:
                    n = len(data)
                r.body += n
                i = int((now - m0) / bin_s)
                if i < nbins:
                    r.bins[i] += n
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    continue
                r.error = f"{e.__class__.__name__}: {e}"
                try:
                    sel.unregister(r.sock)
                except (KeyError, ValueError):
                    pass
        if events:
            # let data gather: a pass per ~2 ms, not one per packet (the guest has one vCPU)
            time.sleep(BATCH_S)
    print(f"done {time.time_ns()}", flush=True)
    # hold the connections until the caller has its counters
    sel2 = selectors.DefaultSelector()
    sel2.register(sys.stdin, selectors.EVENT_READ)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if sel2.select(1.0) and not sys.stdin.buffer.read1(4096):
            break
    for r in rxs:
        r.sock.close()
    return {"t_start_ns": t0_ns, "bin_s": bin_s, "seconds": seconds,
            "clients": [{"index": r.c["index"], "port": r.c["port"], "ttfb_s": _r(r.ttfb_s),
                         "connect_s": _r(r.connected_s), "head": r.head[:200].decode(errors="replace"),
                         "body_bytes": r.body, "bins": r.bins, "error": r.error} for r in rxs]}


def _r(x):
    return None if x is None else round(x, 5)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    out = run(spec)
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
