"""Flash crowds (issue 26): two h2load processes started together (one over IPv4, one over
IPv6) against nginx, one request per client, and every reply's time from h2load's per-request
log; then the checks both crowd tests make (tests/test_flashcrowd.py on the host with htb,
tests/guest/test_psp_flashcrowd.py in the VM with psp): replies that finished sooner than their
rule's rate allows (heads left unpaced), every flow the kernel decided counted once by the
first-byte stage, and nothing of the daemon's left afterwards."""
from __future__ import annotations

import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

from harness import bpfobjs
from harness.capture import daemon_objects, daemon_spares, kernel_objects, tc_show
from harness.testbed import wait_for
from harness.traffic import url

FIRST_BYTE_KINDS = ("claimed", "stopgap", "missed", "exhausted")
FRAME = 1514


def crowd_rules(backend: str, rate_bit: int, link_rate: str = "10gbit") -> str:
    """The rules of a crowd: nginx's replies, each at ``rate_bit``, on the test's interface."""
    return f"""
    interface: IFACE
    backend: {backend}
    link_rate: {link_rate}
    rules:
      - name: crowd
        match: {{process: nginx, direction: inbound}}
        rate: {rate_bit // 1000}kbit
"""


def min_reply_s(object_bytes: int, rate_bps: int, burst_bytes: int = 0) -> float:
    """The least time a reply of ``object_bytes`` paced at ``rate_bps`` from its first byte
    takes: what may leave ahead of the rate line is the class's burst (htb's; psp has none)
    and the first 10 segments TCP's own pacing (the stopgap) leaves unpaced (tcp_output.c:
    "sch_fq does not pace first 10 MSS"), 12 frames. The rate is counted on the wire, so this
    is below what the payload alone needs. A head left unshaped is tens of KiB to all of the
    reply (issue 26: 6-9 s of ~10 s, some in 0.5-2 s)."""
    return (object_bytes - 12 * FRAME - burst_bytes) / rate_bps


def log_rows(path: Path) -> List[Tuple[int, int, int]]:
    """(start us, status, duration us) per request of an h2load --log-file (none when h2load
    wrote none: it failed before its first request; its output says why)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            rows.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return rows


@dataclass
class Crowd:
    rows: List[Tuple[int, int, int]]     # every request of both h2loads
    outputs: List[str]                   # their summaries (for a failure's message)
    took_s: float

    @property
    def ok(self) -> List[Tuple[int, int, int]]:
        return [r for r in self.rows if r[1] == 200]

    @property
    def spread_ms(self) -> float:
        """From the first request's start to the last's."""
        starts = sorted(r[0] for r in self.rows)
        return (starts[-1] - starts[0]) / 1e3 if starts else 0.0

    def early(self, min_s: float) -> List[float]:
        """The durations (s, sorted) of the replies that finished in under ``min_s``."""
        return sorted(r[2] / 1e6 for r in self.ok if r[2] / 1e6 < min_s)


def crowd(tb, hosts: Sequence, port: Union[int, Sequence[int]], path: str,
          clients: Union[int, Sequence[int]], logdir: Path, timeout_s: float = 150) -> Crowd:
    """``clients`` HTTP/1.1 clients per host of ``hosts`` (or a count for each) at once, one
    h2load process per host, started back to back, one request each for ``path`` on ``port``
    (or a port for each: the same IPv4 host twice, once on a dual-stack port, gives IPv4 and
    IPv4-mapped flows); waits for them all (bounded)."""
    counts = [clients] * len(hosts) if isinstance(clients, int) else list(clients)
    ports = [port] * len(hosts) if isinstance(port, int) else list(port)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    logs, procs = [], []
    t0 = time.monotonic()
    for i, (host, n, hport) in enumerate(zip(hosts, counts, ports)):
        log = logdir / f"h2load-{i}-v{host.version}.log"
        logs.append(log)
        procs.append(tb.popen(tb.client_ns, [
            # a descriptor per client: thousands need more than the usual soft limit (never
            # above the hard one, which may not be raised here)
            "prlimit", f"--nofile={min(hard, max(4096, n + 256))}", "timeout", str(int(timeout_s)),
            "h2load", "--h1", "-n", str(n), "-c", str(n), "-t", "1", "-T", "60", "-N", "60",
            f"--log-file={log}", url(host, hport, path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs = [p.communicate(timeout=timeout_s + 20)[0] for p in procs]
    took = time.monotonic() - t0
    return Crowd([r for log in logs for r in log_rows(log)], outs, took)


def first_byte_counters(d) -> Dict[str, int]:
    return d.status()["first_byte"]["counters"]


def counted(d, before: Dict[str, int], n: int, timeout_s: float = 10) -> Dict[str, int]:
    """The first-byte counters' growth since ``before`` once ``n`` flows were counted (claimed,
    stopgap or missed), or what they had after ``timeout_s``."""
    def delta():
        c = first_byte_counters(d)
        return {k: c.get(k, 0) - before.get(k, 0) for k in FIRST_BYTE_KINDS}
    try:
        return wait_for(lambda: (lambda x: x if x["claimed"] + x["stopgap"] + x["missed"] >= n
                                 else None)(delta()), timeout_s, 0.1, "every flow counted")
    except TimeoutError:
        return delta()


def assert_nothing_left(tb, d, objs, spares_expected: bool, settle_s: float = 60) -> None:
    """After a crowd: every flow's class and filter gone (a class left without a filter must be
    one the daemon keeps as a spare, htb, or a ready pool class; ``spares_expected``: the crowd
    was large enough that the daemon must have kept some), every stage running; then the daemon
    stops cleanly, its BPF objects go, and nothing at all is left."""
    wait_for(lambda: d.status()["shaped_flows"] == 0 and daemon_objects(tb, d) == (0, 0),
             settle_s, 0.2, "every flow's class and filter gone")
    spares = daemon_spares(d)
    st = d.status()
    assert st["interfaces"][0]["spare_classes"] == len(spares), st["interfaces"]
    print(f"flash crowd: {len(spares)} spare classes kept after the crowd")
    assert spares or not spares_expected, st["interfaces"]
    assert st["healthy"], st["stages"]
    assert all(s["state"] == "running" for s in st["stages"] if s["name"] != "metrics"), \
        st["stages"]
    assert d.stop() == 0
    assert "Traceback" not in d.log_text()
    wait_for(lambda: not any(bpfobjs.alive(objs).values()), 10, 0.05,
             "the daemon's BPF programs, maps and links gone")
    assert "f1f0:" not in tc_show(tb, "qdisc"), tc_show(tb, "qdisc")
    assert kernel_objects(tb) == (0, 0) and "f1f0:" not in tc_show(tb, "class")
