"""Ready spare classes (issue 26, ``ready_classes:``), without a kernel: the rules key, the
engine's plan, ``ClassIds``' keeping of closed flows' classes below the target, and the daemon's
fill in batches with the lock free in between (fakes). The kernel's side: the backend contract
(``case_ready_spares_are_made_and_taken``, htb on the host, psp in the VM) and
``test_flashcrowd.py::test_a_crowd_finds_its_classes_made_ahead_by_ready_classes`` (a real
daemon, nginx and a crowd of h2load clients)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from flowpacer.errors import RulesError
from flowpacer.kernel.backend.handles import SPARE_FROM, SPARE_MAX
from flowpacer.kernel.backend.pool import Pool
from flowpacer.kernel.backend.tcids import ClassIds
from flowpacer.model import (BackendKind, Direction, EventKind, Flow, FlowEvent, FlowKey,
                             FlowSource, Match, ProcessInfo, Rule, RuleSet, Shape)
from flowpacer.policy import engine, rules
from flowpacer.surfaces import view as views
from flowpacer.surfaces.control import call
from harness.fakes import FakeFactory, FakeSockDiag, FakeTracer, inprocess_daemon, mixed_key
from harness.testbed import wait_for


def load(text: str) -> RuleSet:
    return rules.loads(textwrap.dedent(text), "r.yaml")


def problems(text: str):
    with pytest.raises(RulesError) as ei:
        load(text)
    return [str(p) for p in ei.value.problems]


HEAD = "interface: eth0\nlink_rate: 1gbit\n"
RULE = "rules:\n  - name: web\n    match: {process: nginx}\n    rate: 2mbit\n"


def test_the_rules_key():
    assert load(HEAD + RULE).ready_classes == 0
    assert load(HEAD + "ready_classes: 2000\n" + RULE).ready_classes == 2000
    assert load(HEAD + "ready_classes: 16384\n" + RULE).ready_classes == 16384
    assert rules.READY_CLASSES_MAX == SPARE_MAX     # the policy's cap is the backend's
    for bad, why in (("lots", "'lots' is not a number of classes: write e.g. 2000 (0: none)"),
                     ("-5", "'-5' is not a number of classes: write e.g. 2000 (0: none)"),
                     ("1.5", "'1.5' is not a number of classes: write e.g. 2000 (0: none)"),
                     ("'300'", "'300' is not a number of classes: write e.g. 2000 (0: none)"),
                     ("16385", "'16385' is out of range: at most 16384 ready classes an "
                               "interface"),
                     ("99999999999", "'99999999999' is out of range: at most 16384 ready "
                                     "classes an interface")):
        assert problems(HEAD + f"ready_classes: {bad}\n" + RULE) == \
            [f"r.yaml:3:16: ready_classes: {why}"], bad
    # with other problems: every one at once
    got = problems(HEAD + "ready_classes: x\n" + RULE.replace("2mbit", "fast"))
    assert len(got) == 2 and got[0].startswith("r.yaml:3:16: ready_classes:"), got


def ruleset(ready: int, rate_bps: int = 250_000) -> RuleSet:
    return RuleSet("fake0", BackendKind.HTB, 125_000_000,
                   (Rule("web", Match(process=("nginx",)), rate_bps),), ready_classes=ready)


def test_the_plan():
    rs = ruleset(100)
    op = engine.plan_spares(rs, flows=10, spares=20, batch=64, told=0)
    assert (op.count, op.target, op.shape) == (64, 100, Shape("", 250_000, 250_000))
    assert engine.plan_spares(rs, 10, 80, 64, told=100).count == 10
    assert engine.plan_spares(rs, 10, 90, 64, told=100) is None        # enough
    assert engine.plan_spares(rs, 150, 0, 64, told=100) is None        # flows count too
    # a changed target is said once even with nothing to make (the backend keeps closed
    # flows' classes below it)
    op = engine.plan_spares(ruleset(0), 10, 90, 64, told=100)
    assert (op.count, op.target) == (0, 0)
    assert engine.plan_spares(ruleset(0), 10, 90, 64, told=0) is None
    # no sending rule: a placeholder rate, changed when a flow takes the class
    recv = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                   (Rule("up", Match(process=("rsync",)), None, receive_rate_bps=1000),),
                   ready_classes=5)
    assert engine.plan_spares(recv, 0, 0, 64, 0).shape == \
        Shape("", engine.SPARE_RATE_BPS, engine.SPARE_RATE_BPS)


def test_below_spare_from_a_closed_flows_class_stays_while_spares_are_fewer_than_ready():
    ids = ClassIds(Pool(0xF1F0), spare_max=SPARE_MAX)
    ids.new_apply()
    assert not ids.keep_spare(0x20, flows=10)               # a small setup: deleted
    ids.ready = 3
    assert [ids.keep_spare(0x20 + i, flows=10) for i in range(4)] == [True] * 3 + [False]
    ids.new_apply()
    assert ids.keep_spare(0x30, flows=SPARE_FROM)           # at spare_from: kept anyway



key = mixed_key


def flow(k: FlowKey) -> Flow:
    return Flow(k, Direction.INBOUND, ProcessInfo(pid=100, comm="nginx"), FlowSource.TRACER,
                seen_ns=time.monotonic_ns())


def events(kind: EventKind, keys):
    return [FlowEvent(kind, flow(k)) for k in keys]


def test_the_daemon_fills_in_batches_and_a_burst_takes_the_spares(tmp_path, monkeypatch):
    """``ready_classes: 600``: the fake backend gets its spares in several batches, beside the
    flows the start's pass found (they count towards the 600); a burst of IPv4, IPv6 and IPv4-mapped flows takes spares, none made; the closed
    flows' classes are spares again; a reload to 0 makes no more; status shows them."""
    from flowpacer.daemon import reconciler
    monkeypatch.setattr(reconciler, "SPARE_BATCH", (1, 100))   # the fake makes them in no time
    current = {"rs": ruleset(600)}
    tr, sd = FakeTracer(), FakeSockDiag()
    fac = FakeFactory(spare_max=SPARE_MAX)
    early = [key(i, 4) for i in range(5)]
    burst = [key(i, fam) for i in range(100, 295) for fam in (4, 6, "mapped")]
    sd.flows = {k: flow(k) for k in early}
    with inprocess_daemon(tmp_path, lambda: current["rs"], factory=fac, tracer=tr,
                          sockdiag=sd, rescan_s=0.2) as d:
        b = fac.made[0]
        tr.push(events(EventKind.OPEN, early))
        wait_for(lambda: set(b.installed()) >= set(early), 5, what="the start's flows shaped")
        wait_for(lambda: len(b.installed()) + len(b.spares) >= 600, 10, what="600 ready")
        fills = [op for op in b.applied if type(op).__name__ == "SpareOp"]
        assert len(fills) >= 6 and max(op.count for op in fills) <= 100, \
            [op.count for op in fills]
        assert d.reconciler.counters.spares_made == sum(op.count for op in fills) == \
            600 - len(b.installed()), [op.count for op in fills]
        # the burst: three families at once, every class a spare
        made_before = b._next
        sd.flows.update({k: flow(k) for k in burst})
        tr.push(events(EventKind.OPEN, burst))
        wait_for(lambda: set(b.installed()) >= set(burst), 5, what="the burst shaped")
        assert b._next == made_before, "a class was made for the burst: spares were there"
        st = call(d.opts.socket_path, {"cmd": "status"}, timeout=5)
        spare = 600 - len(early) - len(burst)
        assert st["interfaces"][0]["spare_classes"] == spare
        assert st["interfaces"][0]["ready_classes"] == 600
        assert st["counters"]["spares_made"] == 600 - len(early) and \
            st["counters"]["spare_errors"] == 0
        assert st["healthy"]
        assert views.parse_status(st).spares == (("fake0", spare, 600),)
        out = subprocess.run([sys.executable, "-m", "flowpacer", "status", "--socket",
                              d.opts.socket_path], capture_output=True, text=True, timeout=30)
        assert f"spares:    fake0 {spare} classes (ready_classes 600)" in out.stdout, out
        for k in burst:
            del sd.flows[k]
        tr.push(events(EventKind.CLOSE, burst))
        wait_for(lambda: not set(b.installed()) & set(burst), 5, what="the burst closed")
        assert len(b.spares) == 600 - len(early)
        # a reload to 0: nothing more is made, the spares stay (they cost nothing)
        current["rs"] = ruleset(0)
        n = len(b.applied)
        assert d.reload().ok
        wait_for(lambda: b.spare_target == 0, 5, what="the new target told")
        assert sum(op.count for op in b.applied[n:] if type(op).__name__ == "SpareOp") == 0
        assert len(b.spares) == 600 - len(early)


