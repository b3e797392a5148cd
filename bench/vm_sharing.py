"""Link sharing under oversubscription (issue 6, after the seed's 002 figure 3).

Five TCP flows whose classes have the rates 4, 4, 4, 2, 2 units on a link of 10 units start
``--spacing`` seconds apart (the seed: 10 s) and run together for ``--hold`` seconds after the last
start. Each flow's rate is taken from a capture at the receiver (frame bytes per ``--bin`` s). The
ideal rate of a flow while k flows run is its class rate scaled by min(1, link / sum of the running
rates): with all five, 2:2:2:1:1 of the link (2.5, 2.5, 2.5, 1.25, 1.25 units). The error of a
phase is each running flow's measured / ideal - 1, taken after a settling time.

* ``psp`` (in the VM): the qdisc with link rate 10 units, one class per flow (the daemon's layout);
* ``htb`` (in the VM, and on the host): flowpacer's htb layout, a link class of 10 units and the
  flow classes under it at their rates (ceil = rate, flowpacer's burst and quantum).

One VM boot runs both qdiscs with the same traffic. The host run (htb only: the host kernel has no
psp) uses the same code. A unit is ``--unit-mbit`` Mbit/s (1: a 10 Mbit/s link).

The VM helpers here (build the psp module for the guest's kernel, run a module in the guest, the
testbed adapter, qdisc set-ups) are shared with ``bench.vm_lfp``.

Writes bench/results/vm_sharing.json. Run: ``.venv/bin/python -m bench.vm_sharing [--quick]``
(``--no-vm`` / ``--no-host`` leave a part out).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from harness import pacing  # noqa: E402  (capture, analysis, iperf3, sh in the guest)
from .reportkit import ResultIndex, num, pyplot, savefig, share, table  # noqa: E402

KMOD_SOURCES = ("Kbuild", "Makefile", "sch_psp.c", "psp_compat.h", "psp_sched.h", "psp_tree.h", "uapi")

log = logging.getLogger("bench.vm_sharing")

RATES_UNITS = (4, 4, 4, 2, 2)
LINK_UNITS = 10
BASE_PORT = 5201


# ============================================================== host side: the VM

def vm_unavailable() -> Optional[str]:
    """Why the VM cannot run here (None: it can)."""
    if os.environ.get("FLOWPACER_IN_VM"):
        return "already inside the VM"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed"
    try:
        from vm import build as vmbuild
        vmbuild.find_kernel()
    except Exception as e:          # BuildError, missing files
        return f"no guest kernel: {e}"
    return None


def build_psp_for_guest() -> Path:
    """sch_psp.ko built against the guest's kernel, from a copy of flowpacer/kernel/kmod (cached in /tmp
    by the sources' hash, so a repeated run does not rebuild)."""
    from vm import build as vmbuild
    kver = vmbuild.find_kernel().version
    src = REPO / "flowpacer" / "kernel" / "kmod"
    h = hashlib.sha256(kver.encode())
    for name in KMOD_SOURCES:
        p = src / name
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(str(f.relative_to(src)).encode())
                h.update(f.read_bytes())
    dest = Path(tempfile.gettempdir()) / f"flowpacer-bench-kmod-{h.hexdigest()[:16]}"
    ko = dest / "sch_psp.ko"
    if ko.is_file():
        return ko
    tmp = Path(tempfile.mkdtemp(prefix="flowpacer-bench-kmod-build-"))
    for name in KMOD_SOURCES:
        if (src / name).is_dir():
            shutil.copytree(src / name, tmp / name)
        else:
            shutil.copy2(src / name, tmp / name)
    proc = subprocess.run(["make", "-C", str(tmp), f"KVER={kver}"], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 or not (tmp / "sch_psp.ko").is_file():
        raise RuntimeError(f"building sch_psp.ko for {kver} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    try:
        tmp.rename(dest)
    except OSError:                 # another run built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return ko


def run_guest(module: str, guest_args: Sequence[str], timeout: float, clock: str = "virtual") -> dict:
    """Boot the VM, run ``python -m MODULE --guest --out FILE ARGS`` there, return its JSON
    (plus boot facts). Pacing benchmarks run in the VM's virtual time (``clock``, see
    vm/README.md): exact guest time, whatever the host's load. Raises RuntimeError with the
    reason when the run failed."""
    from vm import run as vmrun
    from harness.xmitstamp import XmitStampError, build_object
    ko = build_psp_for_guest()
    try:        # the departure capture's object (--capture bpf), so the guest never runs clang
        build_object()
    except XmitStampError as e:
        raise RuntimeError(str(e)) from None
    out = Path(tempfile.mkdtemp(prefix="fpbench-vm-"))
    result = out / "result.json"
    cmd = [sys.executable, "-m", module, "--guest", "--out", str(result), *guest_args]
    t0 = time.monotonic()
    try:
        r = vmrun.run(cmd, cwd=str(REPO), timeout=timeout, env={"FLOWPACER_PSP_KO": str(ko)},
                      clock=clock,
                      out_dir=out, on_output=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    except vmrun.VMError as e:
        raise RuntimeError(e.details(40)) from None
    partial = Path(str(result) + ".partial")
    if r.rc != 0 or not result.is_file():
        why = (f"the guest run exited {r.rc}{' (timeout)' if r.timed_out else ''}:\n"
               + "\n".join(r.output.rstrip().splitlines()[-30:]))
        if not partial.is_file():
            raise RuntimeError(why)
        # what the guest finished before it was cut off (``guest_progress``), marked as such
        doc = json.loads(partial.read_text())
        doc["incomplete"] = why[-2000:]
    else:
        doc = json.loads(result.read_text())
    doc["vm"] = {"boot_s": round(r.boot_s, 1), "wall_s": round(time.monotonic() - t0, 1),
                 "dmesg_problems": r.dmesg_problems()[:20], "kernel": doc.get("guest_kernel"),
                 "clock": r.clock.value}
    shutil.rmtree(out, ignore_errors=True)
    return doc


# ============================================================== both sides: testbed and qdiscs

def guest_result(out: str, **doc) -> int:
    """The guest side's end: ``doc`` (+ the guest's kernel) as JSON into ``out``."""
    Path(out).write_text(json.dumps({"guest_kernel": os.uname().release, **doc}))
    return 0


def guest_progress(out: str, **doc) -> None:
    """The guest side's results so far (``run_guest`` keeps them, marked incomplete, when the
    run is cut off before ``guest_result``)."""
    tmp = Path(out + ".partial.tmp")
    tmp.write_text(json.dumps({"guest_kernel": os.uname().release, **doc}))
    tmp.replace(out + ".partial")


def vm_bench(fig: dict, module: str, guest_args: Sequence[str], budget: float, keys=("runs",),
             clock: str = "virtual") -> int:
    """The host side of a one-boot VM benchmark: ``run_guest`` and ``keys`` of its result into
    ``fig`` (with ``vm``: boot facts), or why not (``unavailable``: exit 3, ``failed``: exit 1)."""
    why = vm_unavailable()
    if why:
        fig["unavailable"] = why
        return 3
    # the budget is host time: a loaded host runs the guest's (virtual) time slower
    budget *= float(os.environ.get("FLOWPACER_VM_BUDGET_SCALE", "1"))
    try:
        doc = run_guest(module, guest_args, budget, clock=clock)
    except RuntimeError as e:
        fig["failed"] = str(e)[-4000:]
        return 1
    fig["vm"] = doc["vm"]
    fig.update({k: doc[k] for k in keys if k in doc})
    if doc.get("incomplete"):
        fig["incomplete"] = doc["incomplete"]
        return 1
    return 0


def mbit(x: float) -> int:
    return int(round(x * 1e6 / 8))


class Bed:
    """harness.testbed.Testbed seen through harness/pacing.py's names: the server's
    namespace sends (its veth gets the qdisc under test), the client's receives."""

    def __init__(self, tb):
        self._sh = pacing.sh
        self.tb = tb
        self.sender_ns, self.receiver_ns = tb.server_ns, tb.client_ns
        self.sender_dev, self.receiver_dev = tb.server_if, tb.client_if
        self.sender_addr, self.receiver_addr = str(tb.server_v4), str(tb.client_v4)
        pacing.modprobe("veth")
        pacing.wait_for(lambda: "LOWER_UP" in self.s("ip", "-o", "link", "show", self.sender_dev).stdout,
                        10, "veth carrier")

    def s(self, *args, **kw):
        return self._sh(args, self.sender_ns, **kw)

    def r(self, *args, **kw):
        return self._sh(args, self.receiver_ns, **kw)

    def popen(self, ns, args, **kw):
        return self.tb.popen(ns, [str(a) for a in args], **kw)

    def set_gso(self, on: bool) -> None:
        state = "on" if on else "off"
        self.s("ethtool", "-K", self.sender_dev, "tso", state, "gso", state)
        self.s("ip", "link", "set", self.sender_dev, "gso_max_segs", "65535" if on else "1")

    def clear_qdisc(self) -> None:
        self.s("tc", "qdisc", "del", "dev", self.sender_dev, "root", check=False)


def setup_psp(bed: Bed, link_bps: int, classes: Sequence[tuple]) -> None:
    """psp root f1f0: (link rate ``link_bps``), one class per (minor, rate_bps, dport)."""
    from harness import psplib
    psplib.ensure_loaded()
    bed.clear_qdisc()
    with psplib.PspNl(bed.sender_ns) as nl:
        nl.add_qdisc(bed.sender_dev, link_rate_bps=link_bps)
        for minor, rate, _port in classes:
            nl.add_class(bed.sender_dev, minor, rate)
    for minor, _rate, port in classes:
        bed.s("tc", "filter", "add", "dev", bed.sender_dev, "parent", "f1f0:", "protocol", "ip",
              "prio", "1", "u32", "match", "ip", "dport", str(port), "0xffff", "flowid", f"f1f0:{minor:x}")


def setup_htb(bed: Bed, link_bps: int, classes: Sequence[tuple]) -> None:
    """flowpacer's htb layout: root f1f0:, link class :1, default :2, flow classes under :1 at
    their rate (ceil = rate) with flowpacer's burst and quantum."""
    from flowpacer.kernel.backend.htb import DEFAULT_SHARE, burst_for, quantum_for
    pacing.modprobe("sch_htb", "cls_u32")
    bed.clear_qdisc()

    def cls(parent, minor, rate, ceil, prio=0):
        bed.s("tc", "class", "add", "dev", bed.sender_dev, "parent", parent, "classid", f"f1f0:{minor:x}",
              "htb", "rate", f"{rate * 8}bit", "ceil", f"{ceil * 8}bit", "burst", str(burst_for(rate)),
              "cburst", str(burst_for(ceil)), "quantum", str(quantum_for(rate)), "prio", str(prio))
    bed.s("tc", "qdisc", "add", "dev", bed.sender_dev, "root", "handle", "f1f0:", "htb", "default", "2")
    cls("f1f0:", 1, link_bps, link_bps)
    cls("f1f0:1", 2, max(1000, int(link_bps * DEFAULT_SHARE)), link_bps, 1)
    for minor, rate, port in classes:
        cls("f1f0:1", minor, rate, rate)
        bed.s("tc", "filter", "add", "dev", bed.sender_dev, "parent", "f1f0:", "protocol", "ip",
              "prio", "1", "u32", "match", "ip", "dport", str(port), "0xffff", "flowid", f"f1f0:{minor:x}")


def psp_stats(bed: Bed) -> dict:
    """The psp qdisc's and classes' counters (JSON-safe)."""
    from harness import psplib

    def safe(x):
        if isinstance(x, dict):
            return {str(k): safe(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [safe(v) for v in x]
        return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)
    with psplib.PspNl(bed.sender_ns) as nl:
        root = nl.root(bed.sender_dev)
        classes = nl.classes(bed.sender_dev)
    return {"qdisc": safe(root.xstats) if root else None,
            "classes": {f"{m:x}": {"stats": safe(c.stats), "xstats": safe(c.xstats)}
                        for m, c in sorted(classes.items())}}


def wait_listening(bed: Bed, ports: Sequence[int], timeout: float = 20) -> None:

    def ok():
        out = bed.r("ss", "-Hltn").stdout
        return all(f":{p} " in out for p in ports)
    pacing.wait_for(ok, timeout, "iperf3 servers to listen")


# ============================================================== the sharing run

def frame_bytes(pk) -> int:
    return sum(w[1] for w in pk.wire())


def sharing_run(bed: Bed, qdisc: str, unit_bps: int, spacing: int, hold: int, bin_s: float,
                settle: float) -> dict:
    n = len(RATES_UNITS)
    ports = [BASE_PORT + i for i in range(n)]
    rates = [r * unit_bps for r in RATES_UNITS]
    link = LINK_UNITS * unit_bps
    classes = [(0x10 + i, rates[i], ports[i]) for i in range(n)]
    bed.set_gso(True)
    if qdisc == "psp":
        setup_psp(bed, link, classes)
    else:
        setup_htb(bed, link, classes)
    total = (n - 1) * spacing + hold
    servers = [bed.popen(bed.receiver_ns, ["iperf3", "-s", "-1", "-B", bed.receiver_addr, "-p", p])
               for p in ports]
    wait_listening(bed, ports)
    clients = []
    reports = []
    # tcpdump keeps up at 1 Gbit/s in the guest where the Python capture does not
    cap_cls = pacing.PcapCapture if link > pacing.mbit(100) else pacing.Capture
    with cap_cls(bed.receiver_ns, bed.receiver_dev, ports, outgoing=False) as cap:
        t0 = time.time_ns()
        m0 = time.monotonic()
        starts = []
        for i, p in enumerate(ports):
            delay = m0 + i * spacing - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            starts.append((time.time_ns() - t0) / 1e9)
            clients.append(bed.popen(bed.sender_ns, ["iperf3", "-c", bed.receiver_addr, "-p", p,
                                                     "-t", str(total - i * spacing), "-J"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for c in clients:
            out, err = c.communicate(timeout=total + 60)
            try:
                rep = json.loads(out)
                reports.append(rep["end"]["sum_received"]["bits_per_second"])
            except (ValueError, KeyError):
                reports.append(None)
        t_end = time.time_ns()
    for s in servers:
        try:
            s.wait(timeout=20)
        except subprocess.TimeoutExpired:
            s.kill()
    stats = psp_stats(bed) if qdisc == "psp" else None
    bed.clear_qdisc()
    # -- analysis
    bin_ns = int(bin_s * 1e9)
    nb = int((t_end - t0) // bin_ns) + 1
    per = {p: [0] * nb for p in ports}
    for pk in cap.packets:
        k = (pk.ts_ns - t0) // bin_ns
        if 0 <= k < nb and pk.dport in per:
            per[pk.dport][k] += frame_bytes(pk)
    series = {str(i + 1): [b * 8 / bin_s for b in per[p]] for i, p in enumerate(ports)}

    def window_rate(port, a_s, b_s):
        a, b = t0 + int(a_s * 1e9), t0 + int(b_s * 1e9)
        got = sum(frame_bytes(pk) for pk in cap.packets if pk.dport == port and a <= pk.ts_ns < b)
        return got * 8 / (b_s - a_s)

    phases = []
    end_s = (t_end - t0) / 1e9
    for k in range(1, n + 1):
        a = starts[k - 1] + settle
        b = (starts[k] if k < n else min(end_s, starts[0] + total)) - 0.5
        if b - a < 1.0:
            continue
        running = sum(rates[:k])
        scale = min(1.0, link / running)
        flows = []
        for i in range(k):
            got = window_rate(ports[i], a, b)
            ideal = rates[i] * 8 * scale
            flows.append({"flow": i + 1, "class_rate_bit_s": rates[i] * 8, "ideal_bit_s": ideal,
                          "measured_bit_s": got, "error": got / ideal - 1})
        tot = sum(f["measured_bit_s"] for f in flows)
        ideal_shares = [rates[i] / running for i in range(k)]
        share_err = [(f["measured_bit_s"] / tot) / s - 1 if tot else None
                     for f, s in zip(flows, ideal_shares)]
        phases.append({"flows_running": k, "window_s": [round(a, 2), round(b, 2)], "flows": flows,
                       "total_bit_s": tot, "link_bit_s": link * 8,
                       "max_abs_error": max(abs(f["error"]) for f in flows),
                       "mean_abs_error": sum(abs(f["error"]) for f in flows) / k,
                       "share_error": share_err,
                       "max_abs_share_error": max(abs(x) for x in share_err if x is not None) if tot else None})
    return {"qdisc": qdisc, "unit_bit_s": unit_bps * 8, "link_bit_s": link * 8,
            "class_rates_bit_s": [r * 8 for r in rates], "spacing_s": spacing, "hold_s": hold,
            "starts_s": [round(s, 3) for s in starts], "bin_s": bin_s,
            "t_s": [round((i + 0.5) * bin_s, 3) for i in range(nb)], "rate_bit_s": series,
            "phases": phases, "all_running": phases[-1] if phases and phases[-1]["flows_running"] == n else None,
            "iperf_receiver_bit_s": reports, "capture_drops": cap.drops,
            "packets_captured": len(cap.packets), "psp_stats": stats}


def run_sharing(qdiscs: Sequence[str], unit_mbit: float, spacing: int, hold: int, bin_s: float,
                settle: float, tag: str) -> Dict[str, dict]:
    from harness.testbed import Testbed
    out = {}
    with Testbed(tag=tag) as tb:
        bed = Bed(tb)
        for q in qdiscs:
            log.info("sharing: %s, unit %g Mbit/s, spacing %d s, hold %d s", q, unit_mbit, spacing, hold)
            out[q] = sharing_run(bed, q, mbit(unit_mbit), spacing, hold, bin_s, settle)
            ar = out[q]["all_running"]
            if ar:
                log.info("  all five: %s Mbit/s, max error %.1f %%",
                         [round(f["measured_bit_s"] / 1e6, 2) for f in ar["flows"]], 100 * ar["max_abs_error"])
    return out


# ============================================================== entry points

def params(args) -> dict:
    spacing = args.spacing if args.spacing is not None else (3 if args.quick else 10)
    hold = args.hold if args.hold is not None else 2 * spacing
    return {"unit_mbit": args.unit_mbit, "spacing_s": spacing, "hold_s": hold, "bin_s": args.bin,
            "settle_s": min(2.0, spacing / 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 s spacing (a smoke run)")
    ap.add_argument("--spacing", type=int, default=None, help="seconds between flow starts (10; quick 3)")
    ap.add_argument("--hold", type=int, default=None, help="seconds all run after the last start (2x spacing)")
    ap.add_argument("--unit-mbit", type=float, default=1.0, help="Mbit/s per unit (link = 10 units)")
    ap.add_argument("--bin", type=float, default=0.5, help="seconds per rate sample")
    ap.add_argument("--no-vm", action="store_true", help="host (htb) part only")
    ap.add_argument("--no-host", action="store_true", help="VM part only")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--qdiscs", default="psp,htb", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = params(args)
    if args.guest:
        runs = run_sharing(args.qdiscs.split(","), p["unit_mbit"], p["spacing_s"], p["hold_s"],
                           p["bin_s"], p["settle_s"], "vsh")
        Path(args.out).write_text(json.dumps({"guest_kernel": os.uname().release, "runs": runs}))
        return 0
    if os.geteuid() != 0:
        print("vm_sharing: needs root", file=sys.stderr)
        return 2
    from .common import write
    t0 = time.monotonic()
    fig = {"setup": {**p, "rates_units": list(RATES_UNITS), "link_units": LINK_UNITS,
                     "ideal_all_running": "2:2:2:1:1 of the link",
                     "measured": "receiver capture, frame bytes (L2, no FCS) per bin",
                     "gso": "on", "seed": "002 figure 3 (10 s spacing, 4,4,4,2,2 on 10)"}}
    rc = 0
    if not args.no_host:
        fig["host"] = {"kernel": os.uname().release,
                       "runs": run_sharing(["htb"], p["unit_mbit"], p["spacing_s"], p["hold_s"],
                                           p["bin_s"], p["settle_s"], "bsh")}
    if not args.no_vm:
        why = vm_unavailable()
        if why:
            fig["vm"] = {"unavailable": why}
            rc = 3
        else:
            budget = (2 * (4 * p["spacing_s"] + p["hold_s"]) + 240) \
                * float(os.environ.get("FLOWPACER_VM_BUDGET_SCALE", "1"))   # host time: see vm_bench
            try:
                doc = run_guest("bench.vm_sharing", ["--unit-mbit", str(p["unit_mbit"]), "--spacing",
                                                     str(p["spacing_s"]), "--hold", str(p["hold_s"]),
                                                     "--bin", str(p["bin_s"])], budget)
                fig["vm"] = {**doc["vm"], "runs": doc["runs"]}
            except RuntimeError as e:
                fig["vm"] = {"failed": str(e)[-4000:]}
                rc = 1
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    goals = {}
    for where in ("vm", "host"):
        for q, r in (fig.get(where) or {}).get("runs", {}).items():
            if r.get("all_running"):
                goals[f"{where}_{q}_max_error_all_running"] = round(r["all_running"]["max_abs_error"], 4)
    path = write("vm_sharing", fig, goals)
    print(f"wrote {path}", file=sys.stderr)
    return rc


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

# chapter 2's heading of this part when vm_share_pktgen's comes first
HEADING = "### TCP flows started one after another (`bench/vm_sharing.py`)\n"


def report_section(R: ResultIndex) -> str:
    plt = pyplot()
    out = [R.provenance("vm_sharing", "vm_sharing") + "\n"]
    f = R.fig("vm_sharing")
    if not f:
        return "\n".join(out)
    s = f.get("setup", {})
    out.append(f"Five TCP flows with class rates 4, 4, 4, 2, 2 units on a link of 10 units "
               f"(1 unit = {s.get('unit_mbit', '?')} Mbit/s), started {s.get('spacing_s', '?')} s apart "
               f"(the seed: 10 s), all running for {s.get('hold_s', '?')} s after the last start; rate per "
               f"{s.get('bin_s', '?')} s from a capture at the receiver. Ideal with all five running: 2:2:2:1:1 "
               f"of the link. The error is measured/ideal − 1 per running flow, after {num(s.get('settle_s'), '', 1)} s "
               f"of settling.\n")
    runs = []
    if "vm" not in f:
        out.append("**The VM part (psp and htb in the VM) is not in this result**: it was run with `--no-vm`.\n")
    for where in ("vm", "host"):
        part = f.get(where) or {}
        if part.get("unavailable") or part.get("failed"):
            out.append(f"**{where.upper()} part could not run:** {(part.get('unavailable') or part.get('failed'))[-400:]}\n")
        for q, r in (part.get("runs") or {}).items():
            runs.append((f"{q} ({'VM, 6.1' if where == 'vm' else 'host'})", r))
    if not runs:
        return "\n".join(out)
    rows = []
    for label, r in runs:
        for ph in r["phases"]:
            rows.append([label, ph["flows_running"],
                         " / ".join(f"{x['measured_bit_s'] / 1e6:.2f}" for x in ph["flows"]),
                         " / ".join(f"{x['ideal_bit_s'] / 1e6:.2f}" for x in ph["flows"]),
                         f"{ph['total_bit_s'] / 1e6:.2f} of {ph['link_bit_s'] / 1e6:.0f}",
                         share(ph["max_abs_error"]), share(ph.get("max_abs_share_error"))])
    out.append(table(["qdisc", "flows running", "measured Mbit/s", "ideal Mbit/s", "total Mbit/s",
                      "max rate error", "max share error"], rows))
    over = [(label, r["all_running"]["total_bit_s"] / r["all_running"]["link_bit_s"]) for label, r in runs
            if r.get("all_running") and r["all_running"]["total_bit_s"] > 1.05 * r["all_running"]["link_bit_s"]]
    if over:
        who = "; ".join(f"{label}: {x:.2f}x the link" for label, x in over)
        out.append(f"The flows together send more than the link ({who}). htb's link class does not cap its "
                   "children's guaranteed rates: every flow class keeps its own rate whatever the sum, so the "
                   "rates stay 2:2:2:1:1 among themselves (the share error) but the link is oversubscribed by "
                   "the sum; on a real link of 10 units the device queue, not htb, would decide who gets what. "
                   "psp scales every backlogged class by link / sum.\n")
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.0 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, r) in zip(axes[:, 0], runs):
        t = r["t_s"]
        for i, (k, ys) in enumerate(sorted(r["rate_bit_s"].items())):
            ax.plot(t, [y / 1e6 for y in ys], lw=1.2, label=f"flow {k} ({r['class_rates_bit_s'][i] / 1e6:g})")
        tot = [sum(v[j] for v in r["rate_bit_s"].values()) / 1e6 for j in range(len(t))]
        ax.plot(t, tot, color="k", lw=0.8, alpha=0.5, label="total")
        ax.axhline(r["link_bit_s"] / 1e6, color="k", ls=":", lw=0.8)
        for ph in r["phases"]:
            a, b = ph["window_s"]
            for x in ph["flows"]:
                ax.hlines(x["ideal_bit_s"] / 1e6, a, b, colors="k", linestyles="--", lw=0.7)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("Mbit/s")
    axes[0][0].legend(fontsize=7, ncol=7, loc="upper left")
    axes[-1][0].set_xlabel("time (s); dashed: ideal share, dotted: the link")
    out.append(savefig(fig, "sharing_rates.png"))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
