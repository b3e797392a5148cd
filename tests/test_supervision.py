"""The daemon's supervision in-process: a real Daemon (stages, reconciler, backend supervisor,
control socket) wired to in-memory fakes of the backend and the flow sources. What the kernel
does is tested elsewhere with the real backend; here: stage failures, degradation, exit for
systemd, the watchdog, apply failures part-way, restart adoption, fall-back and reload."""
import dataclasses
import logging
import time

from flowpacer.surfaces.control import call
from flowpacer.errors import BackendError
from harness.metricsview import daemon_samples
from flowpacer.model import (BackendHealth, BackendKind, Direction, EventKind, Flow, FlowEvent,
                             FlowKey, FlowSource, Match, ProcessInfo, Rule, RuleSet, Shape,
                             StageState)
from flowpacer.daemon.stages import GiveUp, Stage
from harness.testbed import wait_for
from harness.fakes import FakeFactory, FakeSockDiag, FakeTracer, inprocess_daemon, mixed_key

RATE = 5_000_000          # bytes/s
RULES = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                (Rule("web", Match(process=("nginx",)), RATE),))



key = mixed_key


def flow(k: FlowKey, comm="nginx") -> Flow:
    return Flow(k, Direction.INBOUND, ProcessInfo(pid=100, comm=comm), FlowSource.TRACER,
                seen_ns=time.monotonic_ns())


def opened(flows):
    return [FlowEvent(EventKind.OPEN, f) for f in flows]


def stage(d, name):
    return next(s for s in d.status()["stages"] if s["name"] == name)


def shaped(d):
    return set(d.supervisor.backend.installed())


def test_mixed_family_batch_is_shaped_and_the_tracer_stays_alive(tmp_path):
    tr, sd = FakeTracer(), FakeSockDiag()
    flows = [flow(key(i, fam)) for i in range(5) for fam in (4, 6, "mapped")]
    sd.flows = {f.key: f for f in flows}
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd) as d:
        tr.push(opened(flows))                  # one batch, all three kinds of address
        wait_for(lambda: shaped(d) == {f.key for f in flows}, 5, what="every flow shaped")
        st = call(d.opts.socket_path, {"cmd": "status"}, timeout=5)
        assert st["healthy"] and {s["state"] for s in st["stages"]} <= {"running", "disabled"}
        assert {f["family"] for f in st["flows"]} == {4, 6}
        assert all(s["failures"] == 0 for s in st["stages"])


def test_a_failing_tracer_is_restarted_then_degrades_to_sock_diag_visibly(tmp_path, caplog):
    tr, sd = FakeTracer(), FakeSockDiag()
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd) as d:
        caplog.set_level(logging.ERROR, logger="flowpacer.daemon.stages")
        tr.fail_with = lambda: RuntimeError("perf buffer broken")
        wait_for(lambda: stage(d, "tracer")["state"] == "degraded", 5, what="tracer degraded")
        st = d.status()
        assert stage(d, "tracer")["failures"] >= 5
        assert "sock_diag polling only (tracer failed" in st["flow_source"]
        assert st["healthy"] is False
        # the traceback is logged once, the repeats as one line each
        assert sum("Traceback" in r.getMessage() for r in caplog.records) == 1
        assert tr.closed
        # metrics say so
        m = {(n, tuple(sorted(lab.items()))): val for n, lab, val in daemon_samples(d)}
        assert m[("flowpacer_flow_source_degraded", ())] == 1
        assert m[("flowpacer_stage_failures_total", (("stage", "tracer"),))] >= 5
        assert m[("flowpacer_stage_state", (("stage", "tracer"), ("state", "degraded")))] == 1
        # and flows are still shaped, found by sock_diag
        f = flow(key(1, 6))
        sd.flows = {f.key: f}
        wait_for(lambda: shaped(d) == {f.key}, 5, what="sock_diag flow shaped")


