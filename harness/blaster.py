"""Traffic for the demo, tests and benchmarks: a small HTTP delivery server and a measuring client.

    python -m harness.blaster serve --ports 8081,8082 [--name fp-demo-srv] [--v6] [--mark 0x29]
    python -m harness.blaster fetch --host H --port P --seconds 5 [--warmup 1]

``serve`` sets its process name (comm) so that rules can match it, listens on each port and
answers ``GET /`` with an endless generated body (``GET /N`` with N bytes), one thread per
client; ``GET /upload/N`` sends N bytes and then reads what the client uploads on the same
connection until it closes. ``fetch`` downloads for a bounded time and prints one JSON line:
bytes and goodput (bytes/s) measured after the warm-up, as the receiver saw them; SIGTERM ends
the download early, with the same line (a caller that only knows afterwards how long it needs
the traffic: ``--seconds`` stays the bound).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time

CHUNK = b"flowpacer" * 7282  # ~64 KiB of generated payload


class _Stop(Exception):
    """SIGTERM asked a fetch to end now (see main())."""


def _stop(signum, frame):
    raise _Stop()


def set_comm(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NAME = 15
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _client(conn: socket.socket, priority: int = 0) -> None:
    with conn:
        if priority:        # an accepted socket does not inherit its listener's priority
            conn.setsockopt(socket.SOL_SOCKET, SO_PRIORITY, priority.to_bytes(4, sys.byteorder))
        conn.settimeout(30)
        try:
            req = b""
            while b"\r\n\r\n" not in req and len(req) < 8192:
                d = conn.recv(4096)
                if not d:
                    return
                req += d
            path = req.split(b" ", 2)[1] if req.count(b" ") >= 2 else b"/"
            # "/upload/N": N bytes, then the connection stays open for the client's upload
            upload = path.startswith(b"/upload/")
            if upload:
                path = path[len(b"/upload"):]
            want = int(path[1:]) if path[1:].isdigit() else None
            # whatever the client sends after its request is read and dropped: a client may
            # upload on the same connection (tests of both directions)
            drain = threading.Thread(target=_drain, args=(conn,), daemon=True)
            drain.start()
            hdr = b"HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\n"
            if want is not None:
                hdr += b"Content-Length: %d\r\n" % want
            conn.sendall(hdr + b"\r\n")
            left = want
            while left is None or left > 0:
                n = len(CHUNK) if left is None else min(left, len(CHUNK))
                conn.sendall(CHUNK[:n])
                if left is not None:
                    left -= n
            if upload:
                drain.join()      # the body is out: the connection stays until the client ends
        except OSError:
            return


def _drain(conn: socket.socket) -> None:
    buf = bytearray(1 << 16)
    try:
        while conn.recv_into(buf):
            pass
    except OSError:
        return


SO_MARK = 36          # socket(7): the socket's mark (policy routing by fwmark)
SO_PRIORITY = 12      # socket(7): the priority of the socket's packets (skb->priority)


def serve(ports, v6: bool, name: str, mark: int = 0, priority: int = 0) -> None:
    """``mark``: SO_MARK on the listeners, which the sockets they accept inherit; ``priority``:
    SO_PRIORITY on each accepted socket, right after accept() (an accepted TCP socket does not
    inherit its listener's: measured on 6.1 and 6.18), as a server sets its own; above 6 it
    needs CAP_NET_ADMIN (any 32-bit value: the first-byte program's class ids)."""
    set_comm(name)
    socks = []
    for p in ports:
        s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if mark:
            s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
        if v6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::" if v6 else "0.0.0.0", p))
        s.listen(1024)
        socks.append(s)

    def loop(s):
        while True:
            conn, _ = s.accept()
            threading.Thread(target=_client, args=(conn, priority), daemon=True).start()

    for s in socks[1:]:
        threading.Thread(target=loop, args=(s,), daemon=True).start()
    loop(socks[0])


def fetch(host: str, port: int, seconds: float, warmup: float, name: str, nbytes=None,
          local_port: int = 0, interval: float = 0.0, path: str = "") -> dict:
    set_comm(name)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    if local_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", local_port))
    s.settimeout(max(5.0, seconds))
    t0 = time.monotonic()
    s.connect((host, port))
    local = s.getsockname()
    target = path.encode() if path else b"/%s" % (str(nbytes).encode() if nbytes else b"")
    s.sendall(b"GET %s HTTP/1.0\r\n\r\n" % target)
    buf = bytearray(1 << 16)
    total = measured = 0
    t_start = None
    end = t0 + seconds
    samples = []
    next_sample = t0
    try:
        while True:
            now = time.monotonic()
            if now >= end:
                break
            s.settimeout(max(0.05, end - now))
            try:
                n = s.recv_into(buf)
            except socket.timeout:
                break
            if not n:
                break
            total += n
            now = time.monotonic()
            if interval and now >= next_sample:
                samples.append((round(now - t0, 4), total))
                next_sample = now + interval
            if now - t0 >= warmup:
                if t_start is None:
                    t_start = now
                else:
                    measured += n
    except _Stop:
        pass
    t_end = time.monotonic()
    s.close()
    span = (t_end - t_start) if t_start else 0.0
    return {"host": host, "port": port, "local_port": local[1], "bytes": total, "t0_monotonic": t0,
            "measured_bytes": measured, "measured_s": span,
            "goodput_bps": measured / span if span > 0 else 0.0,
            **({"samples": samples} if interval else {})}


def _raise_nofile() -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _dual_stack_listener(port: int, name: str) -> socket.socket:
    """A listener for IPv4 and IPv6 on ``port``, in a process named ``name`` with all its fds."""
    _raise_nofile()
    set_comm(name)
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    s.listen(4096)
    return s


def hold_serve(port: int, name: str) -> None:
    """Accept connections and keep them open (many idle flows for scale tests)."""
    s = _dual_stack_listener(port, name)
    held = []
    while True:
        conn, _ = s.accept()
        held.append(conn)


def hold_connect(host: str, port: int, count: int, seconds: float, name: str) -> dict:
    """Open ``count`` connections, keep them ``seconds`` (or until stdin closes), close them."""
    import select
    _raise_nofile()
    set_comm(name)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = []
    t0 = time.monotonic()
    for _ in range(count):
        c = socket.socket(fam, socket.SOCK_STREAM)
        c.connect((host, port))
        socks.append(c)
    opened = time.monotonic() - t0
    print(json.dumps({"opened": len(socks), "open_s": opened}), flush=True)
    select.select([sys.stdin], [], [], seconds)
    for c in socks:
        c.close()
    return {"closed": len(socks)}


def burst_serve(port: int, nbytes: int, name: str) -> None:
    """Accept, send ``nbytes`` at once, close: one short flow per connection, no threads."""
    s = _dual_stack_listener(port, name)
    payload = (CHUNK * (nbytes // len(CHUNK) + 1))[:nbytes]
    while True:
        conn, _ = s.accept()
        try:
            if payload:
                conn.sendall(payload)
        except OSError:
            pass
        conn.close()


def churn(host: str, port: int, rate: float, seconds: float, name: str) -> dict:
    """Open+read+close connections at ``rate`` per second for ``seconds``; one JSON summary."""
    _raise_nofile()
    set_comm(name)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    t0 = time.monotonic()
    done = errors = 0
    nbytes = 0
    buf = bytearray(1 << 16)
    while True:
        now = time.monotonic()
        if now - t0 >= seconds:
            break
        due = t0 + done / rate if rate > 0 else now
        if due > now:
            time.sleep(due - now)
        c = socket.socket(fam, socket.SOCK_STREAM)
        c.settimeout(5)
        try:
            c.connect((host, port))
            while True:
                n = c.recv_into(buf)
                if not n:
                    break
                nbytes += n
        except OSError:
            errors += 1
        finally:
            c.close()
        done += 1
    span = time.monotonic() - t0
    return {"flows": done, "errors": errors, "seconds": span, "rate": done / span, "bytes": nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="blaster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("serve")
    a.add_argument("--ports", required=True)
    a.add_argument("--name", default="fp-demo-srv")
    a.add_argument("--v6", action="store_true")
    a.add_argument("--mark", type=lambda x: int(x, 0), default=0,
                   help="SO_MARK of the listeners (and so of the flows they accept)")
    a.add_argument("--priority", type=lambda x: int(x, 0), default=0,
                   help="SO_PRIORITY of the listeners (and so of the flows they accept)")
    b = sub.add_parser("fetch")
    b.add_argument("--host", required=True)
    b.add_argument("--port", type=int, required=True)
    b.add_argument("--seconds", type=float, default=5.0)
    b.add_argument("--warmup", type=float, default=1.0)
    b.add_argument("--name", default="fp-client")
    b.add_argument("--bytes", type=int, default=None)
    b.add_argument("--local-port", type=int, default=0)
    b.add_argument("--path", default="",
                   help="ask for this path (another HTTP server's big file) instead of /BYTES")
    b.add_argument("--interval", type=float, default=0.0,
                   help="also record (seconds, bytes so far) every INTERVAL seconds")
    h = sub.add_parser("hold-serve")
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--name", default="fp-hold-srv")
    hc = sub.add_parser("hold-connect")
    hc.add_argument("--host", required=True)
    hc.add_argument("--port", type=int, required=True)
    hc.add_argument("--count", type=int, required=True)
    hc.add_argument("--seconds", type=float, default=60)
    hc.add_argument("--name", default="fp-hold-cli")
    bs = sub.add_parser("burst-serve")
    bs.add_argument("--port", type=int, required=True)
    bs.add_argument("--bytes", type=int, default=0)
    bs.add_argument("--name", default="fp-burst-srv")
    ch = sub.add_parser("churn")
    ch.add_argument("--host", required=True)
    ch.add_argument("--port", type=int, required=True)
    ch.add_argument("--rate", type=float, required=True)
    ch.add_argument("--seconds", type=float, default=5)
    ch.add_argument("--name", default="fp-churn-cli")
    args = ap.parse_args(argv)
    if args.cmd == "burst-serve":
        burst_serve(args.port, args.bytes, args.name)
        return 0
    if args.cmd == "churn":
        print(json.dumps(churn(args.host, args.port, args.rate, args.seconds, args.name)))
        return 0
    if args.cmd == "hold-serve":
        hold_serve(args.port, args.name)
        return 0
    if args.cmd == "hold-connect":
        print(json.dumps(hold_connect(args.host, args.port, args.count, args.seconds, args.name)))
        return 0
    if args.cmd == "serve":
        serve([int(p) for p in args.ports.split(",")], args.v6, args.name, args.mark, args.priority)
        return 0
    signal.signal(signal.SIGTERM, _stop)
    try:
        r = fetch(args.host, args.port, args.seconds, args.warmup, args.name, args.bytes,
                  args.local_port, args.interval, args.path)
    except (OSError, _Stop) as e:
        print(json.dumps({"error": str(e) or "stopped before the download began"}))
        return 1
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
