"""The netlink fuzzer (``pspfuzz.py``) against the psp module, bounded in iterations and time.

Every request must be refused with the errno the model predicts or accepted and dumped back as
the model says, the statistics must add up, the kernel log must stay clean (autouse fixture),
and the module must still unload afterwards. The seed is random unless
``FLOWPACER_FUZZ_SEED`` is set, and printed with the summary (``psp-fuzz.json`` in the VM's
out dir) so that a finding can be replayed with ``python tests/guest/pspfuzz.py --seed N``.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from harness import psplib
import pspfuzz
from harness.pacing import Testbed, wait_for

# 1500 requests (~35 s in an idle TCG guest) in `make test`, which runs this on 6.1 and on 7.3; a
# longer hunt: FLOWPACER_FUZZ_ITERATIONS=20000 FLOWPACER_FUZZ_SECONDS=600 (docs/psp-results.md)
ITERATIONS = int(os.environ.get("FLOWPACER_FUZZ_ITERATIONS", "1500"))
SECONDS = float(os.environ.get("FLOWPACER_FUZZ_SECONDS", "150"))
MIN_ITERATIONS = min(ITERATIONS, 1000)   # fewer in the time bound: too slow to mean much


def test_netlink_fuzz(psp_module):
    seed = int(os.environ.get("FLOWPACER_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
    with Testbed() as tb:
        out = pspfuzz.run(tb, ITERATIONS, SECONDS, seed)
    # groups nested two levels are the rarest state: 1500 requests of some seeds never reach
    # one (seen once in about ten runs). Then further seeds run (at most two), and every run's
    # findings count
    tries = 1
    while out["two_levels_seen"] == 0 and not out["findings"] and tries < 3 \
            and not os.environ.get("FLOWPACER_FUZZ_SEED"):
        earlier, seed = out, random.SystemRandom().randrange(2**31)
        with Testbed() as tb:
            out = pspfuzz.run(tb, ITERATIONS, SECONDS, seed)
        psplib.record(f"psp fuzz: no two-level groups with the previous seed "
                      f"({earlier['iterations']} requests, 0 findings): seed {seed} as well")
        tries += 1
    dest = Path(os.environ.get("FLOWPACER_VM_OUT", "/tmp")) / "psp-fuzz.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    psplib.record(f"psp fuzz: seed {seed}, {out['iterations']} requests in {out['seconds']} s, "
                  f"{out['accepted']} accepted, {out['malformed_requests']} malformed, "
                  f"outcomes {out['outcomes']}, {out['filter_ops']} filter ops, "
                  f"{out['stat_checks']} statistics checks, groups in {out['groups_seen']} / "
                  f"members in {out['grouped_seen']} / two levels in {out['two_levels_seen']} "
                  f"states, traffic {out['traffic']}, "
                  f"{len(out['findings'])} findings")
    assert not out["findings"], f"seed {seed}:\n" + "\n".join(out["findings"][:10])
    assert not out["traffic_errors"], out["traffic_errors"]
    assert out["iterations"] >= MIN_ITERATIONS, f"only {out['iterations']} in {SECONDS:.0f} s"
    # the run covered what it is meant to: every kind of request, refusals and acceptances,
    # malformed encodings, statistics checks, traffic of both kinds
    assert set(out["requests_by_op"]) == {"qdisc-create", "qdisc-change", "qdisc-replace",
                                          "qdisc-delete", "class-add", "class-change",
                                          "class-delete"}
    assert out["accepted"] >= out["iterations"] // 10
    assert {"EINVAL", "ERANGE", "ENOENT", "EEXIST", "EBUSY"} <= set(out["outcomes"])
    assert out["malformed_requests"] >= out["iterations"] // 20
    assert out["stat_checks"] >= 3 and out["stat_checks_skipped"] <= out["stat_checks"]
    assert out["traffic"]["udp"] > 100 and out["traffic"]["tcp_bytes"] > 0
    # groups (issue 15): made, given members, and nested two levels during the run
    assert out["groups_seen"] > 0 and out["grouped_seen"] > 0 and out["two_levels_seen"] > 0
    # the module still unloads, and loads again
    wait_for(lambda: psplib.refcnt() == 0, 15, "the fuzzed qdiscs to be freed")
    psplib.unload()
    psplib.load()