def test_a_tracer_that_recovers_after_one_failure_keeps_running(tmp_path):
    tr, sd = FakeTracer(), FakeSockDiag()
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd) as d:
        def once():
            tr.fail_with = None     # the restarted stage polls normally, however soon it runs
            return RuntimeError("transient")
        tr.fail_with = once
        wait_for(lambda: stage(d, "tracer")["failures"] == 1, 5, what="one failure")
        wait_for(lambda: stage(d, "tracer")["state"] == "running", 5, what="running again")
        f = flow(key(2, 4))
        sd.flows = {f.key: f}
        tr.push(opened([f]))
        wait_for(lambda: shaped(d) == {f.key}, 5, what="shaped by the restarted tracer")
        assert "tracer (fake)" in d.status()["flow_source"]


def test_an_apply_that_raises_part_way_loses_no_dirty_flow(tmp_path):
    tr, sd = FakeTracer(), FakeSockDiag()
    fac = FakeFactory()
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd, factory=fac) as d:
        flows = [flow(key(i, fam)) for i in range(3) for fam in (4, 6)]
        d.supervisor.backend.raise_on_apply.append(TypeError("a bug in the backend"))
        tr.push(opened(flows))
        sd.flows = {f.key: f for f in flows}
        wait_for(lambda: shaped(d) == {f.key for f in flows}, 5, what="every flow shaped")
        # whichever stage met the exception (tracer batch or reconcile pass) counted it
        assert stage(d, "tracer")["failures"] + stage(d, "main")["failures"] == 1


def test_refused_ops_are_retried_at_the_next_pass(tmp_path):
    tr, sd = FakeTracer(), FakeSockDiag()
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd) as d:
        f = flow(key(3, 6))
        b = d.supervisor.backend
        b.refuse.add(f.key)
        sd.flows = {f.key: f}
        tr.push(opened([f]))
        wait_for(lambda: sum(o.key == f.key for o in b.applied) >= 2, 5, what="retried")
        b.refuse.clear()
        wait_for(lambda: shaped(d) == {f.key}, 5, what="shaped once the kernel takes it")


def test_a_main_loop_that_keeps_failing_exits_non_zero(tmp_path):
    sd = FakeSockDiag()
    with inprocess_daemon(tmp_path, RULES, sockdiag=sd, tracer_enabled=False) as d:
        def broken(*a, **kw):
            raise AttributeError("a bug in the pass")
        d.reconciler.reconcile = broken
        wait_for(lambda: d.exit_code == 1, 10, what="exit status 1")
        assert d.main_stage.state is StageState.FAILED


def test_ready_means_every_stage_runs_before_the_main_thread_enters_its_loop(tmp_path):
    """CI (3ab1ecd): the control socket answered a status while the main thread was still on
    its way into the main loop, and the status called stage main "starting". From READY=1 on,
    every stage reads running, whether or not the main thread has reached ``run`` yet."""
    from flowpacer.daemon.app import Daemon, Options
    seen = []
    opts = Options(rules_path=str(tmp_path / "rules.yaml"), socket_path=str(tmp_path / "ctl.sock"),
                   rescan_s=0.05, tracer=True, metrics_listen=None)
    d = Daemon(opts, backend_factory=FakeFactory(), sockdiag=FakeSockDiag(),
               tracer_factory=FakeTracer, load=lambda path: RULES,
               notify=lambda msg: seen.append((msg, d.status()["healthy"], [
                   (s["name"], s["state"]) for s in d.status()["stages"]])))
    d.start()                     # run() not called: the main thread is not in its loop
    try:
        ready = [(h, st) for m, h, st in seen if m.startswith("READY=1")]
        assert ready and ready[0][0], ready
        st = call(opts.socket_path, {"cmd": "status"}, timeout=5)
        assert st["healthy"], st["stages"]
        assert {s["state"] for s in st["stages"]} <= {"running", "disabled"}, st["stages"]
    finally:
        d._stop.set()
        d.shutdown()


def test_a_control_stage_failure_is_restarted(tmp_path):
    with inprocess_daemon(tmp_path, RULES, tracer_enabled=False) as d:
        orig = d._handle
        n = {"calls": 0}

        def handle(req):
            n["calls"] += 1
            if n["calls"] == 1:
                raise KeyError("bug in a handler")
            return orig(req)
        d._control.handler = handle
        try:
            call(d.opts.socket_path, {"cmd": "ping"}, timeout=2)
        except Exception:
            pass
        wait_for(lambda: _try_status(d), 5, what="control answers again")
        st = d.status()
        assert stage(d, "control")["state"] == "running" and st["healthy"]


