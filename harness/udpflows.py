"""UDP test traffic (issue 17): a streamer answering many peers on ONE unconnected socket (what a
QUIC server does), with a TCP listener on the same port, and its receiving client.

    python -m harness.udpflows serve --port 7001 --name fp-udp-srv
    python -m harness.udpflows recv --host 10.77.1.1 --port 7001 --seconds 4 --warmup 1 \\
        --rate 25000000 [--size 1200] [--bind-port 40001] [--tcp]

``serve``: a dual-stack UDP socket on ``[::]:PORT`` (IPv4 peers arrive IPv4-mapped), never
connected: a datagram ``go SECONDS RATE_BIT SIZE`` from a peer starts a thread that sends that
peer SIZE-byte datagrams at RATE_BIT for SECONDS with ``sendto``; and a dual-stack TCP listener on
the same port that sends as fast as it can for the SECONDS in the client's first line.
``recv``: asks for a stream and counts the payload received after the warm-up; prints one JSON
line ``{"goodput_bps": bytes/s, "bytes": ..., "datagrams": ..., "seconds": ...}``.
Every loop is bounded in time.
"""
from __future__ import annotations

import argparse
import errno
import json
import socket
import threading
import time

from flowpacer.tools.blaster import set_comm

MAX_SECONDS = 60.0


def _stream_udp(sock: socket.socket, peer, seconds: float, rate_bit: float, size: int) -> None:
    payload = b"\0" * size
    start = time.monotonic()
    end = start + min(seconds, MAX_SECONDS)
    n = 0
    while True:
        now = time.monotonic()
        if now >= end:
            return
        due = start + n * size * 8 / rate_bit
        if due > now:
            time.sleep(min(due - now, 0.002))
            continue
        try:
            sock.sendto(payload, peer)
        except OSError as e:
            if e.errno not in (errno.ENOBUFS, errno.EAGAIN):
                return
            time.sleep(0.0005)     # the qdisc's queue is full: what a sender over its rate sees
        n += 1


def _serve_tcp(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(10)
        try:
            line = conn.recv(64).split()
            seconds = min(float(line[1]), MAX_SECONDS) if len(line) > 1 else 1.0
            end = time.monotonic() + seconds
            chunk = b"\0" * 65536
            while time.monotonic() < end:
                conn.sendall(chunk)
        except (OSError, ValueError, IndexError):
            pass


def serve(port: int, name: str) -> None:
    set_comm(name)
    udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    udp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    udp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    udp.bind(("::", port))
    tcp = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    tcp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("::", port))
    tcp.listen(64)

    def accept_loop():
        while True:
            c, _ = tcp.accept()
            threading.Thread(target=_serve_tcp, args=(c,), daemon=True).start()
    threading.Thread(target=accept_loop, daemon=True).start()
    while True:
        data, peer = udp.recvfrom(256)
        try:
            word, seconds, rate, size = data.split()
            if word != b"go":
                continue
            args = (float(seconds), float(rate), max(64, min(int(size), 8000)))
        except ValueError:
            continue
        threading.Thread(target=_stream_udp, args=(udp, peer) + args, daemon=True).start()


def recv(host: str, port: int, seconds: float, warmup: float, rate: float, size: int,
         bind_port: int, tcp: bool) -> dict:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
    s = socket.socket(fam, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 23)
    if bind_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", bind_port))
    s.settimeout(0.2)
    total = warmup + seconds
    if tcp:
        s.connect((host, port))
        s.sendall(f"go {total + 0.5}\n".encode())
    else:
        s.sendto(f"go {total + 0.5} {rate} {size}".encode(), (host, port))
    t0 = time.monotonic()
    counted = datagrams = 0
    first = last = None
    while time.monotonic() < t0 + total:
        try:
            data = s.recv(1 << 16)
        except socket.timeout:
            continue
        if not data and tcp:
            break
        now = time.monotonic()
        if now >= t0 + warmup:
            if first is None:
                first = now
            else:
                counted += len(data)
                datagrams += 1
            last = now
    s.close()
    span = (last - first) if first is not None and last is not None and last > first else 0.0
    return {"goodput_bps": counted / span if span else 0.0, "bytes": counted,
            "datagrams": datagrams, "seconds": span}


def probe(v4: str, v6: str, port: int, hold: float, again: bool = False) -> None:
    """Tracer checks: one unconnected dual-stack socket sends 3 datagrams to an IPv4 peer (as
    IPv4-mapped) and 3 to an IPv6 peer; three connected sockets (IPv4, IPv6, and a dual-stack
    one connected to the IPv4 peer's mapped address) send 1 each; prints the ports, holds the
    sockets ``hold`` seconds; with ``again`` the connected ones send once more then (prints
    "again") and are held 0.5 s; closes them all and prints "closed"."""
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    u.bind(("::", 0))
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.connect((v4, port))
    c6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    c6.connect((v6, port))
    cm = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    cm.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    cm.connect(("::ffff:" + v4, port))
    conn = (c, c6, cm)
    for _ in range(3):
        u.sendto(b"x", ("::ffff:" + v4, port))
        u.sendto(b"x", (v6, port))
    for s in conn:
        s.send(b"y")
    print(json.dumps({"unconnected": u.getsockname()[1], "connected": c.getsockname()[1],
                      "connected_local": c.getsockname()[0],
                      "connected6": c6.getsockname()[1], "connected6_local": c6.getsockname()[0],
                      "mapped": cm.getsockname()[1],
                      "mapped_local": cm.getsockname()[0].removeprefix("::ffff:")}), flush=True)
    time.sleep(min(hold, MAX_SECONDS))
    if again:
        for s in conn:
            s.send(b"z")
        print(json.dumps({"again": True}), flush=True)
        time.sleep(0.5)
    u.close()
    for s in conn:
        s.close()
    print(json.dumps({"closed": True}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="harness.udpflows")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--name", default="fp-udp-srv")
    r = sub.add_parser("recv")
    r.add_argument("--host", required=True)
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--seconds", type=float, default=4.0)
    r.add_argument("--warmup", type=float, default=1.0)
    r.add_argument("--rate", type=float, default=25e6, help="offered bit/s")
    r.add_argument("--size", type=int, default=1200)
    r.add_argument("--bind-port", type=int, default=0)
    r.add_argument("--tcp", action="store_true")
    r.add_argument("--name", default="fp-udp-cli")
    pr = sub.add_parser("probe")
    pr.add_argument("--v4", required=True)
    pr.add_argument("--v6", required=True)
    pr.add_argument("--port", type=int, default=9)
    pr.add_argument("--hold", type=float, default=0.5)
    pr.add_argument("--name", default="fp-udp-probe")
    pr.add_argument("--again", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "probe":
        set_comm(a.name)
        probe(a.v4, a.v6, a.port, a.hold, a.again)
    elif a.cmd == "serve":
        serve(a.port, a.name)
    else:
        set_comm(a.name)
        print(json.dumps(recv(a.host, a.port, min(a.seconds, MAX_SECONDS), a.warmup, a.rate,
                              a.size, a.bind_port, a.tcp)), flush=True)


if __name__ == "__main__":
    main()
