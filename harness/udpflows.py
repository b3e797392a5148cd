"""UDP test traffic (issue 17): a streamer answering many peers on ONE unconnected socket (what a
QUIC server does), with a TCP listener on the same port, and its receiving client.

    python -m harness.udpflows serve --port 7001 --name fp-udp-srv [--mmsg]
    python -m harness.udpflows recv --host 10.77.1.1 --port 7001 --seconds 4 --warmup 1 \\
        --rate 25000000 [--size 1200] [--bind-port 40001] [--tcp]

``serve``: a dual-stack UDP socket on ``[::]:PORT`` (IPv4 peers arrive IPv4-mapped), never
connected: a datagram ``go SECONDS RATE_BIT SIZE`` from a peer starts a thread that sends that
peer SIZE-byte datagrams at RATE_BIT for SECONDS with ``sendto``; and a dual-stack TCP listener on
the same port that sends as fast as it can for the SECONDS in the client's first line.
With ``--mmsg`` one thread answers every streaming peer with ``sendmmsg`` instead: each call
carries the due datagrams of all peers, each message with its peer's address.
``recv``: asks for a stream and counts the payload received after the warm-up; prints one JSON
line ``{"goodput_bps": bytes/s, "bytes": ..., "datagrams": ..., "seconds": ...}``.

Connected sockets (idle timeout, sendmmsg without addresses):

    python -m harness.udpflows sink --port 7002            # client side, commands on stdin
    python -m harness.udpflows conn --v4 A --v6 B --port 7002 --name fp-udp-conn

``conn``: three connected sockets (IPv4, IPv6, and a dual-stack one connected to A's
IPv4-mapped address); prints their local ports as JSON, then for each stdin line
``send SECONDS RATE_BIT SIZE`` sends SIZE-byte datagrams at RATE_BIT on each of them with
``sendmmsg`` (no addresses) and prints ``{"sent": N}``; EOF closes them. ``sink``: a dual-stack
socket counting arrivals per peer; for each stdin line ``report T0 T1`` (CLOCK_MONOTONIC
seconds) prints ``{"PEER_ADDR PEER_PORT": goodput_bps}`` over the arrivals between T0 and T1.
Every loop is bounded in time (MAX_SECONDS).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import json
import socket
import struct
import subprocess
import sys
import threading
import time

from harness.blaster import set_comm

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


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(_IOVec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def sockaddr_in6(addr: str, port: int) -> bytes:
    """struct sockaddr_in6 of an IPv6 (or IPv4-mapped) address."""
    return (struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0)
            + socket.inet_pton(socket.AF_INET6, addr) + struct.pack("=I", 0))


def sendmmsg(sock: socket.socket, msgs) -> int:
    """libc's sendmmsg(2) of ``msgs``: (payload, sockaddr bytes or None); the number sent (an
    error on the first message raises OSError)."""
    n = len(msgs)
    vec = (_MMsgHdr * n)()
    iovs = (_IOVec * n)()
    keep = []
    for i, (payload, name) in enumerate(msgs):
        buf = ctypes.create_string_buffer(payload, len(payload))
        keep.append(buf)
        iovs[i].base, iovs[i].len = ctypes.addressof(buf), len(payload)
        vec[i].hdr.iov = ctypes.pointer(iovs[i])
        vec[i].hdr.iovlen = 1
        if name is not None:
            nb = ctypes.create_string_buffer(name, len(name))
            keep.append(nb)
            vec[i].hdr.name, vec[i].hdr.namelen = ctypes.addressof(nb), len(name)
    sent = _LIBC.sendmmsg(sock.fileno(), vec, n, 0)
    if sent < 0:
        no = ctypes.get_errno()
        raise OSError(no, errno.errorcode.get(no, str(no)))
    return sent


class _MMsgStreamer:
    """One thread answering every streaming peer of one unconnected socket with sendmmsg: each
    call carries the due datagrams of all peers (at most 16 each), each with its peer's address."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()
        self.streams = []           # [name, start, end, rate_bit, size, sent]
        threading.Thread(target=self._run, daemon=True).start()

    def add(self, peer, seconds: float, rate_bit: float, size: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.streams.append([sockaddr_in6(peer[0], peer[1]), now,
                                 now + min(seconds, MAX_SECONDS), rate_bit, size, 0])

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            batch, owners = [], []
            with self.lock:
                self.streams = [st for st in self.streams if st[2] > now]
                for st in self.streams:
                    due = int((now - st[1]) * st[3] / (8 * st[4])) + 1
                    for _ in range(min(due - st[5], 16)):
                        batch.append((b"\0" * st[4], st[0]))
                        owners.append(st)
            if not batch:
                time.sleep(0.002)
                continue
            try:
                sent = sendmmsg(self.sock, batch)
            except OSError as e:
                if e.errno not in (errno.ENOBUFS, errno.EAGAIN):
                    raise
                sent = len(batch)        # refused by a full queue: dropped, as for sendto
            with self.lock:
                for st in owners[:sent]:
                    st[5] += 1
            time.sleep(0.001)


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


def serve(port: int, name: str, mmsg: bool = False) -> None:
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
    streamer = _MMsgStreamer(udp) if mmsg else None
    while True:
        data, peer = udp.recvfrom(256)
        try:
            word, seconds, rate, size = data.split()
            if word != b"go":
                continue
            args = (float(seconds), float(rate), max(64, min(int(size), 8000)))
        except ValueError:
            continue
        if streamer is not None:
            streamer.add(peer, *args)
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


def connect_three(v4: str, v6: str, port: int):
    """UDP sockets connected to (v4, port) over IPv4, (v6, port) over IPv6, and a dual-stack
    one to v4's IPv4-mapped address."""
    c4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c4.connect((v4, port))
    c6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    c6.connect((v6, port))
    cm = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    cm.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    cm.connect(("::ffff:" + v4, port))
    return c4, c6, cm


def probe(v4: str, v6: str, port: int, hold: float, again: bool = False) -> None:
    """Tracer checks: one unconnected dual-stack socket sends 3 datagrams to an IPv4 peer (as
    IPv4-mapped) and 3 to an IPv6 peer; three connected sockets (IPv4, IPv6, and a dual-stack
    one connected to the IPv4 peer's mapped address) send 1 each; prints the ports, holds the
    sockets ``hold`` seconds; with ``again`` the connected ones send once more then (prints
    "again") and are held 0.5 s; closes them all and prints "closed"."""
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    u.bind(("::", 0))
    conn = c, c6, cm = connect_three(v4, v6, port)
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
            try:
                s.send(b"z")
            except ConnectionRefusedError:    # the peer's port unreachable, reported now
                s.send(b"z")
        print(json.dumps({"again": True}), flush=True)
        time.sleep(0.5)
    u.close()
    for s in conn:
        s.close()
    print(json.dumps({"closed": True}), flush=True)


def conn(v4: str, v6: str, port: int) -> None:
    """See the module's doc: three connected sockets sending with sendmmsg on command."""
    socks = c4, c6, cm = connect_three(v4, v6, port)
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    print(json.dumps({"v4": c4.getsockname()[1], "v6": c6.getsockname()[1],
                      "mapped": cm.getsockname()[1]}), flush=True)
    deadline = time.monotonic() + MAX_SECONDS
    for line in sys.stdin:
        word, *args = line.split()
        if word != "send" or time.monotonic() > deadline:
            break
        seconds, rate_bit, size = min(float(args[0]), MAX_SECONDS), float(args[1]), int(args[2])
        payload = b"\0" * size
        start = time.monotonic()
        n = 0
        while True:
            now = time.monotonic()
            if now >= start + seconds:
                break
            due = int((now - start) * rate_bit / (8 * size)) + 1
            k = min(due - n, 32)
            if k <= 0:
                time.sleep(0.001)
                continue
            for s in socks:
                try:
                    sendmmsg(s, [(payload, None)] * k)
                except OSError as e:
                    if e.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ECONNREFUSED):
                        raise
            n += k
        print(json.dumps({"sent": n}), flush=True)
    for s in socks:
        s.close()