def _try_status(d):
    try:
        return call(d.opts.socket_path, {"cmd": "status"}, timeout=2)
    except Exception:
        return None


def test_watchdog_is_fed_only_while_every_stage_is_alive(tmp_path, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "100000")          # ping every 50 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    sent = []
    tr = FakeTracer()
    now = {"t": 1000.0}
    with inprocess_daemon(tmp_path, RULES, tracer=tr, notify=sent.append) as d:
        wait_for(lambda: sent.count("WATCHDOG=1") >= 2, 5, what="watchdog pings")
        # the tracer hangs inside poll: it stops beating; after its stall time, no more pings
        tracer_stage = next(s for s in d.stages if s.name == "tracer")
        tr.hang.set()
        time.sleep(0)          # let it enter poll
        wait_for(lambda: tr.polls and tracer_stage._last_beat < time.monotonic() - 0.2, 5,
                 what="tracer stuck")
        now["t"] = time.monotonic()
        tracer_stage.clock = lambda: now["t"] + 60          # 60 s later for that stage
        wait_for(lambda: stage(d, "tracer")["state"] == "stalled", 5, what="stalled")
        n = sent.count("WATCHDOG=1")
        time.sleep(0.3)       # six watchdog periods: a fed watchdog would have 6 more pings
        assert sent.count("WATCHDOG=1") == n
        tracer_stage.clock = time.monotonic
        tr.hang.clear()
        tr.release.set()
        wait_for(lambda: sent.count("WATCHDOG=1") > n, 5, what="pings again once alive")


def test_restart_adopts_live_flows_and_names_their_rule(tmp_path):
    live = [flow(key(i, fam)) for i in range(2) for fam in (4, 6, "mapped")]
    ended = flow(key(9, 6))
    # what a crashed daemon left: classes at the right rate, rule unknown
    left = {f.key: Shape("", RATE, RATE) for f in live + [ended]}
    sd = FakeSockDiag()
    sd.flows = {f.key: f for f in live}
    with inprocess_daemon(tmp_path, RULES, factory=FakeFactory(installed=left), sockdiag=sd,
                          tracer_enabled=False) as d:
        wait_for(lambda: shaped(d) == {f.key for f in live}, 5, what="adopted, stale removed")
        st = d.status()
        assert {f["rule"] for f in st["flows"]} == {"web"}
        b = d.supervisor.backend
        assert not [o for o in b.applied if o.kind.value in ("add", "change")]   # no re-add
        m = {(n, tuple(sorted(lab.items()))): v for n, lab, v in daemon_samples(d)}
        assert m[("flowpacer_rule_flows", (("rule", "web"),))] == len(live)


def test_auto_falls_back_to_htb_and_returns_to_psp_on_reload(tmp_path):
    rs = RuleSet("fake0", BackendKind.AUTO, 125_000_000, RULES.rules)
    fac = FakeFactory(psp=True)
    sd = FakeSockDiag()
    f = flow(key(4, 6))
    sd.flows = {f.key: f}
    with inprocess_daemon(tmp_path, rs, factory=fac, sockdiag=sd, tracer_enabled=False) as d:
        wait_for(lambda: shaped(d) == {f.key}, 5, what="shaped on psp")
        assert d.status()["backend"] == "psp"
        psp = d.supervisor.backend
        fac.psp = False                         # module unloaded under us
        psp.setup_error = OSError("no such qdisc kind psp")
        psp.health = BackendHealth.LOST
        wait_for(lambda: d.status()["backend"] == "htb" and shaped(d) == {f.key}, 5,
                 what="fell back to htb with the flow")
        assert d.supervisor.fell_back and psp.closed

        def gauge(name, **labels):
            return [v for n, lab, v in daemon_samples(d)
                    if n == name and labels.items() <= lab.items()]
        assert gauge("flowpacer_backend_fallback") == [1]         # what the alert watches
        assert gauge("flowpacer_class_ids_used", side="send") == [1]
        fac.psp = True
        r = call(d.opts.socket_path, {"cmd": "reload"}, timeout=5)
        assert r["ok"] and r["switched_backend"]
        wait_for(lambda: d.status()["backend"] == "psp" and shaped(d) == {f.key}, 5,
                 what="back on psp")
        assert gauge("flowpacer_backend_fallback") == [0]


