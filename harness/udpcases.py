"""The UDP cases' pieces (issue 17), shared by tests/test_udp.py (htb on the host) and
tests/guest/test_psp_udp_daemon.py (psp in the VM): receivers of ``harness.udpflows serve``
streams, the rate check at the receiver, the connected senders, and the checks after a case.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from .capture import kernel_objects, tc_show
from .daemon import healthy, tracebacks
from .testbed import PY, wait_for

RATE_BPS = 10_000_000 / 8         # the rules' rate (bytes/s) unless a case gives its own
SIZE = 1200                       # datagram payload
PORT, SINK_PORT = 7001, 7002


def wire(size: int, v6: bool) -> float:
    """payload / bytes htb counts (Ethernet + IP + UDP headers)."""
    return size / (size + 14 + (40 if v6 else 20) + 8)


def recv(tb, host, seconds=4.0, warmup=1.0, rate=25e6, bind_port=0, tcp=False, port=PORT):
    argv = [PY, "-m", "harness.udpflows", "recv", "--host", str(host), "--port", str(port),
            "--seconds", str(seconds), "--warmup", str(warmup), "--rate", str(rate),
            "--size", str(SIZE), "--bind-port", str(bind_port)] + (["--tcp"] if tcp else [])
    return tb.popen(tb.client_ns, argv, stdout=subprocess.PIPE, text=True)


def result(p, timeout=60) -> dict:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"receiver exited {p.returncode}: {out[-500:]}"
    return json.loads(out.strip().splitlines()[-1])


def at_rate(got: float, v6: bool, what: str, detail: str = "", rate_bps: float = RATE_BPS) -> None:
    """Goodput ``got`` (bytes/s at the receiver) is the rule's rate x payload/wire within 3 %."""
    want = rate_bps * wire(SIZE, v6)
    print(f"{what}: {got * 8 / 1e6:.3f} Mbit/s payload, want {want * 8 / 1e6:.3f}")
    assert got == pytest.approx(want, rel=0.03), \
        f"{what}: the receiver got {got * 8 / 1e6:.3f} Mbit/s, want {want * 8 / 1e6:.3f} " \
        f"({rate_bps * 8 / 1e6:g} Mbit/s x payload/wire){detail}"


def peers_at_rate(res, what: str, rate_bps: float = RATE_BPS) -> None:
    """The IPv4 and the IPv6 receiver's goodput (``recv`` results) each at the rule's rate."""
    for r, v6 in zip(res, (False, True)):
        at_rate(r["goodput_bps"], v6, f"{what} IPv{6 if v6 else 4}", rate_bps=rate_bps)


def udp_flows(d):
    return [f for f in d.flows() if f.get("protocol") == "udp"]


def after_case(tb, d, what: str, wait_s: float = 8) -> None:
    log = d.log_text()
    tbs = list(tracebacks(log))
    assert not tbs, f"after {what}: a traceback in the daemon's log:\n" + "\n---\n".join(tbs[:3])
    assert d.alive(), f"after {what}: the daemon exited:\n{log[-3000:]}"
    bad = healthy(d.status())
    assert not bad, f"after {what}: {bad}"
    try:
        wait_for(lambda: kernel_objects(tb) == (0, 0), wait_s, 0.1, "every class and filter to go")
    except TimeoutError:
        raise AssertionError(f"after {what}: left {kernel_objects(tb)}\n{tc_show(tb, 'class')}\n"
                             f"flows: {[(f['local'], f['remote'], f.get('protocol')) for f in d.flows()]}"
                             ) from None


class ConnectedSenders:
    """``harness.udpflows conn`` (three connected sockets: IPv4, IPv6, IPv4-mapped) in the
    server namespace sending to ``sink`` in the client namespace, both driven over stdin."""

    def __init__(self, tb):
        self.snd = None
        self.sink = tb.popen(tb.client_ns, [PY, "-m", "harness.udpflows", "sink", "--port",
                                            str(SINK_PORT)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        json.loads(self.sink.stdout.readline())
        self.snd = tb.popen(tb.server_ns, [PY, "-m", "harness.udpflows", "conn", "--v4",
                                           str(tb.client_v4), "--v6", str(tb.client_v6),
                                           "--port", str(SINK_PORT)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
        self.ports = json.loads(self.snd.stdout.readline())

    def start(self, seconds: float, rate_bit: float = 20e6) -> None:
        """Send for ``seconds`` at ``rate_bit`` per socket (``done`` waits for the end)."""
        self.snd.stdin.write(f"send {seconds} {rate_bit} {SIZE}\n")
        self.snd.stdin.flush()

    def done(self) -> dict:
        return json.loads(self.snd.stdout.readline())

    def send(self, seconds: float, rate_bit: float = 20e6) -> dict:
        self.start(seconds, rate_bit)
        return self.done()

    def report(self, t0: float, t1: float) -> dict:
        """Goodput per peer ("ADDR PORT") at the receiver between two monotonic times."""
        self.sink.stdin.write(f"report {t0} {t1}\n")
        self.sink.stdin.flush()
        return json.loads(self.sink.stdout.readline())

    def close(self) -> None:
        """Closes the sockets (their flows end at release) and waits for the sender."""
        self.snd.stdin.close()
        self.snd.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for p in (self.snd, self.sink):
            if p is not None and p.poll() is None:
                p.kill()


def conn_flows(d):
    return [f for f in udp_flows(d) if f["rule"] == "conn-udp"]


def wait_idled_out(tb, d, ended: float, what: str, latest: float = 5.0) -> float:
    """Waits for the connected sockets' classes and filters to go; seconds since ``ended``
    (their 2 s idle_timeout, so from 1.5 s to ``latest``)."""
    wait_for(lambda: not conn_flows(d) and kernel_objects(tb) == (0, 0), latest + 1, 0.1,
             f"the {what} classes and filters to go")
    gone = time.monotonic() - ended
    print(f"{what} classes gone {gone:.2f} s after the last datagram (idle_timeout 2 s)")
    assert 1.5 <= gone <= latest, f"{what}: removed {gone:.2f} s after the last send"
    return gone
