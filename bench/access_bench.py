"""Where per-flow pacing pays (issue 30): many clients behind their own access links, the same
traffic through each server-side setup, in one VM boot, in the VM's virtual time.

``harness.access``: one server, N clients (default 20), each behind an access link (tbf at the
router toward it) of a rate from ``RATES_MBIT``, a queue that is shallow (24 KiB) or deep
(250 ms of the rate), and a round trip from ``RTTS_MS`` (netem on the client's ACK path). On
three links of four a household UDP flow (200-byte datagrams every 20 ms from a second sender)
shares the link; its one-way delay above its minimum is the delay the access queue adds.

Traffic (``harness.accesssrv`` serves, ``harness.accessclient`` receives, one HTTP/1.1
connection per client, every fourth client over IPv6): half the clients run a long download,
half a music-like stream of a fixed bitrate (``STREAM_SHARE`` x the access rate: 2 s of it at
once, then a chunk every 100 ms). "The rule's rate" of client i is ``SHARES[i % 3]`` x its
access rate (0.8, 0.9 or 0.95: how close to the access rate one can pace).

Setups, one after another on the same topology, fresh servers for each:
``unshaped`` (fq_codel, CUBIC), ``fq_cubic``, ``fq_bbr``, ``fq_maxrate`` (fq, CUBIC,
SO_MAX_PACING_RATE at the rule's rate on every accepted socket), ``nginx_limit_rate`` (nginx
serves the downloads with ``limit_rate`` at the rule's rate, fq_codel; the streams come from
the own server, which nginx cannot do), ``flowpacer_htb`` and ``flowpacer_psp`` (the daemon,
``--no-tracer``, one rule per client's port: sock_diag finds a flow after up to 0.2 s, which
runs unshaped until then) and their ``_hold`` variants (the server sends nothing before the
daemon has every connection: what first-byte shaping gives).

Per client and setup, over the window from ``--skip`` s to the end: goodput and its worst
second, a stream's seconds below its bitrate (a player that starts after 1 s of it and stalls
when its buffer empties, ``harness.accessfig.playout``: over the whole run), the server's
retransmits (``ss``), drops at the access link (tbf counters; also over the whole run), the
household flow's added delay p50/p99, jitter and loss, time to first byte and to the first 64
and 256 KiB; per setup Jain's index of goodput/rule rate over the downloads and the guest's busy
CPU seconds per delivered gigabit (everything in the one-vCPU guest: server, daemon, router,
receivers).

Writes bench/results/access.json (``--tag T``: access_T.json, for a second kernel).
Run: ``.venv/bin/python -m bench.access_bench [--quick]`` (``python -m bench.run access``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .reportkit import ResultIndex, num, table

log = logging.getLogger("bench.access_bench")

RATES_MBIT = (4, 6, 8, 12, 25)
RTTS_MS = (10, 20, 40, 80, 100)
SHALLOW_BYTES = 24 * 1024
DEEP_MS = 250
SHARES = (0.8, 0.9, 0.95)
STREAM_SHARE = 0.5
PREROLL_S = 2.0                 # the stream server's burst ahead
PLAYER_START_S = 1.0            # the player starts (and restarts after a stall) with 1 s of it
CHUNK_S = 0.1
FIRST_KIB = (64, 256)
BIN_S = 0.01
BASE_PORT = 5700
SETUPS = ("unshaped", "fq_cubic", "fq_bbr", "fq_maxrate", "nginx_limit_rate", "flowpacer_htb",
          "flowpacer_psp", "flowpacer_htb_hold", "flowpacer_psp_hold")


def plan(n: int) -> List[dict]:
    """Client i's link and traffic: every (rate, queue, kind) once in 20 clients."""
    out = []
    for i in range(n):
        rate = RATES_MBIT[i % len(RATES_MBIT)]
        out.append({"rate_mbit": rate,
                    "shallow": (i // len(RATES_MBIT)) % 2 == 0,
                    "rtt_ms": RTTS_MS[(i * 2 + i // len(RATES_MBIT)) % len(RTTS_MS)],
                    "share": SHARES[i % len(SHARES)],
                    "stream": (i + i // 10) % 2 == 1,
                    "household": i % 4 != 3,
                    "v6": i % 4 == 2})
    return out


def links(n: int):
    from harness.access import LinkSpec, deep_buffer
    from harness.pacing import mbit
    return [LinkSpec(mbit(p["rate_mbit"]), SHALLOW_BYTES if p["shallow"] else
                     deep_buffer(mbit(p["rate_mbit"]), DEEP_MS), p["rtt_ms"], p["household"])
            for p in plan(n)]


def rule_bps(c, p: dict) -> int:
    """The rule's rate of client ``c`` (bytes/s)."""
    return int(c.spec.rate_bps * p["share"])


def rules_text(net, plans) -> str:
    lines = ["interface: IFACE", "backend: BACKEND", "link_rate: 1gbit", "rules:"]
    for c, p in zip(net.clients, plans):
        lines += [f"  - name: client{c.index}",
                  f"    match: {{direction: inbound, local_port: {BASE_PORT + c.index}}}",
                  f"    rate: {rule_bps(c, p) * 8}bit"]
    return "\n".join(lines) + "\n"


def cpu_times() -> tuple:
    """(busy, total) jiffies of the (guest's one) CPU from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def proc_cpu(pids) -> float:
    """CPU seconds (user + system) of the processes ``pids`` so far (gone ones: 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            total += int(v[11]) + int(v[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def wait_v6(net, limit_s: float = 20) -> None:
    """IPv6 forwarding starts only after the links' link-local addresses pass DAD (~1-2 s):
    before that a SYN is lost and the connect takes 1 s more. Wait until no address of any
    namespace is tentative."""
    deadline = time.monotonic() + limit_s
    for ns in net.namespaces:
        while net.run(ns, ["ip", "-6", "addr", "show", "tentative"]).stdout.strip():
            if time.monotonic() > deadline:
                log.warning("%s: IPv6 addresses still tentative after %.0f s", ns, limit_s)
                return
            time.sleep(0.1)


def start_servers(net, setup: str, plans, workdir: Path, hold: Optional[Path]):
    """The setup's servers (fresh): [(popen, kind)]."""
    from harness.pacing import mbit  # noqa: F401
    from harness.accesssrv import nginx_conf
    from harness.servers import make_files
    cc = "bbr" if setup == "fq_bbr" else "cubic"
    ports = []
    nginx_ports: Dict[int, int] = {}
    for c, p in zip(net.clients, plans):
        port = BASE_PORT + c.index
        if setup == "nginx_limit_rate" and not p["stream"]:
            nginx_ports[port] = rule_bps(c, p)
            continue
        ports.append({"port": port, "mode": "stream" if p["stream"] else "download",
                      "bitrate": int(c.spec.rate_bps * STREAM_SHARE), "preroll_s": PREROLL_S,
                      "chunk_s": CHUNK_S,
                      "max_pacing_rate": rule_bps(c, p) if setup == "fq_maxrate" else 0})
    d = workdir / setup
    d.mkdir(parents=True, exist_ok=True)
    spec = d / "server.json"
    spec.write_text(json.dumps({"ports": ports, "cc": cc, "seconds": 600,
                                **({"hold": str(hold)} if hold else {})}))
    procs = [(net.popen(net.server_ns, [sys.executable, "-m", "harness.accesssrv", spec],
                        stderr=open(d / "server.err", "w")), "server")]
    if nginx_ports:
        for sub in ("tmp", "www"):
            (d / sub).mkdir(exist_ok=True)
        make_files(d / "www", {"big": 4 << 30})
        conf = d / "nginx.conf"
        conf.write_text(nginx_conf(str(d), nginx_ports))
        procs.append((net.popen(net.server_ns, ["nginx", "-c", conf],
                                stderr=open(d / "nginx.err", "w")), "nginx"))
    for p in ports:
        net.wait_listening(p["port"])
    for port in nginx_ports:
        net.wait_listening(port)
    return procs


def server_pids(procs) -> List[int]:
    pids = []
    for p, kind in procs:
        pids.append(p.pid)
        if kind == "nginx":
            out = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout
            pids += [int(x) for x in out.split()]
    return pids


def run_setup(net, setup: str, seconds: int, skip: float, workdir: Path) -> dict:
    from harness import accessfig as F
    from harness.access import Household, counters_delta
    from harness.daemon import Daemon
    from harness.pacing import guest_timeout, wait_for
    plans = plan(len(net.clients))
    daemon = None
    hold = workdir / setup / "go" if setup.endswith("_hold") else None
    (workdir / setup).mkdir(parents=True, exist_ok=True)
    if setup in ("unshaped", "nginx_limit_rate"):
        net.server_qdisc("fq_codel")
    elif setup.startswith("fq_"):
        net.server_qdisc("fq")
    else:
        net.clear_server_qdisc()
        backend = setup.split("_")[1]
        daemon = Daemon(net, workdir / setup, rules_text(net, plans), "--no-tracer",
                        "--no-metrics", "--rescan", "0.2",
                        backend=backend).start(timeout=guest_timeout(90))
    servers = start_servers(net, setup, plans, workdir, hold)
    spids = server_pids(servers)
    hh_clients = [c for c, p in zip(net.clients, plans) if p["household"]]
    v6 = {c.index for c, p in zip(net.clients, plans) if p["v6"]}
    spec = {"seconds": seconds, "bin_s": BIN_S,
            "clients": [{"index": c.index, "ns": c.ns, "port": BASE_PORT + c.index,
                         "host": str(net.server_v6 if c.index in v6 else net.server_v4),
                         "path": "/big"} for c in net.clients]}
    cfile = workdir / setup / "clients.json"
    cfile.write_text(json.dumps(spec))
    rfile = workdir / setup / "received.json"
    hold_s = None
    shaped = None
    try:
        with Household(net, hh_clients, v6=v6) as hh:
            n_hh = len(hh.flows[0].sent)
            wait_for(lambda: len(hh.flows[0].sent) >= n_hh + 10, 30, "household flows")
            ta, ca, cpua = time.time_ns(), net.counters(), cpu_times()
            m_launch = time.monotonic()
            rx = subprocess.Popen([sys.executable, "-m", "harness.accessclient", cfile, rfile],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                if hold is not None:
                    try:
                        wait_for(lambda: daemon.status()["shaped_flows"] >= len(net.clients),
                                 30, "the daemon shaping every connection")
                    except TimeoutError:
                        log.warning("%s: released before every flow was shaped", setup)
                    hold.touch()
                    hold_s = round(time.monotonic() - m_launch, 3)
                wait_for(lambda: time.monotonic() >= m_launch + skip, skip + 30, "the warm-up",
                         interval=0.01)
                t0, c0, cpu0, pc0 = time.time_ns(), net.counters(), cpu_times(), proc_cpu(spids)
                dc0 = proc_cpu([daemon.proc.pid]) if daemon else 0.0
                ss0 = F.ss_retransmits(net.run(net.server_ns, ["ss", "-Htin", "state",
                                                               "established"]).stdout)
                line = rx.stdout.readline()
                if not line.startswith("done"):
                    raise AssertionError(f"the receivers said {line!r}, exit {rx.poll()}")
                t1, c1, cpu1, pc1 = time.time_ns(), net.counters(), cpu_times(), proc_cpu(spids)
                dc1 = proc_cpu([daemon.proc.pid]) if daemon else 0.0
                ss1 = F.ss_retransmits(net.run(net.server_ns, ["ss", "-Htin", "state",
                                                               "established"]).stdout)
                shaped = daemon.status()["shaped_flows"] if daemon else None
            finally:
                rx.stdin.close()
                rx.wait(timeout=guest_timeout(60))
            hh.stop()
    finally:
        rc = daemon.stop() if daemon else 0
        for p, _ in servers:
            p.terminate()
            p.wait(timeout=10)
    got = json.loads(rfile.read_text())
    w0 = (t0 - got["t_start_ns"]) / 1e9
    w1 = got["seconds"]
    drops = counters_delta(c0, c1)
    drops_all = counters_delta(ca, c1)
    udp = hh.figures(t0, t1)
    tick = os.sysconf("SC_CLK_TCK")
    clients = []
    for c, p, r in zip(net.clients, plans, got["clients"]):
        port = BASE_PORT + c.index
        sec = F.per_second(r["bins"], BIN_S, w0, w1)
        rule = rule_bps(c, p)
        bitrate = c.spec.rate_bps * STREAM_SHARE if p["stream"] else None
        x = {"client": c.index, "kind": "stream" if p["stream"] else "download",
             "rate_bit_s": c.spec.rate_bps * 8, "buffer_bytes": c.spec.buffer_bytes,
             "shallow": c.spec.shallow, "rtt_ms": c.spec.rtt_ms, "v6": p["v6"],
             "share": p["share"], "rule_bit_s": rule * 8,
             "bitrate_bit_s": None if bitrate is None else int(bitrate * 8),
             "goodput_bit_s": round(sum(sec) / len(sec) * 8) if sec else 0,
             "worst_second_bit_s": round(min(sec) * 8) if sec else 0,
             "per_second_bit_s": [round(v * 8) for v in F.per_second(r["bins"], BIN_S, 0, w1)],
             "retransmits": ss1.get(port, 0) - ss0.get(port, 0),
             "retransmits_all": ss1.get(port, 0),
             "access_drops": drops[c.index]["drops"],
             "access_drops_all": drops_all[c.index]["drops"],
             "access_packets": drops[c.index]["packets"],
             "ttfb_ms": None if r["ttfb_s"] is None else round(r["ttfb_s"] * 1000, 1),
             "error": r["error"],
             "udp": udp.get(c.index)}
        for k in FIRST_KIB:
            t = F.first_reach(r["bins"], BIN_S, k * 1024)
            x[f"first_{k}k_ms"] = None if t is None else round(t * 1000)
        if bitrate:
            x["playout"] = F.playout(r["bins"], BIN_S, bitrate, bitrate * PLAYER_START_S,
                                     t_to=w1)
        clients.append(x)
    delivered = sum(sum(F.per_second(r["bins"], BIN_S, w0, w1)) for r in got["clients"])
    busy_s = (cpu1[0] - cpu0[0]) / tick
    downloads = [x for x in clients if x["kind"] == "download"]
    cdf = {}
    for kind, shallow in (("shallow", True), ("deep", False)):
        d = [v for fl in hh.flows if fl.client.spec.shallow == shallow
             for v in F.added_delays_ms(fl.arrivals, t0, t1)]
        cdf[kind] = [round(v, 3) for v in F.quantiles(d, 200)]
    out = {"setup": setup, "clients": clients, "window_s": round(w1 - w0, 2),
           "started_s": round(w0, 2), "udp_cdf": cdf, "daemon_rc": rc, "shaped_flows": shaped, "hold_s": hold_s,
           # the whole guest (server, router, clients: one vCPU): near 1 means CPU-bound figures
           "guest_cpu_busy": round((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 3),
           "delivered_bytes": round(delivered),
           "cpu_s_per_gbit": F.cpu_per_gbit(busy_s, delivered),
           "server_cpu_s_per_gbit": F.cpu_per_gbit(pc1 - pc0, delivered),
           "daemon_cpu_s_per_gbit": F.cpu_per_gbit(dc1 - dc0, delivered) if daemon else None,
           "jain_goodput_per_rule": F.jain([x["goodput_bit_s"] / x["rule_bit_s"]
                                            for x in downloads]),
           "jain_goodput_per_access": F.jain([x["goodput_bit_s"] / x["rate_bit_s"]
                                              for x in downloads])}
    m = summary(out)
    log.info("%s: drops %d (all %d), udp p99 max %s ms, min dl goodput/rule %.2f, stall s %s, "
             "cpu %.1f s/Gbit", setup, m["drops"], m["drops_all"], m["udp_p99_max"],
             m["goodput_per_rule_min"] or 0, m["stream_below_seconds"], out["cpu_s_per_gbit"] or 0)
    return out


def guest(args) -> int:
    from harness import psplib
    from harness.access import AccessNet
    from harness.pacing import modprobe
    from .vm_sharing import guest_progress, guest_result
    psplib.ensure_loaded()
    modprobe("sch_fq", "sch_fq_codel", "tcp_bbr")
    runs: List[dict] = []
    # the guest's own /tmp: the daemon's control socket cannot be bound on the 9p share
    workdir = Path(tempfile.mkdtemp(prefix="fp-access-"))
    spec = links(args.clients)
    with psplib.rmem_max(psplib.BIG_RMEM_MAX), AccessNet(spec) as net:
        wait_v6(net)
        for s in args.setups.split(","):
            try:
                runs.append(run_setup(net, s, args.seconds, args.skip, workdir))
            except Exception as e:              # one setup's failure is recorded, not fatal
                log.exception("%s failed", s)
                runs.append({"setup": s, "failed": f"{e.__class__.__name__}: {e}"[-1000:],
                             "clients": []})
            guest_progress(args.out, runs=runs)
    return guest_result(args.out, runs=runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 clients, 6 s per setup")
    ap.add_argument("--clients", type=int, default=None, help="number of clients (20; quick 5)")
    ap.add_argument("--seconds", type=int, default=None, help="seconds per setup (8; quick 6)")
    ap.add_argument("--skip", type=float, default=3.0, help="seconds left out at the start")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--tag", default="", help="write access_TAG.json (another kernel's run)")
    ap.add_argument("--kernel", default="", help="the VM's kernel (FLOWPACER_VM_KERNEL: 6.1, 6.12)")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.clients = args.clients or (5 if args.quick else 20)
    args.seconds = args.seconds or (6 if args.quick else 8)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.guest:
        return guest(args)
    if os.geteuid() != 0:
        print("access_bench: needs root", file=sys.stderr)
        return 2
    from .common import write
    from .vm_sharing import vm_bench
    if args.kernel:
        os.environ["FLOWPACER_VM_KERNEL"] = args.kernel
    fig = {"setup": {"clients": args.clients, "seconds_per_setup": args.seconds,
                     "skip_s": args.skip, "rates_mbit": list(RATES_MBIT), "rtts_ms": list(RTTS_MS),
                     "shallow_bytes": SHALLOW_BYTES, "deep_ms": DEEP_MS, "shares": list(SHARES),
                     "stream_share": STREAM_SHARE, "preroll_s": PREROLL_S,
                     "player_start_s": PLAYER_START_S, "chunk_s": CHUNK_S,
                     "first_kib": list(FIRST_KIB), "plan": plan(args.clients),
                     "household": "200-byte UDP datagrams every 20 ms on 3 links of 4",
                     "setups": args.setups.split(",")}}
    t0 = time.monotonic()
    n = len(fig["setup"]["setups"])
    rc = vm_bench(fig, "bench.access_bench",
                  ["--clients", str(args.clients), "--seconds", str(args.seconds), "--skip",
                   str(args.skip), "--setups", args.setups],
                  budget=300 + n * (args.seconds + 25) * max(1, args.clients / 5) * 2.5)
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    path = write("access" + (f"_{args.tag}" if args.tag else ""), fig, {})
    print(f"wrote {path}", file=sys.stderr)
    return rc


# ============================================================== report

KERNEL_RESULTS = (("access", "6.1"), ("access_612", "6.12"))
LABELS = {"unshaped": "unshaped (fq_codel, CUBIC)", "fq_cubic": "fq, CUBIC", "fq_bbr": "fq, BBR",
          "fq_maxrate": "fq + SO_MAX_PACING_RATE", "nginx_limit_rate": "nginx limit_rate",
          "flowpacer_htb": "flowpacer htb", "flowpacer_psp": "flowpacer psp",
          "flowpacer_htb_hold": "flowpacer htb, hold", "flowpacer_psp_hold": "flowpacer psp, hold"}


def _med(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None


def summary(run: dict) -> dict:
    cs = run["clients"]
    dl = [x for x in cs if x["kind"] == "download"]
    st = [x for x in cs if x["kind"] == "stream"]
    u = [x["udp"] for x in cs if x.get("udp")]
    return {"drops": sum(x["access_drops"] for x in cs),
            "drops_all": sum(x["access_drops_all"] for x in cs),
            "links_with_drops": sum(1 for x in cs if x["access_drops"]),
            "retransmits": sum(x["retransmits"] or 0 for x in cs),
            "udp_p50_median": _med(x.get("p50_ms") for x in u),
            "udp_p99_median": _med(x.get("p99_ms") for x in u),
            "udp_p99_max": max((x["p99_ms"] for x in u if x.get("p99_ms") is not None), default=None),
            "udp_jitter_max": max((x["jitter_ms"] for x in u if x.get("jitter_ms") is not None),
                                  default=None),
            "udp_loss_max": max((x.get("loss") or 0 for x in u), default=None),
            "goodput_per_rule_min": min((x["goodput_bit_s"] / x["rule_bit_s"] for x in dl),
                                        default=None),
            "worst_second_per_rule_min": min((x["worst_second_bit_s"] / x["rule_bit_s"] for x in dl),
                                             default=None),
            "goodput_total_bit_s": sum(x["goodput_bit_s"] for x in cs),
            "stream_below_seconds": sum(x["playout"]["below_bitrate_seconds"] for x in st
                                        if x.get("playout")),
            "streams_stalled": sum(1 for x in st if x.get("playout", {}).get("stalls")),
            "streams": len(st),
            "ttfb_median_ms": _med(x["ttfb_ms"] for x in cs),
            "first_256k_median_ms": _med(x.get("first_256k_ms") for x in cs),
            "first_256k_max_ms": max((x.get("first_256k_ms") or 0 for x in cs), default=None),
            "jain": run.get("jain_goodput_per_rule"),
            "cpu_s_per_gbit": run.get("cpu_s_per_gbit")}


def _runs(R: ResultIndex):
    """[(kernel label, result name, figures)] of the kernels that have a result."""
    return [(k, name, R.fig(name)) for name, k in KERNEL_RESULTS if R.fig(name)]


def _f(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def report_section(R: ResultIndex) -> str:
    """Issue 30 (a chapter of its own, only when there is a result)."""
    kernels = _runs(R)
    if not kernels:
        return ""
    f = kernels[0][2]
    s = f.get("setup", {})
    out = ["## Where per-flow pacing pays: clients behind access links (`bench/access_bench.py`, "
           "issue 30)\n"]
    for k, name, _ in kernels:
        out.append(f"Kernel {k}: " + R.provenance("access", name) + "\n")
    out.append(
        f"In the VM (virtual time), one boot per kernel, every setup on the same topology: "
        f"{s.get('clients')} clients, each behind its own access link (tbf at "
        f"{', '.join(map(str, s.get('rates_mbit', [])))} Mbit/s; queue "
        f"{num(s.get('shallow_bytes', 0) / 1024, 'KiB')} (shallow) or {s.get('deep_ms')} ms of the "
        f"rate (deep); RTT {', '.join(map(str, s.get('rtts_ms', [])))} ms by netem); half the "
        f"clients run a long download, half a music-like stream of {num(s.get('stream_share'))} x "
        f"the access rate ({s.get('preroll_s')} s of it at once, then a chunk every "
        f"{int(1000 * (s.get('chunk_s') or 0))} ms; the player starts with {s.get('player_start_s')} s "
        f"buffered and stalls when it runs dry); {s.get('household')}. The rule's rate is "
        f"{' / '.join(map(str, s.get('shares', [])))} x the access rate (client i: the (i mod 3)th). "
        f"{s.get('seconds_per_setup')} s per setup, the first {s.get('skip_s')} s left out of the "
        f"window figures (drops \"whole run\" and streams' stalls count from the first byte). "
        f"*hold*: the server sends nothing before the daemon has every connection (what "
        f"first-byte shaping gives); without it the first ≤0.2 s of each flow go unshaped "
        f"(sock_diag's rescan). CPU: the one-vCPU guest's busy time (server, daemon, router, "
        f"receivers, household) per delivered gigabit; the server is the same Python program in "
        f"every setup but nginx's. TTFB in a boot's first setup can carry a one-off extra (6.12: "
        f"~180 ms on every client; a check ran the same setup twice and saw it only the first "
        f"time): compare TTFB across the later setups.\n")
    for k, name, fk in kernels:
        if fk.get("unavailable") or fk.get("failed"):
            out.append(f"**{k}: could not run here:** {(fk.get('unavailable') or fk.get('failed'))[-500:]}\n")
        if fk.get("incomplete"):
            out.append(f"**{k}: incomplete run:** {fk['incomplete'].splitlines()[0][:200]}\n")
        for r in fk.get("runs", []):
            if r.get("failed"):
                out.append(f"**{k}, {r['setup']} failed:** `{r['failed'][-300:]}`\n")
    rows, rows2 = [], []
    for k, _, fk in kernels:
        for run in fk.get("runs", []):
            if not run.get("clients"):
                continue
            m = summary(run)
            label = LABELS.get(run["setup"], run["setup"])
            rows.append([k, label, f"{m['drops']} ({m['links_with_drops']})", str(m["drops_all"]),
                         str(m["retransmits"]), num(m["udp_p50_median"], "ms", 2),
                         num(m["udp_p99_median"], "ms", 2), num(m["udp_p99_max"], "ms", 2),
                         num(m["udp_jitter_max"], "ms", 2),
                         "—" if m["udp_loss_max"] is None else f"{100 * m['udp_loss_max']:.1f} %"])
            rows2.append([k, label, f"{m['goodput_total_bit_s'] / 1e6:.1f}",
                          _f(m["goodput_per_rule_min"]), _f(m["worst_second_per_rule_min"]),
                          f"{m['stream_below_seconds']} ({m['streams_stalled']} of {m['streams']})",
                          num(m["ttfb_median_ms"], "ms", 0),
                          f"{num(m['first_256k_median_ms'], '', 0)} / {num(m['first_256k_max_ms'], 'ms', 0)}",
                          _f(m["jain"], 3), _f(m["cpu_s_per_gbit"], 1),
                          f"{100 * run.get('guest_cpu_busy', 0):.0f} %"])
    if rows:
        out.append("At the access links (drops: tbf drops in the window, links with any; household "
                   "flow: added one-way delay, median link and worst link):\n")
        out.append(table(["kernel", "setup", "access drops (links)", "drops, whole run",
                          "retransmits", "household p50 (median link)", "p99 (median link)",
                          "p99 (worst link)", "jitter (worst link)", "loss (worst link)"], rows))
        out.append("What the listeners get (goodput / rule: downloads only, the lowest client; "
                   "below-bitrate seconds: summed over the streams):\n")
        out.append(table(["kernel", "setup", "goodput, all (Mbit/s)", "min goodput / rule",
                          "min worst second / rule", "stream seconds below bitrate (streams)",
                          "TTFB (median)", "first 256 KiB, median / worst", "Jain (downloads)",
                          "guest CPU s per Gbit", "guest CPU busy"], rows2))
        out.append(_by_queue_and_share(kernels))
        out.append(_plots(kernels))
        out.append("Per client figures (goodput per second, drops, delays, stalls, TTFB) are in "
                   "bench/results/access.json (6.1) and access_612.json (6.12).\n")
    return "\n".join(out)


def _by_queue_and_share(kernels) -> str:
    rows = []
    for k, _, fk in kernels:
        for run in fk.get("runs", []):
            cs = run.get("clients") or []
            if not cs:
                continue
            cells = [k, LABELS.get(run["setup"], run["setup"])]
            for shallow in (True, False):
                sub = [x for x in cs if x["shallow"] == shallow]
                p99 = [x["udp"]["p99_ms"] for x in sub if x.get("udp") and x["udp"].get("p99_ms") is not None]
                cells.append(f"{sum(x['access_drops'] for x in sub)} / "
                             f"{num(max(p99) if p99 else None, 'ms', 1)}")
            for sh in sorted({x["share"] for x in cs}):
                sub = [x for x in cs if x["share"] == sh]
                p99 = [x["udp"]["p99_ms"] for x in sub if x.get("udp") and x["udp"].get("p99_ms") is not None]
                cells.append(f"{sum(x['access_drops'] for x in sub)} / "
                             f"{num(max(p99) if p99 else None, 'ms', 1)}")
            rows.append(cells)
    if not rows:
        return ""
    shares = sorted({x["share"] for _, _, fk in kernels for r in fk.get("runs", [])
                     for x in r.get("clients") or []})
    return ("By access queue and by the rule's share of the access rate (only the setups with a "
            "rate use it: fq + SO_MAX_PACING_RATE, nginx limit_rate, flowpacer); each cell: drops in "
            "the window / household p99 of the worst link:\n\n"
            + table(["kernel", "setup", "shallow links", "deep links",
                     *[f"rule {sh:g} x access" for sh in shares]], rows))


def _style(setup: str) -> str:
    return "--" if setup.endswith("_hold") else "-"


def _plots(kernels) -> str:
    from .reportkit import pyplot, savefig
    plt = pyplot()
    out = []
    k, _, f = kernels[0]
    runs = [r for r in f.get("runs", []) if r.get("clients")]
    if not runs:
        return ""
    # per-second goodput of a few clients: a shallow download, a deep download, a stream
    cs = runs[0]["clients"]
    pick = []
    for want in (lambda x: x["kind"] == "download" and x["shallow"] and x["rtt_ms"] >= 80,
                 lambda x: x["kind"] == "download" and not x["shallow"],
                 lambda x: x["kind"] == "stream" and x["shallow"]):
        c = next((x for x in cs if want(x)), None)
        if c is not None:
            pick.append(c["client"])
    if pick:
        fig, axes = plt.subplots(1, len(pick), figsize=(4.6 * len(pick), 3.4), squeeze=False)
        for ax, ci in zip(axes[0], pick):
            for r in runs:
                x = next(c for c in r["clients"] if c["client"] == ci)
                ys = [v / 1e6 for v in x["per_second_bit_s"]]
                ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=2.5, lw=1, ls=_style(r["setup"]),
                        label=LABELS.get(r["setup"], r["setup"]))
            x0 = next(c for c in cs if c["client"] == ci)
            ax.axhline(x0["rule_bit_s"] / 1e6, color="k", ls=":", lw=0.8)
            if x0.get("bitrate_bit_s"):
                ax.axhline(x0["bitrate_bit_s"] / 1e6, color="r", ls="--", lw=0.8)
            ax.set_title(f"client {ci}: {x0['kind']}, {x0['rate_bit_s'] / 1e6:g} Mbit/s, "
                         f"{'shallow' if x0['shallow'] else 'deep'}, {x0['rtt_ms']:g} ms", fontsize=9)
            ax.set_xlabel("second of the run")
        axes[0][0].set_ylabel(f"Mbit/s received (kernel {k}; dotted: rule, dashed: bitrate)")
        axes[0][-1].legend(fontsize=7)
        out.append(savefig(fig, "access_goodput.png"))
    # household added delay CDFs, shallow and deep links
    if any(r.get("udp_cdf") for r in runs):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for ax, kind in zip(axes, ("shallow", "deep")):
            for r in runs:
                q = (r.get("udp_cdf") or {}).get(kind)
                if not q:
                    continue
                ys = [i / (len(q) - 1) for i in range(len(q))]
                ax.plot([max(v, 1e-3) for v in q], ys, lw=1.2, ls=_style(r["setup"]),
                        label=LABELS.get(r["setup"], r["setup"]))
            ax.set_xscale("log")
            ax.set_xlabel("household added one-way delay (ms)")
            ax.set_title(f"{kind} access queues, kernel {k}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of datagrams")
        axes[0].legend(fontsize=7)
        out.append(savefig(fig, "access_udp_cdf.png"))
    # drops per setup, each kernel
    fig, ax = plt.subplots(figsize=(9, 3.4))
    names = list(dict.fromkeys(r["setup"] for _, _, fk in kernels for r in fk.get("runs", [])))
    w = 0.8 / max(1, len(kernels))
    for j, (kk, _, fk) in enumerate(kernels):
        by = {r["setup"]: summary(r) for r in fk.get("runs", []) if r.get("clients")}
        ax.bar([i + j * w for i in range(len(names))],
               [by[n]["drops_all"] if n in by else 0 for n in names], w, label=f"kernel {kk}")
    ax.set_xticks([i + w * (len(kernels) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels([LABELS.get(n, n) for n in names], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("access-link drops, whole run")
    ax.set_yscale("symlog")
    ax.legend(fontsize=8)
    out.append(savefig(fig, "access_drops.png"))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
