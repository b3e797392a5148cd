"""The benchmarks of the suite: name, module, result file, arguments and a full run's duration.

bench/run.py runs them; bench/report.py lists them in the report's table of runs. Both import
this module and neither imports the other.
"""
from __future__ import annotations

import dataclasses
from typing import List


@dataclasses.dataclass
class Bench:
    name: str
    module: str
    result: str                   # bench/results/<result>.json
    full: List[str]
    quick: List[str]
    est_s: int                    # a full run's duration here, seconds (for the time limit)
    vm: bool = False
    what: str = ""


BENCHES = [
    Bench("psp_sim", "bench.psp_sim", "psp_sim", [], ["--quick"], 60,
          what="psp scheduling core: ns per packet vs number of classes (userspace build)"),
    Bench("classify", "bench.classify_bench", "classify", [], ["--quick"], 300,
          what="one flow's throughput with 1 ... 10 000 u32 filters, hashed vs linear"),
    Bench("backend", "bench.backend_bench", "backend", ["--fresh", "install", "daemon", "daemon_mixed"],
          ["--fresh", "--quick", "install", "daemon", "daemon_mixed"], 360,
          what="install cost per flow; daemon RSS, status and scrape at 100 / 1 000 / 10 000 flows, "
               "IPv4 only and half IPv6"),
    Bench("daemon", "bench.daemon_bench", "daemon", ["--fresh"], ["--fresh", "--quick"], 300,
          what="time-to-shape, churn ceiling (IPv4 only and half IPv6), unshaped bytes per flow"),
    Bench("burst", "bench.burst_bench", "burst", ["--label", "after"], ["--label", "after", "--quick"], 420,
          what="issue 26: N = 100 ... 10 000 connections at once -> time until the last class is in, "
               "daemon CPU per flow (IPv4 only and IPv4/IPv6/IPv4-mapped); churn ceiling to 8 000/s"),
    Bench("crowd", "bench.crowd_bench", "crowd", [], ["--quick"], 600,
          what="issue 26: flash crowds of 100 ... 10 000 h2load clients against nginx (IPv4, and "
               "IPv4 + IPv6) -> share of replies shaped from the first byte, pool/stopgap/missed"),
    Bench("tracer", "bench.tracer_overhead", "tracer", [], ["--quick"], 150,
          what="eBPF tracer: event latency, connect+accept with and without it"),
    Bench("reliability", "bench.reliability", "reliability", [], ["--cycles", "10000"], 200,
          what="crash recovery, churn soak (RSS, fds, kernel objects)"),
    Bench("vm_pacing", "bench.vm_pacing", "vm_pacing", [], ["--quick", "--reps", "1"], 600, vm=True,
          what="issue 4's pacing figures in the VM (bench/vm_pacing.py): rate error, gaps at 2 and 10 Mbit"),
    Bench("vm_gaps", "bench.vm_gaps", "vm_gaps", [], ["--quick"], 900, vm=True,
          what="pacing precision in the VM: psp vs htb vs tbf vs fq, rate error and inter-packet gaps"),
    Bench("vm_sharing", "bench.vm_sharing", "vm_sharing", [], ["--quick"], 400, vm=True,
          what="5 flows at 4,4,4,2,2 on a link of 10: psp and htb in the VM, htb on the host"),
    Bench("vm_lfp", "bench.vm_lfp", "vm_lfp", [], ["--quick"], 750, vm=True,
          what="TCP over a long fat pipe with a small buffer: psp vs htb vs unpaced"),
    Bench("vm_gaps_pktgen", "bench.vm_gaps", "vm_gaps_pktgen",
          ["--source", "pktgen", "--capture", "bpf", "--rates", "100,1000,2500", "--gso", "on", "--seconds", "2"],
          ["--source", "pktgen", "--capture", "bpf", "--rates", "100,1000", "--gso", "on", "--seconds", "2"],
          1500, vm=True, what="pktgen through psp, htb, tbf and fq in the VM, gaps stamped by a BPF tracepoint"),
    Bench("vm_gaps_pktgen_sat", "bench.vm_gaps", "vm_gaps_pktgen_sat",
          ["--source", "pktgen", "--capture", "pcap", "--rates", "2500", "--gso", "on", "--seconds", "2",
           "--name", "vm_gaps_pktgen_sat"],
          ["--source", "pktgen", "--capture", "pcap", "--rates", "2500", "--gso", "on", "--seconds", "2",
           "--name", "vm_gaps_pktgen_sat"], 900, vm=True,
          what="pktgen at 2.5 Gbit/s through each qdisc: every one CPU-bound, the carried rate is the "
               "whole path's CPU per packet"),
    Bench("vm_share_pktgen", "bench.vm_share_pktgen", "vm_share_pktgen", [], [], 600, vm=True,
          what="4,4,4,2,2 on a 1 Gbit/s link, five classes offered the same load by pktgen: psp and htb"),
    Bench("vm_share_pktgen_jumbo", "bench.vm_share_pktgen", "vm_share_pktgen_jumbo", ["--frame-bytes", "9014"],
          ["--frame-bytes", "9014"], 600, vm=True,
          what="the same with 9014-byte frames (veth MTU 9000): more bytes per packet pktgen can offer"),
    Bench("access", "bench.access_bench", "access", [], ["--quick"], 1800, vm=True,
          what="issue 30: 20 clients behind their own access links (shallow/deep queues, downloads and "
               "streams, household UDP flows): unshaped, fq CUBIC/BBR/max pacing rate, nginx limit_rate, "
               "flowpacer htb and psp (6.1)"),
    Bench("access_612", "bench.access_bench", "access_612", ["--kernel", "6.12", "--tag", "612"],
          ["--quick", "--kernel", "6.12", "--tag", "612"], 1800, vm=True,
          what="the same on Debian 13's 6.12 kernel"),
]
BY_NAME = {b.name: b for b in BENCHES}
ALIASES = {b.module.split(".", 1)[1]: b.name for b in BENCHES}   # classify_bench -> classify
