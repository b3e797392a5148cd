"""``make demo``: flowpacer shaping a delivery server's clients on a self-made testbed.

Two network namespaces joined by a veth pair; in the server namespace a small HTTP delivery
server (process name ``fp-demo-srv``) listens on ports 8081-8084 and ``flowpacer run`` shapes it
with ``rules/demo.yaml``; in the client namespace one client per port downloads for a fixed time.
The table compares each client's goodput with its rule's rate. Everything is removed at the end,
also on Ctrl-C.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flowpacer.policy import rules as rules_loader
from flowpacer.policy.engine import first_match
from flowpacer.model import Direction, Flow, FlowKey, ProcessInfo
from harness.testbed import Daemon, DaemonExited, Testbed, client_argv, server_argv
from flowpacer.units import format_bits

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "rules" / "demo.yaml"
PORTS = (8081, 8082, 8083, 8084)
SECONDS = 8.0
WIRE_SHARE = 1448 / 1514     # TCP payload per Ethernet frame (MSS 1448 with timestamps)


def out(msg: str = "") -> None:
    print(msg, flush=True)


def main() -> int:
    if os.geteuid() != 0:
        out("make demo needs root (it creates network namespaces)")
        return 1
    rs = rules_loader.load(str(RULES))
    out(f"flowpacer demo: rules {RULES.relative_to(ROOT)}")
    for line in rules_loader.describe(rs):
        out(f"  {line}")
    tmp = tempfile.mkdtemp(prefix="flowpacer-demo-")
    with Testbed(server_if=rs.interface, tag="demo", subnet=77) as tb:
        out(f"testbed: {tb.server_ns} ({tb.server_v4}, {tb.server_if}) <-> "
            f"{tb.client_ns} ({tb.client_v4})")
        tb.popen(tb.server_ns, server_argv(PORTS, "fp-demo-srv"))
        for p in PORTS:
            tb.wait_listening(p)
        daemon = Daemon(tb, tmp, rules_file=RULES, verbose=False)
        log_path = str(daemon.log)
        try:
            daemon.start(timeout=60)
        except DaemonExited as e:
            raise RuntimeError(f"flowpacer did not start; see {log_path}: {e}") from None
        st = daemon.status()
        out(f"daemon: backend {st['backend']} ({st['backend_reason']}); flows from {st['flow_source']}")
        out(f"{len(PORTS)} clients download for {SECONDS:.0f} s each, all at once ...")
        clients = [tb.popen(tb.client_ns, client_argv(str(tb.server_v4), p, SECONDS),
                            stdout=subprocess.PIPE, text=True) for p in PORTS]
        time.sleep(SECONDS / 2)
        mid = daemon.status()
        results = []
        for c in clients:
            o, _ = c.communicate(timeout=SECONDS + 30)
            results.append(json.loads(o.strip().splitlines()[-1]))
        out("")
        out(f"{'client':<8} {'port':>5}  {'rule':<10} {'rule rate':>26}  {'achieved':>14}  "
            f"{'of rate':>8}  class")
        classes = {f["remote"].rsplit(":", 1)[1]: f for f in mid["flows"]}
        for i, r in enumerate(results):
            flow = Flow(FlowKey(tb.server_v4, r["port"], tb.client_v4, r["local_port"]),
                        Direction.INBOUND, ProcessInfo(pid=1, comm="fp-demo-srv"))
            rule = first_match(rs.rules, flow)
            got = r["goodput_bps"]
            cls = classes.get(str(r["local_port"]), {}).get("classid", "-")
            if rule:
                cap = rule.ceil_bps or rule.rate_bps
                rate_txt = format_bits(rule.rate_bps) + (f" (ceil {format_bits(rule.ceil_bps)})"
                                                         if rule.ceil_bps else "")
                share = f"{100 * got / (cap * WIRE_SHARE):.1f}%"
                name = rule.name
            else:
                rate_txt, share, name = "unshaped", "-", "(none)"
            out(f"client{i + 1:<2} {r['port']:>5}  {name:<10} {rate_txt:>26}  "
                f"{format_bits(int(got)):>14}  {share:>8}  {cls}")
        out("")
        out(f"('of rate' = goodput / (rate x {WIRE_SHARE:.3f}): TCP payload per 1514-byte frame)")
        out(f"daemon log: {log_path}")
        daemon.stop()
    out("testbed removed.")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: testbed removed.", file=sys.stderr)
        sys.exit(130)
