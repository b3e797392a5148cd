"""What the kernel charges to make, change and delete one class as the qdisc fills (issue 26).

The kernel's RTM_NEWTCLASS for a new class (and RTM_DELTCLASS) ends in
``tc_bind_tclass()`` (net/sched/sch_api.c), which walks every class of the qdisc and asks the
qdisc for that class' filter block: a create costs O(classes already there) whatever the qdisc.
htb has a block per class; psp's ``psp_tcf_block()`` gives none for a class (filters attach to
the qdisc only), so its walk should be cheap per class but still linear. A change of an existing
class does not walk.

One VM boot (qemu TCG, ``--clock``, real time by default; vm/README.md): in the guest, on the
server veth of a ``harness.testbed.Testbed``, for each qdisc (psp, htb) flowpacer's own root
qdisc and skeleton (``TcBackend.setup``: the psp qdisc with its default class, or htb's link and
default classes, and the u32 hash tables), then for each step N (0, 2 000, 5 000, 10 000 flow
classes already there): the qdisc is grown to N flow classes (batches of ``--grow-batch``, not
timed), then one batch of ``--batch`` class creates (NLM_F_CREATE|NLM_F_EXCL, the codec's flow
class options, sent by ``RtnlSocket.transact`` over one socket) is timed, then a batch of as
many changes of those classes (another rate), then their deletes, ``--repeats`` times. Figures:
microseconds per request (a batch's wall time in the guest over its size; the median of the
repeats, every sample kept). The ratio cost(N) / cost(0) is what counts: TCG's absolute times are
far above a real CPU's. In virtual time (``--clock virtual``) a guest ns is one instruction, so
the figures there are instruction counts, repeatable to the last digit; in real time they vary by
up to 2x between boots. ``--profile``: at the largest step one more create and delete batch
under ``perf record -e cpu-clock`` of the guest process, the symbols with >= 1 % of the samples.

Measured 2026-11-29 (bench/results/vm_classcost.json: 6.1 real; _612: 6.12 real; _virtual: 6.1
virtual): create and delete grow linearly with N for both qdiscs, change stays flat. Virtual
time, per class already there: psp ~81 instructions, htb ~140; real time (TCG), psp ~0.12-0.19
us, htb 0.5-1.0 us (htb's per-class ``mutex_lock`` of its class' block, dear under TCG). psp's
walk is ``tc_bind_class_walker`` + ``psp_walk`` + ``psp_tcf_block``, whose extack message per
class also costs a ``do_trace_netlink_extack`` call (~4-7 % of the walk).

A step that would start after ``--qdisc-budget`` guest seconds is not run (``skipped``).

Writes bench/results/vm_classcost.json (``--name``: another name, e.g. vm_classcost_612 for
``FLOWPACER_VM_KERNEL=6.12``). Run: ``.venv/bin/python -m bench.vm_classcost [--quick]``.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.vm_sharing import guest_progress, guest_result, vm_bench  # noqa: E402

log = logging.getLogger("bench.vm_classcost")

QDISCS = ("psp", "htb")
STEPS = (0, 2000, 5000, 10000)
QUICK_STEPS = (0, 500, 1000)
LINK_BPS = 1_250_000_000          # bytes/s: 10 Gbit/s, the veth's
RATE_A = 125_000                  # 1 Mbit/s: the classes as made
RATE_B = 250_000                  # 2 Mbit/s: the change
TIMED_BASE = 0x8000               # minors of the timed classes (the grown ones start at 0x10)


def make_codec(qdisc: str):
    if qdisc == "psp":
        from flowpacer.kernel.backend.psp import PspCodec
        return PspCodec()
    from flowpacer.kernel.backend.htb import HtbCodec
    return HtbCodec()


def count_classes(chan) -> int:
    from flowpacer.kernel.backend.handles import MAJOR
    from flowpacer.kernel.tc import nl
    n = 0
    for mtype, body in chan.rtnl.dump(nl.RTM_GETTCLASS, nl.tcmsg(chan.ifindex)):
        obj = nl.parse_tcmsg(mtype, body)
        if obj.ifindex == chan.ifindex and obj.handle >> 16 == MAJOR:
            n += 1
    return n


def timed(chan, reqs) -> float:
    """Send ``reqs`` as one transact; microseconds per request. Any refusal is an error."""
    t0 = time.perf_counter()
    errs = chan.transact(reqs)
    dt = time.perf_counter() - t0
    bad = [e for e in errs if e is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(reqs)} refused, first: {bad[0]}")
    return dt * 1e6 / len(reqs)


def perf_profile(work) -> dict:
    """``work()`` under ``perf record`` of this process (cpu-clock samples, kernel and user),
    perf started disabled and enabled over its control FIFO just around ``work`` (its start-up
    under TCG takes seconds): the symbols with at least 1 % of the samples (self time)."""
    tmp = tempfile.mkdtemp(prefix="vm_classcost-perf-")
    data, ctl, ack = (os.path.join(tmp, x) for x in ("perf.data", "ctl", "ack"))
    os.mkfifo(ctl)
    os.mkfifo(ack)
    rec = subprocess.Popen(["perf", "record", "-q", "-D", "-1", "--control", f"fifo:{ctl},{ack}",
                            "-e", "cpu-clock", "-F", "4000", "-p", str(os.getpid()), "-o", data],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        cfd = os.open(ctl, os.O_WRONLY)          # blocks until perf opened its end
        afd = os.open(ack, os.O_RDONLY)
        os.write(cfd, b"enable\n")
        os.read(afd, 16)
        us = work()
        os.write(cfd, b"disable\n")
        os.read(afd, 16)
        os.close(cfd)
        os.close(afd)
    finally:
        rec.send_signal(signal.SIGINT)
        try:
            _, err = rec.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            rec.kill()
            rec.wait()
            err = "perf record did not stop"
    rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--sort",
                          "sym", "--percent-limit", "1"], capture_output=True, text=True,
                         timeout=120)
    shutil.rmtree(tmp, ignore_errors=True)
    top, samples = [], None
    for ln in rep.stdout.splitlines():
        m = re.match(r"#\s*Samples:\s*(\S+)", ln)
        if m:
            samples = m.group(1)
        m = re.match(r"\s*([\d.]+)%\s+\[(.)\]\s+(\S+)", ln)
        if m:
            top.append([float(m.group(1)), m.group(3)])
    out = {"us_per_request": round(us, 1), "samples": samples, "top": top[:20]}
    if not top:
        out["error"] = (err or "")[-500:] + rep.stderr[-500:]
    return out


def measure_qdisc(tb, qdisc: str, steps, batch: int, grow_batch: int, budget_s: float,
                  progress, repeats: int = 3, profile: bool = False) -> dict:
    """One qdisc's figures per step (``progress(partial)`` after each): the median of
    ``repeats`` create, change, delete rounds; with ``profile``, at the largest step one more
    create and delete batch under ``perf record``."""
    from flowpacer.model import Shape
    from flowpacer.kernel.backend.handles import FIRST_FLOW_MINOR, MAJOR
    from flowpacer.kernel.backend.tc import TcBackend
    from flowpacer.kernel.tc.nl import RtnlSocket, tc_handle
    from harness.testbed import in_netns
    codec = make_codec(qdisc)
    out = {"qdisc": qdisc, "steps": []}
    t_start = time.monotonic()
    with in_netns(tb.server_ns):
        be = TcBackend(codec, tb.server_if, link_rate_bps=LINK_BPS, rtnl=RtnlSocket())
        try:
            be.setup()
            chan = be.channel
            parent = chan.flow_parent
            opts_a = codec.flow_class_options(Shape("bench", RATE_A, RATE_A), LINK_BPS)
            opts_b = codec.flow_class_options(Shape("bench", RATE_B, RATE_B), LINK_BPS)
            base = count_classes(chan)          # skeleton: psp's default; htb's link + default
            out["skeleton_classes"] = base
            have = 0
            for n in steps:
                if time.monotonic() - t_start > budget_s:
                    out["steps"].append({"n": n, "skipped": f"past the {budget_s:g} s budget"})
                    continue
                t_grow = time.monotonic()
                while have < n:
                    k = min(grow_batch, n - have)
                    reqs = [chan.class_msg(FIRST_FLOW_MINOR + have + i, parent, opts_a, True,
                                           "grow") for i in range(k)]
                    errs = chan.transact(reqs)
                    bad = [e for e in errs if e is not None]
                    if bad:
                        raise RuntimeError(f"growing {qdisc} to {n}: {len(bad)} refused: {bad[0]}")
                    have += k
                grow_s = time.monotonic() - t_grow
                there = count_classes(chan) - base
                if there != n:
                    raise RuntimeError(f"{qdisc}: {there} flow classes, expected {n}")
                minors = range(TIMED_BASE, TIMED_BASE + batch)
                creates = [chan.class_msg(m, parent, opts_a, True, "create") for m in minors]
                changes = [chan.class_msg(m, parent, opts_b, False, "change") for m in minors]
                deletes = [chan.class_del(tc_handle(MAJOR, m), "delete") for m in minors]
                row = {"n": n, "grow_s": round(grow_s, 2)}
                samples = {"create": [], "change": [], "delete": []}
                for _ in range(repeats):
                    samples["create"].append(round(timed(chan, creates), 1))
                    samples["change"].append(round(timed(chan, changes), 1))
                    samples["delete"].append(round(timed(chan, deletes), 1))
                for k, v in samples.items():
                    row[f"{k}_us"] = statistics.median(v)
                    row[f"{k}_samples_us"] = v
                if profile and n == max(steps):
                    row["profile"] = {
                        "create": perf_profile(lambda: timed(chan, creates)),
                        "delete": perf_profile(lambda: timed(chan, deletes))}
                out["steps"].append(row)
                log.info("%s N=%5d: create %8.1f us, change %8.1f us, delete %8.1f us "
                         "(grown in %.1f s)", qdisc, n, row["create_us"], row["change_us"],
                         row["delete_us"], grow_s)
                progress(out)
        finally:
            be.teardown()
            be.close()
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    for r in out["steps"]:
        if "create_us" in r and out["steps"][0].get("create_us"):
            z = out["steps"][0]
            r["ratio"] = {k: round(r[f"{k}_us"] / z[f"{k}_us"], 2)
                          for k in ("create", "change", "delete")}
    return out


def guest_main(args) -> int:
    from harness import psplib
    from harness.testbed import Testbed, modprobe
    psplib.ensure_loaded()
    modprobe("sch_htb", "cls_u32")
    steps = [int(x) for x in args.steps.split(",")]
    runs = []
    with Testbed(tag="vcc") as tb:
        for q in args.qdiscs.split(","):
            def progress(partial, q=q):
                guest_progress(args.out, runs=runs + [partial])
            try:
                runs.append(measure_qdisc(tb, q, steps, args.batch, args.grow_batch,
                                          args.qdisc_budget, progress, args.repeats,
                                          args.profile))
            except Exception as e:          # one qdisc's failure must not lose the other's
                runs.append({"qdisc": q, "error": f"{type(e).__name__}: {e}"})
                log.info("%s: %s", q, runs[-1]["error"])
            guest_progress(args.out, runs=runs)
    return guest_result(args.out, runs=runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"steps {QUICK_STEPS}")
    ap.add_argument("--steps", default=None, help=f"classes already there, comma separated {STEPS}")
    ap.add_argument("--qdiscs", default=",".join(QDISCS))
    ap.add_argument("--batch", type=int, default=500, help="timed requests per kind and step")
    ap.add_argument("--grow-batch", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3,
                    help="create/change/delete rounds per step (the median is the figure)")
    ap.add_argument("--profile", action="store_true",
                    help="at the largest step, perf record one more create and delete batch")
    ap.add_argument("--qdisc-budget", type=float, default=900.0,
                    help="guest seconds per qdisc; later steps are skipped")
    ap.add_argument("--clock", choices=("virtual", "real"), default="real")
    ap.add_argument("--name", default="vm_classcost")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.steps is None:
        args.steps = ",".join(map(str, QUICK_STEPS if args.quick else STEPS))
    if args.guest:
        return guest_main(args)
    if os.geteuid() != 0:
        print("vm_classcost: needs root", file=sys.stderr)
        return 2
    from bench.common import write
    t0 = time.monotonic()
    nq = len(args.qdiscs.split(","))
    fig = {"setup": {"steps": [int(x) for x in args.steps.split(",")], "qdiscs": args.qdiscs.split(","),
                     "batch": args.batch, "grow_batch": args.grow_batch, "clock": args.clock,
                     "repeats": args.repeats, "profile": args.profile,
                     "link_bps": LINK_BPS, "rate_bps": RATE_A, "changed_rate_bps": RATE_B,
                     "description": "us per request (guest wall time of one RtnlSocket.transact of "
                                    "`batch` requests over the batch) to create (NLM_F_CREATE|"
                                    "NLM_F_EXCL), change (other rate) and delete flow classes in "
                                    "flowpacer's root qdisc (TcBackend.setup, the codecs' flow "
                                    "class options) holding N flow classes already; qemu TCG"}}
    ga = ["--steps", args.steps, "--qdiscs", args.qdiscs, "--batch", str(args.batch),
          "--grow-batch", str(args.grow_batch), "--qdisc-budget", str(args.qdisc_budget),
          "--repeats", str(args.repeats)] + (["--profile"] if args.profile else [])
    budget = nq * args.qdisc_budget * 1.5 + 300
    rc = vm_bench(fig, "bench.vm_classcost", ga, budget, clock=args.clock)
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    path = write(args.name, fig, {})
    print(f"wrote {path}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
