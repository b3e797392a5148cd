"""What the eBPF flow tracer costs and how fast it reports.

    sudo .venv/bin/python -m bench.tracer_overhead [--quick] [--out bench/results/tracer.json]

Measures, in two network namespaces made for the run (A watched, B the peer,
joined by a veth pair; removed at the end):

* event latency: from the target's connect()/accept() return (CLOCK_MONOTONIC
  taken in the target right after the call) to the OPEN coming out of
  Tracer.poll() in this process; paced flows, outbound and inbound separately.
  Negative values: the OPEN was delivered before the call returned (an
  outbound OPEN is sent when the SYN-ACK arrives, before connect() wakes up).
* sustained events/s: connect+accept+close loops over A's loopback as fast as
  one process goes, every event delivered and counted, lost events reported.
* connect+accept round trip (one iteration: connect, accept, close both) with
  no tracer, with the tracer watching the looping process, and with the
  tracer attached but watching another process (filtered in the kernel).
* per-program in-kernel cost (kernel.bpf_stats_enabled, restored after).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import List

from .reportkit import Goal, ResultIndex, g, num, pct as pct_text, pyplot, savefig, table

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
PR_SET_NAME = 15
A4, B4 = "10.78.0.1", "10.78.0.2"


# --------------------------------------------------------------- the agent

def _enter(ns: str, comm: str) -> None:
    import ctypes
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(ns, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)
    libc.prctl(PR_SET_NAME, comm.encode(), 0, 0, 0)


def agent(spec: dict) -> None:
    """Runs in a namespace; writes one JSON document on stdout at the end."""
    _enter(spec["ns"], spec["comm"])
    mode = spec["mode"]
    deadline = time.monotonic() + spec.get("max_s", 30)
    if mode == "rtt":        # loopback connect + accept + close, both ends here
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(4096)
        addr = ls.getsockname()
        sys.stdout.write(json.dumps({"ready": True}) + "\n")
        sys.stdout.flush()
        sys.stdin.readline()
        durs = []
        t_start = time.monotonic_ns()
        interval = 1.0 / spec["rate"] if spec.get("rate") else 0.0
        nxt = time.monotonic()
        for _ in range(spec["count"]):
            t0 = time.perf_counter_ns()
            c = socket.create_connection(addr)
            a, _ = ls.accept()
            a.close()
            c.close()
            durs.append(time.perf_counter_ns() - t0)
            if time.monotonic() > deadline:
                break
            if interval:
                nxt += interval
                pause = nxt - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        t_end = time.monotonic_ns()
        out = {"durations_ns": durs, "t_start": t_start, "t_end": t_end}
    elif mode == "server":   # accept count flows, note each return time
        ls = socket.socket()
        ls.bind((spec["bind"], 0))
        ls.listen(4096)
        ls.settimeout(spec.get("max_s", 30))
        sys.stdout.write(json.dumps({"ready": ls.getsockname()[1]}) + "\n")
        sys.stdout.flush()
        flows = []
        for _ in range(spec["count"]):
            a, peer = ls.accept()
            t = time.monotonic_ns()
            flows.append([t, a.getsockname()[1], peer[1]])
            a.close()
            if time.monotonic() > deadline:
                break
        out = {"flows": flows}
    else:                    # client: paced connects
        interval = 1.0 / spec["rate"]
        flows = []
        nxt = time.monotonic()
        for _ in range(spec["count"]):
            c = socket.socket()
            c.connect((spec["addr"], spec["port"]))
            t = time.monotonic_ns()
            flows.append([t, c.getsockname()[1], spec["port"]])
            c.close()
            nxt += interval
            pause = nxt - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            if time.monotonic() > deadline:
                break
        out = {"flows": flows}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------- the harness

def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=20)


class Netns:
    def __init__(self):
        sfx = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.a, self.b = f"fbA{sfx}", f"fbB{sfx}"
        self.made: list[str] = []
        self.va, self.vb = f"fba{sfx}", f"fbb{sfx}"

    def __enter__(self) -> "Netns":
        try:
            for ns in (self.a, self.b):
                sh("ip", "netns", "add", ns)
                self.made.append(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name",
               self.vb, "netns", self.b)
            for ns, dev, addr in ((self.a, self.va, A4), (self.b, self.vb, B4)):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.made = []

    def path(self, which: str) -> str:
        return f"/run/netns/{self.a if which == 'A' else self.b}"


class Agent:
    def __init__(self, **spec):
        self.p = subprocess.Popen([sys.executable, "-m", "bench.tracer_overhead", "--agent",
                                   json.dumps(spec)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def line(self, timeout: float = 60) -> dict:
        box: list = []
        th = threading.Thread(target=lambda: box.append(self.p.stdout.readline()), daemon=True)
        th.start()
        th.join(timeout)
        if not box or not box[0]:
            self.p.kill()
            raise RuntimeError("bench agent gave no answer")
        return json.loads(box[0])

    def go(self) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def wait(self) -> None:
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def pct(values, q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[i]


def summary_us(values_ns) -> dict:
    v = [x / 1000.0 for x in values_ns]
    if not v:
        return {"n": 0}
    return {"n": len(v), "unit": "us", "p50": round(pct(v, 50), 1), "p90": round(pct(v, 90), 1),
            "p99": round(pct(v, 99), 1), "max": round(max(v), 1), "mean": round(statistics.fmean(v), 1)}


class Poller:
    """Polls the tracer in a thread like the daemon does, stamping each event's delivery.

    It keeps only small int tuples (deliver_ns, kind, local port, remote port, seen_ns),
    not the events: a heap of many thousand live objects makes Python's garbage
    collector stall the consumer for 100+ ms, which measures the GC, not the tracer.
    """

    def __init__(self, tracer, keep: bool = True):
        self.t = tracer
        self.keep = keep
        self.got: list = []
        self.opens = 0
        self.closes = 0
        self.last_ns = 0
        self.stop_ev = threading.Event()
        self.th = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        from flowpacer import model
        OPEN = model.EventKind.OPEN
        while not self.stop_ev.is_set():
            evs = self.t.poll(50)
            if not evs:
                continue
            now = time.monotonic_ns()
            self.last_ns = now
            for e in evs:
                is_open = e.kind == OPEN
                if is_open:
                    self.opens += 1
                else:
                    self.closes += 1
                if self.keep:
                    k = e.flow.key
                    self.got.append((now, 1 if is_open else 2, k.local_port, k.remote_port,
                                     e.flow.seen_ns))

    def __enter__(self):
        self.th.start()
        return self

    def __exit__(self, *exc):
        self.stop_ev.set()
        self.th.join(5)


def bpf_stats(on: bool) -> str:
    path = "/proc/sys/kernel/bpf_stats_enabled"
    try:
        with open(path) as f:
            old = f.read().strip()
        with open(path, "w") as f:
            f.write("1" if on else "0")
        return old
    except OSError:
        return ""


def measure_latency(nets: Netns, tracer, n: int, rate: int) -> dict:
    from flowpacer import model
    tracer.set_watch({"fb_target"}, None)
    out = {}
    for direction in ("outbound", "inbound"):
        tracer.poll(0)
        if direction == "outbound":
            srv = Agent(mode="server", ns=nets.path("B"), comm="fb_peer", bind=B4, count=n)
            port = srv.line()["ready"]
            cli = Agent(mode="client", ns=nets.path("A"), comm="fb_target", addr=B4, port=port,
                        count=n, rate=rate)
            target = cli
        else:
            srv = Agent(mode="server", ns=nets.path("A"), comm="fb_target", bind=A4, count=n)
            port = srv.line()["ready"]
            cli = Agent(mode="client", ns=nets.path("B"), comm="fb_peer", addr=A4, port=port,
                        count=n, rate=rate)
            target = srv
        with Poller(tracer) as p:
            res = target.line()
            other = (srv if target is cli else cli).line()
            del other
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if p.opens >= len(res["flows"]):
                    break
                time.sleep(0.05)
        srv.wait()
        cli.wait()
        # a port can come back within the run (the peer closed first, so no TIME_WAIT
        # here): match each flow to the OPEN of its port nearest in time
        by_port: dict = {}
        for deliver, kind, lport, rport, seen in p.got:
            if kind != 1:
                continue
            port_id = lport if direction == "outbound" else rport
            by_port.setdefault(port_id, []).append((deliver, seen))
        ret_to_poll, kern_to_poll = [], []
        missing = 0
        for t_ret, lport, rport in res["flows"]:
            cands = by_port.get(lport if direction == "outbound" else rport)
            if not cands:
                missing += 1
                continue
            deliver, seen = min(cands, key=lambda c: abs(c[1] - t_ret))
            ret_to_poll.append(deliver - t_ret)
            kern_to_poll.append(deliver - seen)
        out[direction] = {
            "flows": len(res["flows"]), "rate_per_s": rate, "missing_open": missing,
            "return_to_poll": summary_us(ret_to_poll),
            "kernel_event_to_poll": summary_us(kern_to_poll),
        }
        log.info("latency %s: %s", direction, out[direction]["return_to_poll"])
    return out


def run_rtt(nets: Netns, count: int, tracer=None, watch=None, max_s: float = 20,
            rate: float = 0) -> dict:
    if tracer is not None:
        tracer.set_watch(watch, None)
        tracer.poll(0)
    a = Agent(mode="rtt", ns=nets.path("A"), comm="fb_target", count=count, max_s=max_s,
              rate=rate)
    a.line()
    before = tracer.stats() if tracer is not None else None
    poller = Poller(tracer, keep=False) if tracer is not None else None
    if poller:
        poller.__enter__()
    try:
        a.go()
        res = a.line(timeout=max_s + 30)
        a.wait()
        if poller:
            expect = 4 * len(res["durations_ns"]) if watch and "fb_target" in watch else 0
            deadline = time.monotonic() + 10
            while (expect and time.monotonic() < deadline and poller.opens + poller.closes
                   + tracer.stats()["lost"] - before["lost"] < expect):
                time.sleep(0.05)
    finally:
        if poller:
            poller.__exit__()
    d = res["durations_ns"]
    wall = (res["t_end"] - res["t_start"]) / 1e9
    out = {"iterations": len(d), "wall_s": round(wall, 3),
           "iterations_per_s": round(len(d) / wall, 1), "round_trip": summary_us(d)}
    if tracer is not None:
        after = tracer.stats()
        opens, closes = poller.opens, poller.closes
        got = opens + closes
        last = poller.last_ns or res["t_end"]
        span = (max(last, res["t_end"]) - res["t_start"]) / 1e9
        out.update({
            "events_delivered": {"open": opens, "close": closes},
            "events_per_s": round(got / span, 1) if got else 0.0,
            "flows_open_close_per_s": round(min(opens, closes) / span, 1) if got else 0.0,
            "lost": after["lost"] - before["lost"],
            "missed": after["missed"] - before["missed"],
            "filtered": after["filtered"] - before["filtered"],
        })
    return out


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        import bcc
        bcc_version = getattr(bcc, "__version__", "")
    except Exception:
        bcc_version = ""
    return {"cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "bcc": bcc_version,
            "virtualized": os.path.exists("/sys/hypervisor") or "hypervisor" in open("/proc/cpuinfo").read()}


def _median(xs):
    return round(statistics.median(xs), 1) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agent", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "tracer.json"))
    args = ap.parse_args(argv)
    if args.agent:
        agent(json.loads(args.agent))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.geteuid() != 0:
        print("tracer_overhead: needs root (BPF, network namespaces)", file=sys.stderr)
        return 2
    from flowpacer.errors import TracerUnavailable
    from flowpacer.sources.tracer import Tracer, prog_info

    rtt_n = 3000 if args.quick else 10000
    rounds = 2 if args.quick else 3
    lat_n = 200 if args.quick else 1000
    result = {"what": "flowpacer eBPF flow tracer overhead", "machine": machine(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "setup": "two network namespaces joined by a veth pair; targets are Python "
                       "processes; the tracer (default ring of 64 pages) runs in this process "
                       "(root namespace) polling in a thread, watching namespace A; times are "
                       "CLOCK_MONOTONIC; the round trip is one connect()+accept()+close() x2 "
                       "over A's loopback (4 events when watched)"}
    result["loadavg_before"] = list(os.getloadavg())
    old_stats = bpf_stats(False)
    try:
        with Netns() as nets:
            ino = os.stat(nets.path("A")).st_ino
            t = Tracer(netns_ino=ino)
            t0 = time.monotonic()
            try:
                t.start()
            except TracerUnavailable as e:
                print(f"tracer_overhead: {e}", file=sys.stderr)
                return 1
            result["tracer_start_s"] = {"value": round(time.monotonic() - t0, 2), "unit": "s"}
            result["hooks"] = t.hooks
            try:
                # 1. event latency, paced flows
                result["event_latency"] = measure_latency(nets, t, lat_n, rate=200)

                # 2. round trip: rounds of (none, filtered, watched), alternated so that
                #    the machine's drift hits all three alike
                runs = {"no_tracer": [], "tracer_filtering_non_target": [],
                        "tracer_watching_target": []}
                for r in range(rounds):
                    t.close()
                    runs["no_tracer"].append(run_rtt(nets, rtt_n))
                    t.start()
                    runs["tracer_filtering_non_target"].append(
                        run_rtt(nets, rtt_n, t, watch={"fb_nobody"}))
                    runs["tracer_watching_target"].append(
                        run_rtt(nets, rtt_n, t, watch={"fb_target"}))
                    log.info("round %d: %s", r, {k: v[-1]["round_trip"]["p50"] for k, v in runs.items()})
                rt = {}
                for k, v in runs.items():
                    rt[k] = {"unit": "us",
                             "p50_median_of_rounds": _median([x["round_trip"]["p50"] for x in v]),
                             "p99_median_of_rounds": _median([x["round_trip"]["p99"] for x in v]),
                             "iterations_per_s_median": _median([x["iterations_per_s"] for x in v]),
                             "rounds": v}
                base = rt["no_tracer"]["p50_median_of_rounds"]
                for k in ("tracer_filtering_non_target", "tracer_watching_target"):
                    rt[k]["p50_vs_no_tracer_pct"] = round(100.0 * (rt[k]["p50_median_of_rounds"]
                                                                   - base) / base, 1)
                result["round_trip"] = rt

                # 3. sustained: paced loads (each iteration = 2 flows: one outbound, one
                #    inbound, 4 events), then as fast as the process goes (from step 2)
                paced = []
                for flows_per_s in (2000, 5000, 10000):
                    it_rate = flows_per_s / 2
                    r = run_rtt(nets, int(it_rate * (2 if args.quick else 4)), t,
                                watch={"fb_target"}, rate=it_rate)
                    paced.append({"offered_flows_per_s": flows_per_s,
                                  "achieved_flows_per_s": round(2 * r["iterations_per_s"], 1),
                                  "flows": 2 * r["iterations"],
                                  "events_delivered": r["events_delivered"],
                                  "events_expected": 4 * r["iterations"],
                                  "lost": r["lost"], "missed": r["missed"]})
                    log.info("paced %d flows/s: %s", flows_per_s, paced[-1])
                result["sustained_paced"] = paced
                w = runs["tracer_watching_target"]
                result["sustained_max_rate"] = {
                    "events_per_s_median": _median([x["events_per_s"] for x in w]),
                    "flows_open_close_per_s_median": _median([x["flows_open_close_per_s"] for x in w]),
                    "lost_total": sum(x["lost"] for x in w),
                    "missed_total": sum(x["missed"] for x in w),
                    "delivered_total": {"open": sum(x["events_delivered"]["open"] for x in w),
                                        "close": sum(x["events_delivered"]["close"] for x in w)},
                    "expected_total": {"open": 2 * sum(x["iterations"] for x in w),
                                       "close": 2 * sum(x["iterations"] for x in w)},
                }

                # 4. in-kernel cost per program run (kernel.bpf_stats_enabled on: it adds
                #    two clock reads per run, so these are upper bounds)
                cost = {}
                for label, watch in (("filtering_non_target", {"fb_nobody"}),
                                     ("watching_target", {"fb_target"})):
                    t.close()
                    bpf_stats(True)
                    t.start()
                    run_rtt(nets, rtt_n, t, watch=watch)
                    progs = {}
                    # the cgroup programs (UDP, issue 17) too: the egress one runs for every
                    # packet any local socket sends, so its cost per TCP packet is what all
                    # traffic pays for it
                    for fn, tp in (*t.PROGRAMS, *((fn, f"cgroup:{fn}") for fn, *_ in t.CGROUP_PROGRAMS)):
                        f = t._bpf.funcs.get(fn.encode())
                        info = prog_info(f.fd) if f is not None else {}
                        if info.get("run_cnt"):
                            progs[tp] = {"runs": info["run_cnt"], "unit": "ns",
                                         "ns_per_run": round(info["run_time_ns"] / info["run_cnt"], 1)}
                    cost[label] = progs
                    bpf_stats(False)
                result["bpf_program_cost"] = cost
                result["tracer_stats"] = {k: v for k, v in t.stats().items() if k != "programs"}
            finally:
                t.close()
    finally:
        if old_stats in ("0", "1"):
            bpf_stats(old_stats == "1")
    result["loadavg_after"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    brief = {k: result[k] for k in ("event_latency", "sustained_paced", "sustained_max_rate",
                                     "bpf_program_cost")}
    brief["round_trip"] = {k: {kk: vv for kk, vv in v.items() if kk != "rounds"}
                           for k, v in result["round_trip"].items()}
    print(json.dumps(brief, indent=2))
    print(f"written: {args.out}")
    return 0


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def report_section(R: ResultIndex) -> str:
    plt = pyplot()
    out = [R.provenance("tracer", "tracer") + "\n"]
    t = R.get("tracer")
    if not t or "round_trip" not in t:
        return "\n".join(out)
    rt = t["round_trip"]
    labels = {"no_tracer": "no tracer", "tracer_filtering_non_target": "tracer, another process watched",
              "tracer_watching_target": "tracer watching the looping process"}
    rows = [[labels.get(k, k), num(v["p50_median_of_rounds"], "us"), num(v["p99_median_of_rounds"], "us"),
             num(v["iterations_per_s_median"], "/s", 0), pct_text((v.get("p50_vs_no_tracer_pct") or 0) / 100)]
            for k, v in rt.items()]
    out.append("connect() + accept() + close() of both ends over loopback (median of rounds):\n")
    out.append(table(["", "p50", "p99", "iterations/s", "p50 vs no tracer"], rows))
    el = t.get("event_latency", {})
    if el:
        out.append(table(["event latency (return of the call to the event out of poll())", "p50", "p90", "p99", "max"],
                         [[k, *(num(g(v, "return_to_poll", p), "us") for p in ("p50", "p90", "p99", "max"))]
                          for k, v in el.items()]))
    sp = t.get("sustained_paced") or []
    if sp:
        out.append(table(["offered flows/s", "achieved", "events lost"],
                         [[x["offered_flows_per_s"], x["achieved_flows_per_s"], x["lost"]] for x in sp]))
    cost = t.get("bpf_program_cost") or {}
    if cost:
        progs = sorted({p for v in cost.values() for p in v})
        out.append("In-kernel cost per program run over the same loop (kernel.bpf_stats_enabled, which "
                   "adds two clock reads per run: upper bounds). `cgroup:ft_udp_egress` runs for every "
                   "packet any local socket sends (here the loop's TCP packets): what all traffic pays "
                   "for following connected UDP sockets.\n")
        out.append(table(["program", *cost.keys()],
                         [[p, *(num(g(cost, k, p, "ns_per_run"), "ns") for k in cost)] for p in progs]))
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ks = list(rt)
    ax.barh([labels.get(k, k) for k in ks], [rt[k]["p50_median_of_rounds"] for k in ks], color="C0", label="p50")
    ax.set_xlabel("us per connect+accept+close round trip (p50)")
    out.append(savefig(fig, "tracer_roundtrip.png"))
    return "\n".join(out)


def report_goals() -> List[Goal]:
    return [
        Goal(9, 3, "connect+accept latency with / without the tracer (report)", "tracer", "tracer",
             lambda R: (g(R.get("tracer"), "round_trip", "no_tracer", "p50_median_of_rounds"),
                        g(R.get("tracer"), "round_trip", "tracer_watching_target", "p50_median_of_rounds")),
             None, lambda v: f"p50 {num(v[0], 'us')} without, {num(v[1], 'us')} with (watched)"),
    ]


if __name__ == "__main__":
    sys.exit(main())
