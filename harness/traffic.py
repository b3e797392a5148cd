"""Traffic clients for tests and benchmarks, every one bounded in time and count.

Rates are measured at the receiver (the client namespace) in bytes per second of TCP payload;
a flow paced at ``rate_bps`` on the wire carries at most ``rate_bps * wire(v6)`` of payload
(1448 payload bytes per 1514-byte frame over IPv4 with timestamps, 1428 over IPv6).

- ``fetch``/``fetch_result``: ``harness.blaster fetch`` (any HTTP server that sends a
  big body: blaster's own ``serve``, nginx with ``path=``), its goodput after a warm-up;
- ``iperf3``: ``iperf3 -c`` (``-R``: the server sends), its JSON report;
  ``iperf3_started`` says when one's intervals start, ``iperf3_interrupted`` stops it early
  (its intervals so far), ``iperf3_rate_between`` reads a window of them;
- ``ab``, ``h2load``, ``curl``: ApacheBench, nghttp2's h2load and curl, their summaries;
- ``keepalive_client``, ``reset_midway``, ``stalled_reader``: small socket clients run in a
  thread of the test process with their sockets made in the client namespace;
- ``udp_upload``/``udp_upload_received``: ``iperf3 -u`` offering a rate to the server (the
  server receives), and what the server's own report says it received; ``send_buffer_max``
  lets the client's socket buffer be big enough to offer it (see there).
"""
from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from typing import List, Optional, Sequence

from harness.testbed import PY, client_argv, in_netns, server_argv  # noqa: F401 (re-exported)
from harness.testbed import wait_for

WIRE = 1448 / 1514       # TCP payload per full IPv4 frame (timestamps on)
WIRE6 = 1428 / 1514      # the same over IPv6 (20 more bytes of IP header)


def wire(v6: bool) -> float:
    return WIRE6 if v6 else WIRE


def url(host, port: int, path: str = "/") -> str:
    h = str(host)
    return f"http://[{h}]:{port}{path}" if ":" in h else f"http://{h}:{port}{path}"


# ------------------------------------------------------------------ blaster fetch

def fetch(tb, host, port: int, seconds: float, warmup: float = 1.0, path: Optional[str] = None,
          name: str = "fp-client", local_port: int = 0, interval: float = 0.0,
          ns: Optional[str] = None) -> subprocess.Popen:
    """Start a measuring download in the client namespace (``ns``: another one, e.g. of
    ``Testbed.add_client``; ``fetch_result`` reads it)."""
    argv = client_argv(str(host), port, seconds, warmup, name, local_port)
    if path:
        argv += ["--path", path]
    if interval:
        argv += ["--interval", str(interval)]
    return tb.popen(ns or tb.client_ns, argv, stdout=subprocess.PIPE, text=True)


