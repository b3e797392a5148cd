"""Reliability figures (issue 7): ``python -m bench.reliability [--cycles N]`` (``make soak``)
runs harness.scenarios' crash_restart and churn_soak and writes bench/results/reliability.json.
"""
from __future__ import annotations

import argparse
import json
import sys

from harness.scenarios import churn_soak, crash_restart
from harness.testbed import Testbed

from .common import write


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


if __name__ == "__main__":
    sys.exit(main())
