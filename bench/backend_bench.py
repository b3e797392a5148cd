"""Backend and daemon cost at scale (issue 2's performance targets).

1. install 1000 flows (class + filter) and remove them: ms per flow, in one plan and one by one
   (goal: <= 0.3 ms per flow);
2. with 10 000 flows installed, a single flow's throughput through the last-installed filter
   compared with the same flow alone (goal: >= 90 %); iperf3 -R with a fixed client port;
3. the daemon's RSS with 10 000 live, shaped flows (goal: <= 150 MB), and how long it took to
   shape them from a cold start.

Writes bench/results/backend.json. Run: ``.venv/bin/python -m bench.backend_bench``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from flowpacer.backend import tc as tcb
from flowpacer.backend.htb import HtbCodec
from flowpacer.control import call
from flowpacer.errors import FlowpacerError
from flowpacer.model import FlowKey, Op, OpKind, Shape
from flowpacer.testbed import PY, Testbed, in_netns, wait_for

from .common import RESULTS, percentiles, write

MBIT = 125_000


def keys(tb, n, base=20000, v6_every=2):
    out = []
    for i in range(n):
        if v6_every and i % v6_every:
            out.append(FlowKey(tb.server_v6, 443, tb.client_v6, base + i))
        else:
            out.append(FlowKey(tb.server_v4, 443, tb.client_v4, base + i))
    return out


def install_cost(tb, n=1000) -> dict:
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, 1000 * MBIT)
        b.setup()
        ks = keys(tb, n)
        s = Shape("b", 10 * MBIT, 10 * MBIT)
        t0 = time.perf_counter()
        r = b.apply([Op(OpKind.ADD, k, s) for k in ks])
        t1 = time.perf_counter()
        assert r.added == n and not r.errors, r.errors[:3]
        r = b.apply([Op(OpKind.REMOVE, k) for k in ks])
        t2 = time.perf_counter()
        assert r.removed == n
        # one flow per apply, as events arrive in the daemon
        one_add, one_del = [], []
        for k in ks:
            a = time.perf_counter()
            b.apply([Op(OpKind.ADD, k, s)])
            one_add.append((time.perf_counter() - a) * 1e3)
        for k in ks:
            a = time.perf_counter()
            b.apply([Op(OpKind.REMOVE, k)])
            one_del.append((time.perf_counter() - a) * 1e3)
        b.teardown()
        b.close()
    return {"flows": n,
            "batched_add_ms_per_flow": (t1 - t0) * 1e3 / n,
            "batched_remove_ms_per_flow": (t2 - t1) * 1e3 / n,
            "single_add_ms": percentiles(one_add), "single_remove_ms": percentiles(one_del)}


def iperf(tb, seconds=3, cport=45678) -> float:
    r = tb.run(tb.client_ns, ["iperf3", "-c", str(tb.server_v4), "-R", "-t", str(seconds),
                              "--cport", str(cport), "-J"], timeout=seconds + 30)
    return json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"]


def classification(tb, n=10_000, runs=3) -> dict:
    tb.popen(tb.server_ns, ["iperf3", "-s"])
    tb.wait_listening(5201)
    link = 100_000 * MBIT                        # far above what veth carries: classify only
    target = FlowKey(tb.server_v4, 5201, tb.client_v4, 45678)
    s = Shape("b", link, link)
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, link)
        b.setup()
        b.apply([Op(OpKind.ADD, target, s)])
    alone, loaded = [], []
    many = keys(tb, n, base=1000, v6_every=0)
    for _ in range(runs):
        alone.append(iperf(tb))
        with in_netns(tb.server_ns):
            b.apply([Op(OpKind.REMOVE, target)])
            b.apply([Op(OpKind.ADD, k, s) for k in many] + [Op(OpKind.ADD, target, s)])
        loaded.append(iperf(tb))
        with in_netns(tb.server_ns):
            b.apply([Op(OpKind.REMOVE, k) for k in many])
    with in_netns(tb.server_ns):
        st = b.stats()[target]
        b.teardown()
        b.close()
    ratio = sorted(loaded)[len(loaded) // 2] / sorted(alone)[len(alone) // 2]
    return {"flows_installed": n, "alone_bit_s": alone, "with_flows_bit_s": loaded,
            "median_ratio": ratio, "target_class_bytes": st.bytes}


def daemon_scale(tb, n=10_000) -> dict:
    tmp = tempfile.mkdtemp(prefix="fp-bench-")
    rules = os.path.join(tmp, "rules.yaml")
    with open(rules, "w") as f:
        f.write(textwrap.dedent(f"""\
            interface: {tb.server_if}
            backend: htb
            link_rate: 10gbit
            rules:
              - name: held
                match: {{process: fp-hold-srv, local_port: 7000}}
                rate: 1mbit
            """))
    os.chmod(rules, 0o600)
    sock = os.path.join(tmp, "control.sock")
    tb.popen(tb.server_ns, [PY, "-m", "flowpacer.tools.blaster", "hold-serve", "--port", "7000"])
    tb.wait_listening(7000)
    d = tb.popen(tb.server_ns, [PY, "-m", "flowpacer.cli", "run", "--rules", rules, "--socket", sock])

    def ready():
        try:
            return call(sock, {"cmd": "ping"}, timeout=2)
        except FlowpacerError:
            return None
    wait_for(ready, 60, 0.1, "daemon")
    holder = tb.popen(tb.client_ns, [PY, "-m", "flowpacer.tools.blaster", "hold-connect", "--host",
                                     str(tb.server_v4), "--port", "7000", "--count", str(n),
                                     "--seconds", "300"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      text=True)
    t0 = time.monotonic()
    holder.stdout.readline()
    wait_for(lambda: call(sock, {"cmd": "status"}, timeout=30)["shaped_flows"] >= n, 120, 0.5,
             f"{n} shaped flows")
    shaped_s = time.monotonic() - t0
    pid = int(subprocess.run(["pgrep", "-f", f"flowpacer.cli run --rules {rules}"],
                             capture_output=True, text=True).stdout.split()[0])
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    t1 = time.perf_counter()
    call(sock, {"cmd": "status"}, timeout=60)
    status_s = time.perf_counter() - t1
    holder.stdin.close()
    wait_for(lambda: call(sock, {"cmd": "status"}, timeout=30)["shaped_flows"] == 0, 60, 0.5,
             "flows to be removed")
    d.send_signal(signal.SIGTERM)
    d.wait(timeout=60)
    return {"flows": n, "daemon_rss_bytes": rss, "open_to_all_shaped_s": shaped_s,
            "status_call_s": status_s}


PARTS = {"install": ("bnch1", install_cost), "classification": ("bnch2", classification),
         "daemon_10k": ("bnch3", daemon_scale)}


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(PARTS)
    figures = {}
    prev = RESULTS / "backend.json"
    if prev.exists():
        figures = json.loads(prev.read_text()).get("figures", {})
    for name in names:
        tag, fn = PARTS[name]
        with Testbed(tag=tag) as tb:
            figures[name] = fn(tb)
        print(json.dumps({name: figures[name]}, indent=2), flush=True)
    goals = {}
    if "install" in figures:
        goals["install_ms_per_flow<=0.3"] = figures["install"]["batched_add_ms_per_flow"] <= 0.3
        goals["remove_ms_per_flow<=0.3"] = figures["install"]["batched_remove_ms_per_flow"] <= 0.3
    if "classification" in figures:
        goals["throughput_with_10k_flows>=90%"] = figures["classification"]["median_ratio"] >= 0.9
    if "daemon_10k" in figures:
        goals["daemon_rss_10k<=150MB"] = figures["daemon_10k"]["daemon_rss_bytes"] <= 150e6
    path = write("backend", figures, goals)
    print(json.dumps(goals, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