def fetch_result(p: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = p.communicate(timeout=timeout)
    if p.returncode != 0 or not out.strip():
        raise AssertionError(f"fetch client exited {p.returncode} without a result")
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------ real programs

def iperf3(tb, host, port: int = 5201, seconds: float = 4, parallel: int = 1,
           reverse: bool = True, extra: Sequence[str] = ()) -> subprocess.Popen:
    """``iperf3 -c`` in the client namespace, JSON output (``-R``: the server sends)."""
    argv = ["iperf3", "-c", str(host), "-p", str(port), "-t", str(seconds), "-P", str(parallel),
            "-J", *(["-R"] if reverse else []), *extra]
    return tb.popen(tb.client_ns, argv, stdout=subprocess.PIPE, text=True)


def iperf3_result(p: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = p.communicate(timeout=timeout)
    doc = json.loads(out) if out.strip() else {}
    if p.returncode != 0 or "error" in doc:
        raise AssertionError(f"iperf3 exited {p.returncode}: {doc.get('error', out[-500:])}")
    return doc


def iperf3_interrupted(p: subprocess.Popen, timeout: float = 60) -> dict:
    """Stop a running ``iperf3 -c -J`` with SIGINT and return its report: iperf3 prints the
    intervals it has (and an ``end``) with the error "interrupt - the client has terminated"
    and exits 1; any other error (or no report) fails."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=timeout)
    doc = json.loads(out) if out.strip() else {}
    if "interrupt" not in doc.get("error", "") or not doc.get("intervals"):
        raise AssertionError(f"iperf3 exited {p.returncode}: {doc.get('error', out[-500:])}")
    return doc


def stop_clients(clients: dict, iperfs: dict, timeout: float = 30) -> tuple:
    """End running measuring clients: blaster fetches (``clients``, label -> Popen; each ends
    its download on SIGTERM and prints its JSON result last) and ``iperf3 -c -J`` runs
    (``iperfs``, label -> Popen; ``iperf3_interrupted``). (blaster results, iperf3 reports),
    each by label; a client that did not exit cleanly fails."""
    for c in clients.values():
        c.terminate()
    reports = {label: iperf3_interrupted(p, timeout=timeout) for label, p in iperfs.items()}
    res = {}
    for label, c in clients.items():
        out, _ = c.communicate(timeout=timeout)
        assert c.returncode == 0, f"{label}: client exited {c.returncode}"
        res[label] = json.loads(out.strip().splitlines()[-1])
    return res, reports


def iperf3_started(tb, port: int, timeout: float) -> float:
    """The monotonic instant a just-started one-stream ``iperf3 -c`` to ``port`` has its control
    and data connections established, as the client namespace's ``ss`` shows them: where the
    intervals of its report count from (to within one poll: 20 ms and an ``ss`` run)."""
    def both() -> Optional[float]:
        out = tb.run(tb.client_ns, ["ss", "-Htn", "state", "established",
                                    f"( dport = :{port} )"]).stdout
        n = sum(1 for ln in out.splitlines() if ln.strip())
        return time.monotonic() if n >= 2 else None
    return wait_for(both, timeout, 0.02, f"iperf3's two connections to port {port}")


def iperf3_rate_between(report: dict, t0: float, a: float, b: float) -> float:
    """Bytes/s of a report's intervals that lie within monotonic instants ``a``..``b``, its
    test having started at ``t0`` (with ``-R`` the client's intervals are what it received).
    0.0 when no interval lies there."""
    inside = [i["sum"] for i in report["intervals"]
              if t0 + i["sum"]["start"] >= a - 1e-3 and t0 + i["sum"]["end"] <= b + 1e-3]
    if not inside:
        return 0.0
    span = inside[-1]["end"] - inside[0]["start"]
    return sum(i["bytes"] for i in inside) / span if span > 0 else 0.0


UDP_SIZE = 1200             # iperf3 -u datagram payload (-l)
WMEM_MAX = "/proc/sys/net/core/wmem_max"
UDP_SNDBUF = "4M"           # iperf3 -w: the kernel doubles it, within 2 x wmem_max


def udp_wire(v6: bool, size: int = UDP_SIZE) -> float:
    """UDP payload per frame a qdisc counts (Ethernet + IP + UDP headers)."""
    return size / (size + 14 + (40 if v6 else 20) + 8)


@contextlib.contextmanager
def send_buffer_max(at_least: int = 4 << 20):
    """net.core.wmem_max at least ``at_least`` inside the block (the old value back after it;
    global, not per namespace; only ever raised, so other programs see no change).

    A datagram that crossed a veth still belongs to its sender's socket (the kernel keeps the
    skb's owner), also while it waits in a shaper's queue on the receiving side (the ifb), so
    a UDP sender here is held back by the receiving side's queue once its send buffer is full:
    with Debian's 208 KiB cap an ``iperf3 -u -b 50M`` client offered 9.7 Mbit/s to a 10 Mbit/s
    receive class (htb, 100-packet leaf queue), and nothing was dropped; psp's class queue is
    1000 packets, which 2 MiB did not cover either (9.1 Mbit/s offered in the VM). A sender
    across a real network is not held back: a buffer well above that queue (``-w 4M``, 8 MiB)
    lets it offer all 50."""
    with open(WMEM_MAX) as f:
        old = int(f.read())
    if old >= at_least:
        yield
        return
    with open(WMEM_MAX, "w") as f:
        f.write(f"{at_least}\n")
    try:
        yield
    finally:
        with open(WMEM_MAX, "w") as f:
            f.write(f"{old}\n")


def udp_upload(tb, host, port: int, rate: str = "50M", seconds: float = 4,
               omit: float = 1) -> subprocess.Popen:
    """``iperf3 -u -b RATE`` client -> server (the server receives), with the server's own
    report (the server must run with ``-J``: ``iperf3_server(json=True)``). Run it inside
    ``send_buffer_max()``."""
    return iperf3(tb, host, port, seconds=seconds, reverse=False,
                  extra=("-u", "-b", rate, "-l", str(UDP_SIZE), "-w", UDP_SNDBUF,
                         "-O", str(omit), "--get-server-output"))


def udp_upload_received(p: subprocess.Popen, timeout: float = 60) -> dict:
    """What the iperf3 server received (``received_bps``: payload bytes/s after the omitted
    seconds, ``lost_percent``) and what the client offered (``sent_bps``)."""
    doc = iperf3_result(p, timeout)
    srv = doc.get("server_output_json")
    if not srv or "end" not in srv:
        raise AssertionError(f"no JSON report from the iperf3 server (run it with -J): "
                             f"{sorted(doc)}")
    got = srv["end"]["sum_received"]     # iperf3 3.12: the receiver's sum ("sum" has 0 bytes)
    sent = doc["end"]["sum"]
    return {"received_bps": got["bytes"] / got["seconds"], "lost_percent": got["lost_percent"],
            "sent_bps": sent["bytes"] / sent["seconds"]}


def _field(text: str, label: str) -> Optional[float]:
    m = re.search(rf"^{re.escape(label)}:\s+([\d.]+)", text, re.M)
    return float(m.group(1)) if m else None


def ab(tb, target: str, n: int, c: int, keepalive: bool = False, timeout_s: int = 20) -> subprocess.Popen:
    """ApacheBench: ``n`` requests, ``c`` at a time (short connections unless ``keepalive``)."""
    argv = ["ab", "-q", "-n", str(n), "-c", str(c), "-s", str(timeout_s), "-r",
            *(["-k"] if keepalive else []), target]
    return tb.popen(tb.client_ns, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ab_result(p: subprocess.Popen, timeout: float = 120) -> dict:
    out, _ = p.communicate(timeout=timeout)
    res = {"rc": p.returncode, "complete": _field(out, "Complete requests"),
           "failed": _field(out, "Failed requests"), "non_2xx": _field(out, "Non-2xx responses") or 0,
           "bytes": _field(out, "Total transferred"), "output": out[-1500:]}
    return res


def h2load(tb, target: str, n: int, c: int, streams: int = 1, h1: bool = False,
           seconds_timeout: int = 20) -> subprocess.Popen:
    """nghttp2's h2load: ``n`` requests over ``c`` connections (HTTP/2 over cleartext with prior
    knowledge, or HTTP/1.1 with ``h1``)."""
    argv = ["h2load", "-n", str(n), "-c", str(c), "-m", str(streams), "-T", str(seconds_timeout),
            *(["--h1"] if h1 else []), target]
    return tb.popen(tb.client_ns, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def h2load_result(p: subprocess.Popen, timeout: float = 120) -> dict:
    out, _ = p.communicate(timeout=timeout)
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                  r"(\d+) errored", out)
    keys = ("total", "started", "done", "succeeded", "failed", "errored")
    res = dict(zip(keys, map(int, m.groups()))) if m else {}
    res.update(rc=p.returncode, output=out[-1500:])
    return res


def curl(tb, urls: Sequence[str], max_time: float = 20, limit_rate: Optional[str] = None,
         extra: Sequence[str] = ()) -> subprocess.Popen:
    """curl fetching ``urls`` in order (over one kept-alive connection where it can), bodies
    thrown away; prints one line per URL: HTTP code, bytes, whether the connection was new."""
    argv = ["curl", "-sS", "--max-time", str(max_time), *(["--limit-rate", limit_rate] if limit_rate else []),
            *extra]
    for u in urls:
        argv += ["-o", "/dev/null", "-w", "%{http_code} %{size_download} %{num_connects}\\n", u]
    return tb.popen(tb.client_ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def curl_result(p: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = p.communicate(timeout=timeout)
    rows = [ln.split() for ln in out.splitlines() if ln.strip()]
    return {"rc": p.returncode, "codes": [r[0] for r in rows], "bytes": [int(r[1]) for r in rows],
            "connects": sum(int(r[2]) for r in rows), "stderr": err[-500:]}


# ------------------------------------------------------------------ socket clients (threads)

def client_socket(tb, host, port: int, timeout: float = 10) -> socket.socket:
    """A TCP connection made from the client namespace (the socket stays in it)."""
    fam = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
    with in_netns(tb.client_ns):
        s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect((str(host), port))
    return s


def read_head(s: socket.socket) -> tuple:
    """Read an HTTP response's header: (header, the body bytes read with it)."""
    head = b""
    while b"\r\n\r\n" not in head:
        d = s.recv(4096)
        if not d:
            raise ConnectionError("closed before the response header")
        head += d
    hdr, _, rest = head.partition(b"\r\n\r\n")
    return hdr, rest


def _read_response(s: socket.socket, buf: bytearray) -> int:
    """Read one HTTP/1.1 response with a Content-Length; its body length."""
    hdr, rest = read_head(s)
    m = re.search(rb"(?im)^content-length:\s*(\d+)", hdr)
    if not m:
        raise ConnectionError(f"no content-length in {hdr[:200]!r}")
    left = int(m.group(1)) - len(rest)
    while left > 0:
        n = s.recv_into(buf, min(len(buf), left))
        if not n:
            raise ConnectionError("closed in the body")
        left -= n
    return int(m.group(1))


def keepalive_client(tb, host, port: int, path: str, requests: int, idle_s: float) -> dict:
    """One connection, ``requests`` HTTP/1.1 requests with ``idle_s`` of silence between them."""
    buf = bytearray(1 << 16)
    got = []
    s = client_socket(tb, host, port)
    try:
        for i in range(requests):
            if i:
                time.sleep(idle_s)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            got.append(_read_response(s, buf))
    finally:
        s.close()
    return {"responses": len(got), "bytes": sum(got)}


def reset_midway(tb, host, port: int, path: str, after_bytes: int) -> dict:
    """Start a big download, read ``after_bytes``, then close with SO_LINGER 0 (a RST)."""
    s = client_socket(tb, host, port)
    got = 0
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        while got < after_bytes:
            d = s.recv(1 << 16)
            if not d:
                break
            got += len(d)
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    return {"bytes": got}


def stalled_reader(tb, host, port: int, path: str, hold_s: float) -> dict:
    """Ask for a big file and do not read for ``hold_s`` (the server's send queue fills and its
    window closes), then close."""
    s = client_socket(tb, host, port)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        time.sleep(hold_s)
        first = s.recv(1 << 16)
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    return {"bytes": len(first)}


class Threads:
    """Run socket clients in threads; ``join`` returns their results or raises the first error."""

    def __init__(self):
        self._t: List[threading.Thread] = []
        self._res: List[object] = []
        self._err: List[BaseException] = []

    def start(self, fn, *args) -> None:
        i = len(self._res)
        self._res.append(None)

        def run():
            try:
                self._res[i] = fn(*args)
            except BaseException as e:          # reported by join
                self._err.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._t.append(t)

    def join(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        for t in self._t:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._t):
            raise TimeoutError(f"socket clients still running after {timeout:.0f} s")
        if self._err:
            raise self._err[0]
        return list(self._res)
