"""The benchmark suite: run every benchmark (or the named ones), then write bench/REPORT.md.

    .venv/bin/python -m bench.run                  # everything (make bench), ~35-40 min
    .venv/bin/python -m bench.run --quick          # the same with small sizes, ~10 min
    .venv/bin/python -m bench.run classify daemon  # some of them (names: --list)
    .venv/bin/python -m bench.run --no-vm          # leave out the benchmarks that boot the VM
    .venv/bin/python -m bench.run report           # only rewrite the report from the results

Each benchmark runs as its own process (``python -m bench.MODULE``), bounded in time, and writes
bench/results/NAME.json; a failure is recorded and the suite goes on. bench/results/run.json
records this invocation (when, which, how each ended, the log's tail); the report marks results
that did not come from it. Exit status: 0 when every selected benchmark ran (or said that it
cannot run here), 1 when one failed.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .common import RESULTS, machine
from .suite import ALIASES, BENCHES, BY_NAME, Bench

REPO = Path(__file__).resolve().parents[1]
RUN_FILE = RESULTS / "run.json"
UNAVAILABLE_RC = 3          # a benchmark's way of saying: cannot run here (it wrote why)
# one benchmark at a time on this machine: each takes this lock (flock) while it runs, and so
# can anything else that should not share the host with one (e.g. `flock FILE pytest ...`)
LOCK_FILE = os.environ.get("FLOWPACER_BENCH_LOCK", "/tmp/flowpacer-vm.lock")


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load_run() -> dict:
    try:
        return json.loads(RUN_FILE.read_text())
    except (OSError, ValueError):
        return {}


def run_one(b: Bench, quick: bool, logdir: Path, extra: Optional[List[str]] = None) -> dict:
    args = list(b.quick if quick else b.full) + list(extra or [])
    argv = [sys.executable, "-m", b.module, *args]
    limit = max(300, 2 * b.est_s + 300)
    logpath = logdir / f"{b.name}.log"
    print(f"\n=== {b.name}: {' '.join(argv[1:])}  (limit {limit} s)", flush=True)
    lock = open(LOCK_FILE, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"=== {b.name}: waiting for {LOCK_FILE} (another benchmark or VM run holds it)",
              flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        return _run_locked(b, argv, limit, logpath)
    finally:
        lock.close()


def _run_locked(b: Bench, argv: List[str], limit: int, logpath: Path) -> dict:
    started, t0 = now_iso(), time.monotonic()
    tail: List[str] = []
    rc: Optional[int] = None
    timed_out = False
    with open(logpath, "w") as log:
        p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        try:
            deadline = t0 + limit
            os.set_blocking(p.stdout.fileno(), False)
            while True:
                line = p.stdout.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    log.write(line)
                    tail.append(line.rstrip("\n"))
                    del tail[:-40]
                    continue
                if p.poll() is not None:
                    rest = p.stdout.read() or ""
                    for ln in rest.splitlines():
                        print(ln)
                        log.write(ln + "\n")
                        tail.append(ln)
                    del tail[:-40]
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            if p.poll() is None:         # ours: the process group we started
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except OSError:
                        pass
                    p.wait(timeout=30)
            rc = p.returncode
    secs = round(time.monotonic() - t0, 1)
    if timed_out:
        status = "failed"
        tail.append(f"(stopped after the time limit of {limit} s)")
    elif rc == 0:
        status = "ok"
    elif rc == UNAVAILABLE_RC:
        status = "unavailable"
    else:
        status = "failed"
    print(f"=== {b.name}: {status} (exit {rc}) in {secs} s", flush=True)
    return {"status": status, "rc": rc, "seconds": secs, "started": started, "finished": now_iso(),
            "argv": argv[1:], "log": str(logpath), "tail": tail[-25:], "result": f"{b.result}.json"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="benchmarks to run (default: all), or 'report'")
    ap.add_argument("--quick", action="store_true", help="small sizes everywhere (a smoke run)")
    ap.add_argument("--no-vm", action="store_true", help="skip the benchmarks that boot the VM")
    ap.add_argument("--no-report", action="store_true", help="do not write bench/REPORT.md")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        for b in BENCHES:
            print(f"{b.name:12} {'(VM) ' if b.vm else ''}{b.what}  [python -m {b.module}]")
        return 0
    from . import report
    if args.names == ["report"]:
        print(f"wrote {report.main([])}")
        return 0
    sel = []
    for n in args.names or [b.name for b in BENCHES]:
        n = ALIASES.get(n, n)
        if n not in BY_NAME:
            ap.error(f"unknown benchmark {n!r} (see --list)")
        sel.append(BY_NAME[n])
    if os.geteuid() != 0:
        print("bench.run: the benchmarks need root (namespaces, tc, eBPF)", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"flowpacer-bench-{stamp}"
    logdir.mkdir(parents=True, exist_ok=True)
    doc = load_run()
    benches = doc.get("benchmarks", {})
    inv = {"id": stamp, "started": now_iso(), "quick": args.quick, "no_vm": args.no_vm,
           "selected": [b.name for b in sel], "argv": sys.argv[1:] if argv is None else list(argv),
           "machine": machine(), "logs": str(logdir)}
    t0 = time.monotonic()
    failed = False
    for b in sel:
        if b.vm and args.no_vm:
            benches[b.name] = {"status": "skipped", "reason": "left out of this invocation (--no-vm)",
                               "started": now_iso(),
                               "result": f"{b.result}.json"}
            continue
        if b.vm and not (REPO / f"{b.module.replace('.', '/')}.py").exists():
            benches[b.name] = {"status": "unavailable", "reason": f"{b.module} does not exist",
                               "started": now_iso(), "result": f"{b.result}.json"}
            continue
        r = run_one(b, args.quick, logdir)
        benches[b.name] = r
        failed |= r["status"] == "failed"
        inv["finished"] = now_iso()
        inv["seconds"] = round(time.monotonic() - t0, 1)
        RUN_FILE.write_text(json.dumps({"invocation": inv, "benchmarks": benches}, indent=2) + "\n")
    inv["finished"] = now_iso()
    inv["seconds"] = round(time.monotonic() - t0, 1)
    RUN_FILE.write_text(json.dumps({"invocation": inv, "benchmarks": benches}, indent=2) + "\n")
    print(f"\nsuite: {inv['seconds']:.0f} s; logs in {logdir}")
    if not args.no_report:
        print(f"wrote {report.main([])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
