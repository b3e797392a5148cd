"""Shared by the benchmarks: machine facts and the JSON result file."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "memory_bytes": mem,
            "python": platform.python_version(), "machine": platform.machine()}


def percentiles(samples, ps=(50, 90, 99)) -> dict:
    s = sorted(samples)
    if not s:
        return {}
    out = {f"p{p}": s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] for p in ps}
    out.update(min=s[0], max=s[-1], mean=statistics.fmean(s), n=len(s))
    return out


def write(name: str, figures: dict, goals: dict = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "figures": figures, "goals": goals or {}}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def parts_and_sizes(ap, args, parts, sizes, quick_sizes):
    """A size-curve benchmark's command line: the parts asked for (every part of ``parts`` by
    default; an unknown one is an argparse error) and the sizes (``--sizes``, else the quick or
    the full ones)."""
    names = args.parts or list(parts)
    for n in names:
        if n not in parts:
            ap.error(f"unknown part {n!r}")
    got = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else (
        quick_sizes if args.quick else sizes)
    return names, got
