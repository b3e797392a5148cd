"""`make test` in two lanes at once: the qemu VM's tests beside the host's.

The VM lane (every test marked ``vm``: those that boot the TCG guest) keeps a core or two busy
emulating and barely touches the host's network; the host lane (everything else: namespaces, real
traffic at shaped rates, Debian roots) spends most of its time waiting on kernel timers and
traffic. Run one after the other they took ~60 min on the project's 2-core machine; side by side,
about the longer lane.

The guest's real-clock tests (the module, the daemon on psp, on 6.1 and on 7.3) measure rates
against the host's wall clock, so an emulator starved of CPU makes them fail; the host lane
therefore runs at a lower CPU priority (``nice`` 10): it takes what the VM leaves, and its own
figures come from the kernel's timers and qdiscs, which no nice value slows. The virtual-clock
tests do not depend on load at all.

    python -m harness.lanes                 # both lanes; exit 1 when either fails
    python -m harness.lanes tests/test_x.py -k y    # any arguments: one plain pytest, as before

Each lane's pytest writes its whole output to ``build/test-logs/<lane>.log``. The host lane's
goes to the terminal as it runs; the VM lane's is printed when both have finished, followed by
both lanes' summaries and failures, so the end of the output says what failed where. SIGINT or
SIGTERM stops both lanes (their process groups).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
LOG_DIR = REPO / "build" / "test-logs"

VM_MARK = "vm"
HOST_NICE = 10


@dataclass
class Lane:
    name: str
    args: List[str]
    log: Path
    echo: bool                       # copy its output to the terminal as it comes
    proc: Optional[subprocess.Popen] = None
    rc: Optional[int] = None
    started: float = 0.0
    seconds: float = 0.0
    tail: List[str] = field(default_factory=list)


def lanes() -> List[Lane]:
    # the slowest tests of each lane at the end of its log: where the next minutes go
    py = [sys.executable, "-m", "pytest", "-ra", "--durations=25"]
    return [
        Lane("host", ["nice", "-n", str(HOST_NICE), *py, "-m", f"not {VM_MARK}"],
             LOG_DIR / "host.log", echo=True),
        # its own cache provider off: two sessions writing one .pytest_cache would race
        Lane("vm", py + ["-p", "no:cacheprovider", "-m", VM_MARK], LOG_DIR / "vm.log",
             echo=False),
    ]


def _pump(lane: Lane) -> None:
    """Copy the lane's output to its log (and the terminal), keep the lines after its last
    '=====' rule (pytest's summary) for the end."""
    assert lane.proc is not None and lane.proc.stdout is not None
    with lane.log.open("w", encoding="utf-8", errors="replace") as f:
        for raw in lane.proc.stdout:
            line = raw.decode("utf-8", "replace")
            f.write(line)
            f.flush()
            if lane.echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if "short test summary info" in line or " FAILURES " in line:
                lane.tail = []
            lane.tail.append(line)
            del lane.tail[:-400]


def _summary(lane: Lane) -> str:
    """The lane's failures section and summary, or its last lines."""
    text = "".join(lane.tail)
    return text if text.strip() else "(no output)\n"


def run_lanes() -> int:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    ls = lanes()
    pumps = []
    for lane in ls:
        lane.started = time.monotonic()
        lane.proc = subprocess.Popen(lane.args, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=_pump, args=(lane,), name=f"lane-{lane.name}", daemon=True)
        t.start()
        pumps.append(t)
        print(f"[lanes] {lane.name}: {' '.join(lane.args)} -> {lane.log}", flush=True)

    def stop(signum, _frame):
        for lane in ls:
            if lane.proc is not None and lane.proc.poll() is None:
                try:
                    os.killpg(lane.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for lane, t in zip(ls, pumps):
            lane.rc = lane.proc.wait()
            t.join()
            lane.seconds = time.monotonic() - lane.started
            print(f"[lanes] {lane.name} finished: exit {lane.rc} after {lane.seconds:.0f} s",
                  flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)

    for lane in ls:
        if not lane.echo:
            print(f"\n{'#' * 30} lane {lane.name}: {lane.log} {'#' * 30}", flush=True)
            sys.stdout.write(lane.log.read_text(encoding="utf-8", errors="replace"))
    print(f"\n{'#' * 30} lanes: summaries {'#' * 30}")
    for lane in ls:
        state = "passed" if lane.rc == 0 else f"FAILED (exit {lane.rc})"
        print(f"--- lane {lane.name}: {state} in {lane.seconds:.0f} s ---")
        sys.stdout.write(_summary(lane))
    sys.stdout.flush()
    return 0 if all(lane.rc == 0 for lane in ls) else 1


def main(argv: List[str]) -> int:
    if argv:
        return subprocess.call([sys.executable, "-m", "pytest", "-ra", *argv], cwd=REPO)
    return run_lanes()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