def test_reload_with_a_broken_file_changes_nothing(tmp_path):
    from flowpacer.errors import RulesError
    state = {"rs": RULES}

    def load():
        if isinstance(state["rs"], Exception):
            raise state["rs"]
        return state["rs"]
    sd = FakeSockDiag()
    f = flow(key(5, 4))
    sd.flows = {f.key: f}
    with inprocess_daemon(tmp_path, load, sockdiag=sd, tracer_enabled=False) as d:
        wait_for(lambda: shaped(d) == {f.key}, 5, what="shaped")
        state["rs"] = RulesError(["rules.yaml:3:5: rule 'web': rate: bad"])
        r = d.reload()
        assert not r.ok and "rate: bad" in r.errors[0]
        assert shaped(d) == {f.key} and d.status()["counters"]["reloads_failed"] == 1
        state["rs"] = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                              (Rule("web2", Match(process=("nginx",)), RATE * 2),))
        r = d.reload()
        assert r.ok and r.changed == 1
        assert d.supervisor.backend.shape_of(f.key) == Shape("web2", RATE * 2, RATE * 2)


def _lock_free(rec) -> bool:
    """Whether another thread can take the reconciler's lock right now (it is not held)."""
    import threading
    got = []

    def probe():
        got.append(rec.lock.acquire(blocking=False))
        if got[0]:
            rec.lock.release()
    t = threading.Thread(target=probe)
    t.start()
    t.join(5)
    return bool(got and got[0])


def test_reload_reads_the_rules_before_taking_the_reconcilers_lock(tmp_path):
    """The rules file is read and parsed with the lock free: a slow disk or a large file does
    not hold up the reconcile passes (issue 25: no I/O under the reconciler's lock)."""
    free = []
    state = {"reconciler": None}

    def load():
        rec = state["reconciler"]
        if rec is not None:           # at a reload, not at the start
            free.append(_lock_free(rec))
        return RULES
    with inprocess_daemon(tmp_path, load, tracer_enabled=False) as d:
        state["reconciler"] = d.reconciler
        assert d.reload().ok
        state["reconciler"] = None
    assert free == [True]


def test_reload_hands_the_new_rules_to_the_tracer_with_the_lock_free(tmp_path):
    """The tracer's watch filter and UDP timeouts (BPF map writes) follow a reload after the
    reconciler's lock is released, and only after a reload that took (issue 25)."""
    seen = []
    state = {"reconciler": None}

    class Probing(FakeTracer):
        def set_watch(self, comms, uids):
            rec = state["reconciler"]
            if rec is not None:
                seen.append((rec.rules is RULES2, _lock_free(rec)))

    RULES2 = dataclasses.replace(RULES, rules=(Rule("web", Match(process=("nginx",)), 2 * RATE),))
    rules = {"now": RULES}
    with inprocess_daemon(tmp_path, lambda: rules["now"], tracer=Probing()) as d:
        state["reconciler"] = d.reconciler
        rules["now"] = RULES2
        assert d.reload().ok
        state["reconciler"] = None
    assert seen == [(True, True)]      # the new rules in place, the lock free


def test_stage_backoff_doubles_and_gives_up_within_its_window():
    t = {"now": 0.0}
    calls = []
    s = Stage("x", lambda ctx: calls.append(1) or (_ for _ in ()).throw(ValueError("boom")),
              give_up=3, window_s=60, backoff_s=(0.001, 0.004), on_give_up=GiveUp.EXIT,
              clock=lambda: t["now"])
    fatal = []
    s.on_fatal = lambda st, why: fatal.append(why)
    s.run_here()
    assert len(calls) == 3 and s.state is StageState.FAILED and s.failures == 3
    assert fatal and "3 failures" in fatal[0]


# ------------------------------------------------- the receive side (issue 17)

