"""bench/REPORT.md and bench/plots/*.png from bench/results/*.json (``python -m bench.report``;
``--check``: is REPORT.md what the results give, and is every benchmark in a chapter).

Every goal the issues set is listed with the figure that answers it, this run's value and whether
it is met; a result that did not come from the last ``bench.run`` invocation is marked as such
(machines here are noisy: only figures of one run compare), and a benchmark that could not run
here says why instead of showing a number.

This module loads and indexes the results (``Results``) and lays the report out: which
benchmark's part goes in which chapter (``CHAPTERS``). Each benchmark module renders its own part
(``report_section``) and declares its goals (``report_goals``), with bench/reportkit.py.
"""
from __future__ import annotations

import datetime
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from . import (access_bench, aggregates, backend_bench, burst_bench, classify_bench, crowd_bench,
               daemon_bench, psp_sim,
               reliability, reportkit, tracer_overhead, vm_gaps, vm_lfp, vm_pacing, vm_share_pktgen,
               vm_sharing)
from .reportkit import MET, MISSED, NA, PLOTS, Chapter, Goal, Part, num, table
from .suite import BENCHES

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
REPORT = BENCH / "REPORT.md"

# The report's chapters in order, each made of benchmarks' parts; a goal is shown in the
# chapter of the module that declares it.
CHAPTERS = [
    Chapter(1, "Pacing precision in the VM (psp, htb, tbf, fq)",
            [Part(vm_gaps.report_section), Part(vm_pacing.report_section)]),
    Chapter(2, "Sharing an oversubscribed link: 4, 4, 4, 2, 2 on 10",
            [Part(vm_share_pktgen.report_section), Part(vm_sharing.report_section, vm_sharing.HEADING)]),
    Chapter(3, "TCP over a long fat pipe with a small bottleneck buffer", [Part(vm_lfp.report_section)]),
    Chapter(None, "Where per-flow pacing pays: clients behind access links (issue 30)",
            [Part(access_bench.report_section)]),
    Chapter(4, "The daemon: time-to-shape, churn, install cost, scale",
            [Part(daemon_bench.report_section), Part(backend_bench.report_section),
             Part(burst_bench.report_section), Part(crowd_bench.report_section)]),
    Chapter(5, "Classification: one flow's throughput with N filters installed",
            [Part(classify_bench.report_section)]),
    Chapter(None, "Aggregate caps", [Part(aggregates.report_section)]),
    Chapter(6, "psp scheduling core: cost per packet vs number of classes", [Part(psp_sim.report_section)]),
    Chapter(7, "Tracer overhead", [Part(tracer_overhead.report_section)]),
    Chapter(8, "Reliability", [Part(reliability.report_section)]),
]
# the modules that declare goals (each is in a chapter above)
GOAL_MODULES = (backend_bench, classify_bench, daemon_bench, tracer_overhead, psp_sim, vm_pacing,
                vm_gaps, vm_share_pktgen, reliability)


# ============================================================== loading

def _date(s: Optional[str]) -> Optional[datetime.datetime]:
    if not s:
        return None
    try:
        return datetime.datetime.fromisoformat(s)
    except ValueError:
        return None


class Results:
    def __init__(self, root: Path = RESULTS):
        self.root = root
        self.docs: Dict[str, Optional[dict]] = {}
        try:
            self.run = json.loads((root / "run.json").read_text())
        except (OSError, ValueError):
            self.run = {}
        self.inv = self.run.get("invocation", {})
        self.inv_start = _date(self.inv.get("started"))

    def get(self, name: str) -> Optional[dict]:
        if name not in self.docs:
            try:
                self.docs[name] = json.loads((self.root / f"{name}.json").read_text())
            except (OSError, ValueError):
                self.docs[name] = None
        return self.docs[name]

    def fig(self, name: str) -> dict:
        d = self.get(name)
        if d is None:
            return {}
        return d.get("figures", d)

    def fresh(self, name: str) -> Optional[bool]:
        """True: from the last invocation; False: older; None: no result or no invocation."""
        d = self.get(name)
        if d is None or self.inv_start is None:
            return None
        dt = _date(d.get("date"))
        end = _date(self.inv.get("finished"))
        late = end is not None and dt is not None and dt > end + datetime.timedelta(seconds=60)
        return bool(dt and dt >= self.inv_start.replace(microsecond=0) and not late)

    def status(self, bench: str) -> dict:
        return self.run.get("benchmarks", {}).get(bench, {})

    def provenance(self, bench: str, result: str) -> str:
        """One line: where this section's numbers come from."""
        d = self.get(result)
        st = self.status(bench)
        if d is None:
            if st.get("status") in ("unavailable", "skipped"):
                return f"**Not run here:** {st.get('reason') or _tail_reason(st)}."
            if st.get("status") == "failed":
                return f"**The benchmark failed** in this run (exit {st.get('rc')}): `{_tail_reason(st)}`."
            return f"**No result**: `python -m bench.run {bench}` has not been run."
        when = d.get("date", "?")
        m = d.get("machine", {})
        where = f"kernel {m.get('kernel', '?')}, {m.get('cpus', '?')} CPUs"
        fresh = self.fresh(result)
        if fresh is False:
            note = (f" **Not from the last suite invocation** ({self.inv.get('started', '?')}): these "
                    f"figures come from a separate run, compare them with care.")
        else:
            note = ""
        bad = ""
        if st.get("status") == "failed" and fresh is not True:
            bad = f" The benchmark **failed** in the last invocation (exit {st.get('rc')}): `{_tail_reason(st)}`."
        return f"Measured {when} ({where}).{note}{bad}"