def sink(port: int) -> None:
    """See the module's doc: arrivals per peer, goodput between two times on command."""
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 23)
    s.bind(("::", port))
    s.settimeout(0.2)
    arrivals = {}
    lock = threading.Lock()
    deadline = time.monotonic() + MAX_SECONDS

    def receive():
        while time.monotonic() < deadline:
            try:
                data, peer = s.recvfrom(1 << 16)
            except socket.timeout:
                continue
            now = time.monotonic()
            name = f"{peer[0].removeprefix('::ffff:')} {peer[1]}"
            with lock:
                arrivals.setdefault(name, []).append((now, len(data)))
    threading.Thread(target=receive, daemon=True).start()
    print(json.dumps({"port": port}), flush=True)
    for line in sys.stdin:
        word, *args = line.split()
        if word != "report":
            break
        t0, t1 = float(args[0]), float(args[1])
        out = {}
        with lock:
            for name, arr in arrivals.items():
                got = [(t, n) for t, n in arr if t0 <= t <= t1]
                span = got[-1][0] - got[0][0] if len(got) > 1 else 0.0
                out[name] = sum(n for _t, n in got[1:]) / span if span else 0.0
        print(json.dumps(out), flush=True)


class ProbeRun:
    """A ``probe`` in ``tb``'s server namespace under a started ``flowpacer.sources.tracer.Tracer`` of
    that namespace, and the tracer's UDP events of it (the tracer tests, host and VM):
    ``peers`` and ``connected`` are the flows the probe makes as (local address, local port,
    remote address) triples; ``of(kind)`` lists the events of a kind as such triples (repeats
    kept); ``until(what, cond, timeout)`` polls the tracer until ``cond()``."""

    def __init__(self, tb, tracer, hold: float, again: bool = False,
                 name: str = "fp-udp-probe"):
        from harness.testbed import PY
        self.tracer = tracer
        self.events: list = []
        self.proc = tb.popen(tb.server_ns, [PY, "-m", "harness.udpflows", "probe", "--v4",
                                            str(tb.client_v4), "--v6", str(tb.client_v6),
                                            "--hold", str(hold), "--name", name]
                             + (["--again"] if again else []), stdout=subprocess.PIPE, text=True)
        p = self.ports = json.loads(self.proc.stdout.readline())
        v4, v6 = str(tb.client_v4), str(tb.client_v6)
        self.peers = {("0.0.0.0", p["unconnected"], v4), ("::", p["unconnected"], v6)}
        self.connected = {(p["connected_local"], p["connected"], v4),
                          (p["connected6_local"], p["connected6"], v6),
                          (p["mapped_local"], p["mapped"], v4)}

    def of(self, kind) -> list:
        from flowpacer import model
        return [(str(e.flow.key.local_addr), e.flow.key.local_port, str(e.flow.key.remote_addr))
                for e in self.events
                if e.kind is kind and e.flow.key.protocol is model.Protocol.UDP]

    def until(self, what: str, cond, timeout: float):
        from harness.testbed import wait_for

        def have():
            self.events.extend(self.tracer.poll(50))
            return cond()
        return wait_for(have, timeout, 0.0, what)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="harness.udpflows")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--name", default="fp-udp-srv")
    s.add_argument("--mmsg", action="store_true", help="answer peers with sendmmsg")
    c = sub.add_parser("conn")
    c.add_argument("--v4", required=True)
    c.add_argument("--v6", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--name", default="fp-udp-conn")
    k = sub.add_parser("sink")
    k.add_argument("--port", type=int, required=True)
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
        serve(a.port, a.name, a.mmsg)
    elif a.cmd == "conn":
        set_comm(a.name)
        conn(a.v4, a.v6, a.port)
    elif a.cmd == "sink":
        sink(a.port)
    else:
        set_comm(a.name)
        print(json.dumps(recv(a.host, a.port, min(a.seconds, MAX_SECONDS), a.warmup, a.rate,
                              a.size, a.bind_port, a.tcp)), flush=True)


if __name__ == "__main__":
    main()
