"""Flash crowds, the share shaped from the first byte (issue 26, item 3's burst curve).

Real nginx (2 workers, IPv4 and IPv6 listeners) and h2load: N clients at once, one request
each for a 48 KiB object under the rule ``{process: nginx, direction: inbound}`` at 100 kbit/s a
flow (``harness.crowd``, as tests/test_flashcrowd.py). ``crowd`` is IPv4 only (one h2load of N
clients), ``crowd_mixed`` half IPv4 and half IPv6 (two h2loads started together). One daemon (the
default: tracer and first-byte programs, htb) through every size in turn, each step once the one
before it has left. Per step:

- *early*: replies that finished sooner than the rule's rate allows for the object less what a
  paced flow may send ahead of its rate line (htb's burst and TCP's first 10 unpaced segments,
  12 frames): heads left unpaced. ``1 - early/ok`` is the share shaped from the first byte;
- the first-byte counters' growth: *class* (a ready pool class claimed at the handshake),
  *stopgap* (the pool was dry: the socket's SO_MAX_PACING_RATE at the rule's rate until its class
  is in), *missed* (neither: unpaced until its class is in);
- when the classes are in is ``bench.burst_bench``'s measure (connections held open): here a
  netlink dump of the filters while thousands are made and deleted took longer than the crowd
  (a 10 000 mixed step saw 22-48 of the ~10 000 filters the daemon's log shows it made);
- the replies' time (median, and the fastest), the starts' spread, the load average.

GSO off on the server's veth, as in the test: htb judges a whole GSO packet by its class's
tokens, so with GSO a class that just came in lets one through on its burst (an overdraft the
class then pays back, which the early count would take for an unpaced head: measured 5 of 300
replies at 1.82 s of 2.22 allowed with GSO on).

A slow machine makes replies late, not early: *early* cannot be hidden by load, but with the
host saturated (the largest sizes on 2 CPUs) a reply's time says less; the counters are the
kernel's own account. Writes bench/results/crowd.json.
Run: ``.venv/bin/python -m bench.crowd_bench [--quick] [--sizes 100,1000] [part ...]``.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flowpacer.kernel.backend.htb import burst_for
from harness import crowd
from harness.daemon import Daemon
from harness.servers import Nginx
from harness.testbed import Testbed, sh, wait_for

from .common import RESULTS, parts_and_sizes, write
from .reportkit import ResultIndex, g, num, table

SIZES = (100, 500, 1000, 2000, 5000, 10_000)
QUICK_SIZES = (100, 1000)
PARTS = ("crowd", "crowd_mixed")
OBJECT = 48 << 10
RATE_BIT = 100_000
RATE_BPS = RATE_BIT // 8
MIN_S = crowd.min_reply_s(OBJECT, RATE_BPS, burst_for(RATE_BPS))
RULES = crowd.crowd_rules("htb", RATE_BIT)


def _tune(tb) -> None:
    for k, v in (("net.core.somaxconn", "65535"), ("net.ipv4.tcp_max_syn_backlog", "65535")):
        sh("ip", "netns", "exec", tb.server_ns, "sysctl", "-qw", f"{k}={v}")
    for k, v in (("net.ipv4.ip_local_port_range", "10000 65000"), ("net.ipv4.tcp_tw_reuse", "1")):
        sh("ip", "netns", "exec", tb.client_ns, "sysctl", "-qw", f"{k}={v}")


def crowd_curve(tb, sizes, mixed: bool, workdir: Path) -> dict:
    _tune(tb)
    # as the test: one frame is "a packet" (with GSO htb lets a whole GSO packet through on a
    # positive token count, which a class that just came in has: an overdraft, not a head)
    tb.set_gso(False)
    ng = Nginx(tb, workdir / "nginx", files={"obj": OBJECT}).start()
    (workdir / "d").mkdir()
    d = Daemon(tb, workdir / "d", RULES, "--rescan", "1", "--no-metrics",
               verbose=bool(os.environ.get("FP_CROWD_VERBOSE")))
    d.start(timeout=90)
    steps = []
    try:
        wait_for(lambda: any(p["ready"] > 0 for p in d.status()["first_byte"]["pools"]), 30,
                 0.05, "the pool made")
        hosts = (tb.server_v4, tb.server_v6) if mixed else (tb.server_v4,)
        for n in sizes:
            c0 = crowd.first_byte_counters(d)
            per = [n // len(hosts) + (1 if i < n % len(hosts) else 0) for i in range(len(hosts))]
            logdir = Path(tempfile.mkdtemp(prefix="fp-crowd-", dir=workdir))
            got = crowd.crowd(tb, hosts, ng.port, "/obj", per, logdir, timeout_s=150)
            delta = crowd.counted(d, c0, len(got.rows))
            ok = got.ok
            early = got.early(MIN_S)
            durs = sorted(r[2] / 1e6 for r in ok)
            step = {"flows": n, "requests": len(got.rows), "ok": len(ok), "early": len(early),
                    "shaped_share": 1 - len(early) / len(ok) if ok else None,
                    "fastest_s": early[:5], "median_s": statistics.median(durs) if durs else None,
                    "min_s_allowed": MIN_S, "starts_spread_ms": got.spread_ms,
                    "took_s": got.took_s,
                    **{f"fb_{k}": v for k, v in delta.items()},
                    "loadavg_1min": os.getloadavg()[0]}
            if len(ok) < n:
                step["client_output"] = [o[-800:] for o in got.outputs]
            steps.append(step)
            print(json.dumps(step), flush=True)
            # the next step starts once every flow of this one has left
            wait_for(lambda: d.status(timeout=60)["shaped_flows"] == 0, 120, 0.2,
                     "the crowd's flows gone")
        st = d.status()
        assert st["healthy"], st["stages"]
    finally:
        d.stop()
    return {"steps": steps, "mix": "ipv4 + ipv6" if mixed else "ipv4", "object_bytes": OBJECT,
            "rate_bit": RATE_BIT}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: both)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="")
    ap.add_argument("--workdir", default="", help="keep each part's files (the daemon's log, "
                    "h2load's) in a directory made under this one")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    names, sizes = parts_and_sizes(ap, args, PARTS, SIZES, QUICK_SIZES)
    prev = RESULTS / "crowd.json"
    figures = json.loads(prev.read_text()).get("figures", {}) if prev.exists() else {}
    figures["measured"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name in names:
        wd = Path(tempfile.mkdtemp(prefix=f"fp-crowdb-{name}-", dir=args.workdir or None))
        with Testbed(tag=f"cr{secrets.token_hex(2)}", subnet=200 + secrets.randbelow(20)) as tb:
            figures[name] = crowd_curve(tb, sizes, name.endswith("_mixed"), wd)
        if not args.workdir:
            shutil.rmtree(wd, ignore_errors=True)
    goals = {}
    for name in PARTS:
        for s in g(figures, name, "steps") or []:
            if s.get("ok"):
                goals[f"{name} {s['flows']}: >= 99.5 % shaped from the first byte"] = \
                    s["shaped_share"] >= 0.995
    write("crowd", figures, goals)
    print(json.dumps(goals, indent=2))
    return 0


# ============================================================== report

HEADING = "### Flash crowds: the share shaped from the first byte (`bench/crowd_bench.py`, issue 26)\n"


def report_section(R: ResultIndex) -> str:
    d = R.fig("crowd")
    if not d:
        return ""
    rows = []
    for name in PARTS:
        for s in g(d, name, "steps") or []:
            rows.append([g(d, name, "mix"), f"{s['flows']:,}".replace(",", " "),
                         f"{s['ok']} / {s['requests']}", str(s["early"]),
                         num(100 * s["shaped_share"], "%", 2) if s["shaped_share"] is not None
                         else "-",
                         f"{s['fb_claimed']} / {s['fb_stopgap']} / {s['fb_missed']}",
                         num(s["median_s"], "s", 2), num(s["starts_spread_ms"] / 1e3, "s", 2),
                         f"{s['loadavg_1min']:.1f}"])
    out = [HEADING, R.provenance("crowd", "crowd") + "\n",
           f"nginx (2 workers) and h2load, N clients at once, one {OBJECT >> 10} KiB reply each, "
           f"rule at {RATE_BIT // 1000} kbit/s a flow, the daemon as it runs by default (htb, "
           f"tracer and first-byte programs), one daemon through every size. *early*: replies "
           f"under {MIN_S:.2f} s, what the rate allows for the object less htb's burst and TCP's "
           f"first 10 unpaced segments: a head left unpaced. *pool / stopgap / missed*: the "
           f"first-byte counters' growth (a ready pool class claimed at the handshake; the pool "
           f"dry, the socket's maximum pacing rate set to the rule's until its class is in; "
           f"neither). When the classes are in: the burst curve above. GSO off on the server's veth, as in the "
           f"test (htb judges a whole GSO packet by its class's tokens). Replies are late, never "
           f"early, on a saturated machine, so *early* is not hidden by load; the counters are "
           f"the kernel's account.\n",
           table(["mix", "N", "ok", "early", "shaped from the first byte", "pool / stopgap / missed",
                  "median reply", "starts within", "load"], rows)]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