RECV = 1_250_000           # bytes/s
RX_RULES = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                   (Rule("web", Match(process=("nginx",)), RATE, receive_rate_bps=RECV),
                    Rule("plain", Match(process=("other",)), RATE)))


def rx_shaped(d):
    rx = d.supervisor.rx
    return set(rx.installed()) if rx is not None else set()


def test_receive_side_follows_the_rules_and_its_health(tmp_path):
    """A receive backend exists while a rule receives: flows of such a rule get a class on each
    side (status says which), others only a send class; a lost receive side is rebuilt and its
    flows re-applied; a reload without receive_rate tears it down, one with it makes it again."""
    fac, sd = FakeFactory(), FakeSockDiag()
    up, other = flow(key(1, 4)), flow(key(2, 6), comm="other")
    mapped = flow(key(3, "mapped"))
    sd.flows = {f.key: f for f in (up, other, mapped)}
    current = [RX_RULES]
    with inprocess_daemon(tmp_path, lambda: current[0], factory=fac, sockdiag=sd,
                          tracer_enabled=False) as d:
        wait_for(lambda: rx_shaped(d) == {up.key, mapped.key} and len(shaped(d)) == 3, 5,
                 what="send and receive classes")
        assert not fac.rx_cleanups
        rx = d.supervisor.rx
        assert rx.shape_of(up.key) == Shape("web", RECV, RECV)
        st = d.status()
        assert st["receive"] == {"interface": "fpi-fake0", "state": "ok", "problem": ""}
        assert sorted((f["side"], f["rule"]) for f in st["flows"]) == [
            ("receive", "web"), ("receive", "web"), ("send", "plain"), ("send", "web"),
            ("send", "web")]
        m = {(n, tuple(sorted(lab.items()))): v for n, lab, v in daemon_samples(d)}
        sides = {dict(lab)["side"] for (n, lab) in m if n == "flowpacer_flow_sent_bytes_total"}
        assert sides == {"send", "receive"}
        # lost (ifb deleted): rebuilt, its flows applied again
        rebuilt = []

        def setup(orig=rx.setup):
            orig()
            rebuilt.append(1)
            rx.health = BackendHealth.OK          # made again: the fake is in order
        rx.setup = setup
        rx.health = BackendHealth.LOST
        wait_for(lambda: rebuilt and rx_shaped(d) == {up.key, mapped.key}
                 and d.supervisor.rx_health is BackendHealth.OK, 5, what="rebuilt")
        # a reload without receive_rate: the receive side goes
        current[0] = RULES
        assert call(d.opts.socket_path, {"cmd": "reload"}, timeout=5)["ok"]
        assert d.supervisor.rx is None and rx.torn_down and rx.closed
        assert d.status()["receive"] is None
        # and with it again: made, flows applied
        current[0] = RX_RULES
        assert call(d.opts.socket_path, {"cmd": "reload"}, timeout=5)["ok"]
        wait_for(lambda: rx_shaped(d) == {up.key, mapped.key}, 5, what="receive side again")
        assert len(fac.made_rx) == 2 and len(fac.made) == 1


def test_receive_side_that_cannot_be_made_is_retried_and_visible(tmp_path):
    fac, sd = FakeFactory(), FakeSockDiag()
    fac.rx_error = BackendError("create ifb fpi-fake0: Operation not supported")
    up = flow(key(1, 4))
    sd.flows = {up.key: up}
    with inprocess_daemon(tmp_path, RX_RULES, factory=fac, sockdiag=sd,
                          tracer_enabled=False) as d:
        wait_for(lambda: shaped(d) == {up.key}, 5, what="the send side works regardless")
        st = d.status()
        assert st["receive"]["interface"] is None
        assert "Operation not supported" in st["receive"]["problem"]
        fac.rx_error = None
        wait_for(lambda: rx_shaped(d) == {up.key}, 5, what="made at a later pass, flow applied")
        assert d.status()["receive"]["problem"] == ""


def test_no_rule_receives_so_a_left_receive_side_is_removed_at_start(tmp_path):
    fac = FakeFactory()
    with inprocess_daemon(tmp_path, RULES, factory=fac, tracer_enabled=False) as d:
        assert d.supervisor.rx is None and fac.rx_cleanups == ["fake0"] and not fac.made_rx