def _tail_reason(st: dict) -> str:
    for ln in reversed(st.get("tail") or []):
        ln = ln.strip()
        if ln and not ln.startswith("==="):
            return ln[:300]
    return st.get("reason", "see the log")


# ============================================================== the report

def goals() -> List[Goal]:
    """Every benchmark's goals in the table's order, each with the section that shows it."""
    chapter_of = {part.module: str(ch.number) for ch in CHAPTERS for part in ch.parts}
    out = []
    for mod in GOAL_MODULES:
        for goal in mod.report_goals():
            goal.section = chapter_of[mod.__name__]
            out.append(goal)
    return sorted(out, key=lambda goal: goal.rank)


def summary(R: Results, gl: List[Goal]) -> str:
    rows = []
    for gg in gl:
        shown, verdict = gg.evaluate(R)
        mark = {MET: "✅ met", MISSED: "❌ NOT met", NA: "— " + NA, "reported": "ℹ reported"}.get(
            verdict, ("✅ " if verdict.startswith(MET) else "❌ " if verdict.startswith(MISSED) else "") + verdict)
        rows.append([f"#{gg.issue}", gg.text, shown, mark, f"§{gg.section}"])
    return table(["issue", "goal", "measured", "verdict", "section"], rows)


def runs_table(R: Results) -> str:
    rows = []
    for b in BENCHES:
        st = R.status(b.name)
        d = R.get(b.result)
        fresh = R.fresh(b.result)
        rows.append([b.name, b.what, st.get("status", "not run"), num(st.get("seconds"), "s", 0) if st.get("seconds") else "",
                     (d or {}).get("date", "—") + (" (separate run)" if fresh is False else ""),
                     f"`python -m {b.module}`"])
    return table(["benchmark", "what", "last invocation", "took", "result's date", "alone"], rows)


def build(R: Results) -> str:
    gl = goals()
    inv = R.inv
    m = inv.get("machine", {})
    head = [
        "# flowpacer benchmark report\n",
        f"Generated {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} by "
        f"`python -m bench.report` from `bench/results/*.json`. Last suite invocation: "
        f"{inv.get('started', 'none recorded')}"
        + (f" (`python -m bench.run {' '.join(inv.get('argv', []))}`, {num(inv.get('seconds'), 's', 0)}"
           f"{', quick sizes' if inv.get('quick') else ''})" if inv else "")
        + f"; host kernel {m.get('kernel', '?')}, {m.get('cpus', '?')} CPUs, "
          f"{num((m.get('memory_bytes') or 0) / 2 ** 30, 'GiB', 0)} memory; the VM runs Debian's 6.1 kernel "
          f"under qemu TCG (software emulation: coarse timers, slow CPU).\n",
        "The machines are shared and noisy (±5 % run to run, more under load): only figures measured in "
        "one run compare with each other, and every ratio below is taken within one run. A section whose "
        "result did not come from the last invocation says so.\n",
        "## Goals\n", summary(R, gl),
    ]
    body = [ch.render(R) for ch in CHAPTERS]
    tail = ["## The runs\n", runs_table(R),
            "Run everything with `make bench` (`python -m bench.run`), one benchmark with "
            "`python -m bench.run NAME` or `python -m bench.MODULE`, small sizes with `--quick`, without the "
            "VM with `--no-vm`; `python -m bench.run report` rewrites this file from the results.\n"]
    return "\n".join(head + body + tail)


def main(argv=None) -> Path:
    R = Results()
    PLOTS.mkdir(parents=True, exist_ok=True)
    for p in PLOTS.glob("*.png"):
        p.unlink()
    REPORT.write_text(build(R))
    return REPORT


def _without_date(text: str) -> str:
    return re.sub(r"^Generated \S+ ", "Generated ", text, flags=re.M)


def check() -> List[str]:
    """What is wrong with the layout, or with REPORT.md against what the results give now (the
    plots drawn into a temporary directory; the date of generation aside): [] when nothing."""
    problems = []
    in_chapters = {part.module for ch in CHAPTERS for part in ch.parts}
    problems += [f"{b.name}: its module {b.module} has no part in CHAPTERS" for b in BENCHES
                 if b.module not in in_chapters]
    problems += [f"{mod.__name__}: declares goals but has no numbered chapter" for mod in GOAL_MODULES
                 if not any(part.module == mod.__name__ and ch.number is not None
                            for ch in CHAPTERS for part in ch.parts)]
    ranks = [goal.rank for goal in goals()]
    if ranks != list(range(1, len(ranks) + 1)):
        problems.append(f"goal ranks are not 1..{len(ranks)} once each: {ranks}")
    committed = REPORT.read_text() if REPORT.exists() else ""
    with tempfile.TemporaryDirectory() as tmp:
        saved, reportkit.PLOTS = reportkit.PLOTS, Path(tmp)
        try:
            text = build(Results())
        finally:
            reportkit.PLOTS = saved
        drawn = sorted(p.name for p in Path(tmp).glob("*.png"))
    if _without_date(text) != _without_date(committed):
        problems.append(f"{REPORT.name} is not what bench/results/*.json give: rewrite it with "
                        "`python -m bench.run report`")
    shown = sorted(re.findall(r"\(plots/([^)]+\.png)\)", text))
    if drawn != shown:
        problems.append(f"plots drawn {drawn} but the report shows {shown}")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        found = check()
        for line in found:
            print(f"bench.report: {line}", file=sys.stderr)
        sys.exit(1 if found else 0)
    print(f"wrote {main(sys.argv[1:])}")
