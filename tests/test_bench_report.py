"""bench/: each benchmark owns its part of bench/REPORT.md, bench/report.py only loads the results
and lays the chapters out, and no bench modules import each other in a loop (report <-> run was
one). Tests do not import bench (test_harness_layout): the import graph is read from the source,
and the report is checked by its own ``python -m bench.report --check``."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def import_graph(bench_dir: Path = BENCH) -> dict:
    """{bench module: bench modules it imports} from the source (every import, at any depth,
    relative or absolute)."""
    mods = {p.stem for p in bench_dir.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((bench_dir / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1 or base == "bench" or base.startswith("bench."):
                    base = base.removeprefix("bench").lstrip(".")
                    if base:
                        deps.add(base.split(".")[0])
                    else:                               # from . import a, b
                        deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("bench."))
        graph[m] = deps & mods
    return graph


def cycles(graph: dict) -> list:
    """For every module that lies on an import loop, the loop found from it."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(path + [start])
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_no_import_loop_in_bench():
    graph = import_graph()
    assert {"report", "suite"} <= graph["run"] and "suite" in graph["report"]   # it sees imports
    assert "run" not in graph["report"]
    assert cycles(graph) == []


def test_cycle_finder_finds_loops():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]
    assert cycles({"run": {"report"}, "report": {"run", "common"}, "common": set()}) == [
        ["report", "run", "report"], ["run", "report", "run"]]


def test_report_py_renders_no_section_of_its_own():
    src = (BENCH / "report.py").read_text()
    assert not re.search(r"matplotlib|pyplot|savefig|plt\.", src)
    assert not re.search(r"^def section_", src, re.M)
    owners = {p.stem for p in BENCH.glob("*.py") if re.search(r"^def report_section\(", p.read_text(), re.M)}
    assert {"vm_gaps", "vm_pacing", "vm_sharing", "vm_share_pktgen", "vm_lfp", "daemon_bench",
            "backend_bench", "classify_bench", "aggregates", "psp_sim", "tracer_overhead",
            "reliability", "burst_bench", "access_bench", "crowd_bench"} == owners


@pytest.mark.slow          # draws the 16 plots: 5-9 s
@pytest.mark.untimed       # and nothing measured on the wall clock
def test_report_is_what_the_committed_results_give():
    """Every suite benchmark has its part in a chapter, the goals are in order, and REPORT.md
    is what bench/results/*.json render to now (plots into a temporary directory)."""
    r = subprocess.run([sys.executable, "-m", "bench.report", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