def test_each_batch_holds_the_lock_about_a_slice_while_the_cost_a_class_grows():
    """htb's cost to make a class grows with the classes there (the kernel's walk of every
    class): a fake whose "kernel" takes 1 us per class already there for each class made (the
    reconciler's clock advanced by it). Filling 10 000: the first batch is small, each later
    one is at most twice the one before and holds the lock at most ~2 slices (the estimate runs
    a batch behind the growth), and every class is made."""
    from flowpacer.daemon import reconciler as rmod
    from flowpacer.daemon.reconciler import Reconciler
    from flowpacer.daemon.supervisor import BackendSupervisor
    from harness.fakes import FakeBackend

    now = {"ns": 0}
    held = []

    class Walking(FakeBackend):
        def apply(self, plan):
            t0 = now["ns"]
            for op in plan:
                if type(op).__name__ == "SpareOp":
                    there = len(self.flows) + len(self.spares)
                    n = min(op.count, self.spare_max - len(self.spares))
                    now["ns"] += sum(1000 * (there + i) for i in range(n))
            res = super().apply(plan)
            held.append((res.spares_made, now["ns"] - t0))
            return res

    class Factory(FakeFactory):
        def _new(self, name, interface, link_rate_bps):
            b = Walking(name, interface, link_rate_bps or 125_000_000, spare_max=SPARE_MAX)
            self.made.append(b)
            b.setup()
            return b

    rs = ruleset(10_000)
    sup = BackendSupervisor(Factory())
    sup.start(rs)
    rec = Reconciler(sup, rs, clock_ns=lambda: now["ns"])
    calls = 0
    while rec.fill_spares():
        calls += 1
        assert calls < 2000
    assert len(sup.backend.spares) == 10_000 == rec.counters.spares_made
    made = [n for n, _ns in held]
    assert made[0] == rmod.SPARE_FIRST_BATCH
    assert all(b <= 2 * a for a, b in zip(made, made[1:])), made
    print("batches (made, ms):", [(n, round(ns / 1e6, 1)) for n, ns in held[:8]], "...",
          len(held), "batches")
    slowest = max(held[1:], key=lambda h: h[1])
    assert slowest[1] <= 2 * rmod.SPARE_SLICE_NS, (slowest, held.index(slowest), held[:12])
    # at 10 000 classes a class costs ~10 ms: the batches are down to the fewest
    assert made[-1] <= max(rmod.SPARE_BATCH[0], 10_000 - sum(made[:-1])), made[-5:]
