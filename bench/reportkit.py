"""What every benchmark's part of bench/REPORT.md is written with.

Each benchmark module renders its own part of the report (``report_section(R) -> str``) and
declares its goals (``report_goals() -> List[Goal]``); bench/report.py loads the results, puts
the parts in the report's chapters (``Chapter``, ``Part``) and the goals in its table. ``R`` is
the report's index of the results (``ResultIndex``). Nothing here imports a benchmark, and
matplotlib is imported only when a plot is drawn (the guest side of the VM benchmarks imports
these modules too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Protocol, Sequence

BENCH = Path(__file__).resolve().parent
PLOTS = BENCH / "plots"

MET, MISSED, NA = "met", "NOT met", "n/a"
COLORS = {"psp": "#1f77b4", "htb": "#d62728", "tbf": "#2ca02c", "fq": "#9467bd", "none": "#7f7f7f",
          "hashed": "#1f77b4", "linear": "#d62728"}


class ResultIndex(Protocol):
    """bench/report.py's ``Results``: the JSON results by name and the last suite invocation."""

    def get(self, name: str) -> Optional[dict]:
        """The whole result document bench/results/NAME.json (None: none, or unreadable)."""

    def fig(self, name: str) -> dict:
        """The result's figures ({} when there is no result)."""

    def fresh(self, name: str) -> Optional[bool]:
        """True: from the last invocation; False: older; None: no result or no invocation."""

    def status(self, bench: str) -> dict:
        """How the benchmark ended in the last invocation (bench/results/run.json)."""

    def provenance(self, bench: str, result: str) -> str:
        """One line: where a section's numbers come from."""


# ============================================================== small helpers

def g(d, *path, default=None):
    for p in path:
        if isinstance(d, dict):
            d = d.get(p)
        elif isinstance(d, list) and isinstance(p, int) and -len(d) <= p < len(d):
            d = d[p]
        else:
            return default
        if d is None:
            return default
    return d


def num(x, unit="", nd=None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if nd is None:
        a = abs(x)
        nd = 0 if a >= 100 else 1 if a >= 10 else 2 if a >= 1 else 3
    s = f"{x:,.{nd}f}".replace(",", " ")
    return f"{s} {unit}".strip()


def pct(x, nd=1) -> str:
    return "—" if x is None else f"{100 * x:+.{nd}f} %" if x < 0 or x > 0 else f"{0:.{nd}f} %"


def share(x, nd=1) -> str:
    return "—" if x is None else f"{100 * x:.{nd}f} %"


def mbit(bps) -> str:
    return num(None if bps is None else bps / 1e6, "Mbit/s")


def table(header: List[str], rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def kernel_label(f) -> str:
    """A VM result's guest kernel, short ("6.1"), with its ksoftirqd set-up."""
    kernel = str(g(f, "vm", "kernel", default="?"))
    short = ".".join(kernel.split(".")[:2]) if kernel[:1].isdigit() else kernel
    return short + (", ksoftirqd SCHED_FIFO" if g(f, "setup", "ksoftirqd_rt") else "")


def pyplot():
    """matplotlib.pyplot on the file-only backend, imported on first use."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def savefig(fig, name: str) -> str:
    PLOTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOTS / name, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return f"![{name}](plots/{name})\n"


# ============================================================== goals

class Unavailable(Exception):
    """A goal's figure cannot be measured here (the benchmark said why)."""


class Goal:
    """One row of the report's goal table. ``rank``: its place in the table; ``bench`` and
    ``result``: the benchmark and result file it is judged on; ``source``: for a goal judged on
    whichever of several results exists, picks it (and the row names it). The section shown is
    the chapter of the module that declares the goal (bench/report.py sets it)."""

    def __init__(self, rank: int, issue: int, text: str, bench: str, result: str,
                 value: Callable[[ResultIndex], object], judge: Optional[Callable[[object], bool]],
                 show: Callable[[object], str], source: Optional[Callable[[ResultIndex], str]] = None):
        self.rank, self.issue, self.text, self.bench, self.result = rank, issue, text, bench, result
        self.value, self.judge, self.show, self.source = value, judge, show, source
        self.section = ""

    def evaluate(self, R: ResultIndex):
        """(measured text, verdict text)."""
        tag = ""
        if self.source is not None:
            self.result = self.bench = self.source(R)
            tag = f" [{self.result}]"
        d = R.get(self.result)
        st = R.status(self.bench)
        if d is None:
            if st.get("status") in ("unavailable", "skipped"):
                return "cannot run here", NA
            return "not measured", NA
        try:
            v = self.value(R)
        except Unavailable as e:
            return f"cannot run here: {e}", NA
        except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError):
            v = None
        if v is None:
            return "not measured in this run", NA
        shown = self.show(v) + tag
        j = self.judge(v) if self.judge is not None else None
        if self.judge is None:
            verdict = "reported"
        elif j is None:
            verdict = NA
        else:
            verdict = MET if j else MISSED
        if R.fresh(self.result) is False:
            verdict += " (separate run)"
        return shown, verdict


# ============================================================== the report's layout

@dataclass
class Part:
    """A benchmark's ``report_section``; ``heading`` goes before it when an earlier part of the
    chapter had text."""
    render: Callable[[ResultIndex], str]
    heading: str = ""

    @property
    def module(self) -> str:
        return self.render.__module__


@dataclass
class Chapter:
    """A numbered chapter (``number`` None: no heading of its own, the part brings it) made of
    the parts that have something to show."""
    number: Optional[int]
    title: str
    parts: Sequence[Part]

    def render(self, R: ResultIndex) -> str:
        out = [f"## {self.number}. {self.title}\n"] if self.number is not None else []
        shown = False
        for part in self.parts:
            text = part.render(R)
            if not text:
                continue
            if part.heading and shown:
                out.append(part.heading)
            out.append(text)
            shown = True
        return "\n".join(out)
