"""Reliability figures (issue 7): ``python -m bench.reliability [--cycles N]`` (``make soak``)
runs harness.scenarios' crash_restart and churn_soak and writes bench/results/reliability.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List

from harness.scenarios import churn_soak, crash_restart
from harness.testbed import Testbed

from .common import write
from .reportkit import Goal, ResultIndex, g, mbit, num, pyplot, savefig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=100_000)
    args = ap.parse_args(argv)
    figures = {}
    with Testbed(tag="rel1") as tb:
        figures["crash_restart"] = crash_restart(tb)
    print(json.dumps(figures["crash_restart"], indent=2), flush=True)
    with Testbed(tag="rel2") as tb:
        figures["churn_soak"] = churn_soak(tb, args.cycles)
    print(json.dumps({k: v for k, v in figures["churn_soak"].items() if k != "curve"}, indent=2))
    goals = {"recovery<=2s": figures["crash_restart"]["recovery_s_from_restart"] <= 2,
             "no_leak_after_crash": figures["crash_restart"]["leaked_after_stop"] == (0, 0),
             "soak_objects_back_to_base": figures["churn_soak"]["kernel_objects_end"]
             == figures["churn_soak"]["kernel_objects_base"]}
    write("reliability", figures, goals)
    return 0


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def _soak_flat(R):
    s = g(R.fig("reliability"), "churn_soak")
    if not s:
        return None
    growth = s["rss_end_bytes"] - s["rss_warm_bytes"]
    flat = growth <= 0.05 * s["rss_warm_bytes"] and s["fds_end"] == s["fds_warm"] \
        and s["kernel_objects_end"] == s["kernel_objects_base"]
    return {"cycles": s["cycles"], "growth": growth, "fds": (s["fds_warm"], s["fds_end"]), "flat": flat,
            "objects": s["kernel_objects_end"] == s["kernel_objects_base"]}


def report_section(R: ResultIndex) -> str:
    plt = pyplot()
    out = [R.provenance("reliability", "reliability") + "\n"]
    f = R.fig("reliability")
    cr = g(f, "crash_restart")
    if cr:
        out.append(f"**Crash and restart** (kill -9 with {cr['held_flows']} held flows and "
                   f"{cr['churn_flows_per_s']} flows/s churning): recovered in {num(cr['recovery_s_from_restart'], 's', 2)} "
                   f"from the restart, {cr['stale_classes_at_restart']} stale classes removed, after stop "
                   f"{cr['leaked_after_stop'][0]} classes / {cr['leaked_after_stop'][1]} filters left; an "
                   f"unmatched download meanwhile: {mbit(cr.get('unmatched_goodput_bit_s'))}.\n")
    cs = g(f, "churn_soak")
    if cs:
        cyc = f"{cs['cycles']:,}".replace(",", " ")
        out.append(f"**Churn soak**: {cyc} open/close cycles in {num(cs['seconds'], 's', 0)}, "
                   f"{cs['errors']} client errors; RSS {num(cs['rss_warm_bytes'] / 1e6, 'MB')} warm → "
                   f"{num(cs['rss_end_bytes'] / 1e6, 'MB')} at the end, fds {cs['fds_warm']} → {cs['fds_end']}, "
                   f"kernel objects (classes, filters) {tuple(cs['kernel_objects_base'])} → {tuple(cs['kernel_objects_end'])}.\n")
        curve = cs.get("curve") or []
        if curve:
            fig, ax = plt.subplots(figsize=(6, 3))
            ax.plot([c["t_s"] for c in curve], [c["rss_bytes"] / 1e6 for c in curve], "o-", label="RSS (MB)")
            ax.set_ylim(0, 1.3 * max(c["rss_bytes"] / 1e6 for c in curve))
            ax.set_xlabel("s into the soak")
            ax.set_ylabel("MB")
            ax2 = ax.twinx()
            ax2.plot([c["t_s"] for c in curve], [c["fds"] for c in curve], "s--", color="C1", label="open fds")
            ax2.set_ylim(0, 1.3 * max(c["fds"] for c in curve))
            ax2.set_ylabel("fds")
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
            out.append(savefig(fig, "reliability_soak.png"))
    return "\n".join(out)


def report_goals() -> List[Goal]:
    return [
        Goal(22, 7, "crash recovery <= 2 s", "reliability", "reliability",
             lambda R: g(R.fig("reliability"), "crash_restart", "recovery_s_from_restart"), lambda v: v <= 2,
             lambda v: num(v, "s", 2)),
        Goal(23, 7, "nothing leaked after crash + stop", "reliability", "reliability",
             lambda R: g(R.fig("reliability"), "crash_restart", "leaked_after_stop"),
             lambda v: list(v) == [0, 0], lambda v: f"{v[0]} classes, {v[1]} filters left"),
        Goal(24, 7, "RSS and fds flat over 100 000 open/close cycles", "reliability", "reliability", _soak_flat,
             lambda v: v["flat"] if v["cycles"] >= 100_000 else None,
             lambda v: (f"{v['cycles']:,} cycles".replace(",", " ")
                        + f": RSS {v['growth'] / 1e6:+.2f} MB, fds {v['fds'][0]}→{v['fds'][1]}"
                        + ("" if v["objects"] else ", kernel objects NOT back to base")
                        + (" — fewer cycles than the goal's 100 000: not judged" if v["cycles"] < 100_000 else ""))),
    ]


if __name__ == "__main__":
    sys.exit(main())
