"""The typed view and the wiring around it (issue 25, items 5 and 6): the status answer is written
by ``view.to_json`` and read back by ``view.parse_status`` alone (``status`` and ``top``), the
flow source is an enum with its detail, a reload answers with a ``ReloadResult``, control
commands come from a table, and the IPv4-mapped rule is ``FlowKey``'s. A real ``Daemon`` wired
to the in-memory fakes, its real control socket, and the real CLI in a subprocess."""
import ipaddress
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as hs

from flowpacer.surfaces import view as views
from flowpacer.daemon.app import Daemon, Options
from flowpacer.surfaces.control import call, command_handler, dispatch
from flowpacer.errors import FlowpacerError, RulesError
from flowpacer.surfaces.metrics import AddressLabels, address_label
from flowpacer.model import (BackendKind, Direction, EventKind, Flow, FlowEvent, FlowKey,
                             FlowSource, FlowSourceMode, FlowSourceStatus, Match, ProcessInfo,
                             Protocol, ReloadResult, Rule, RuleSet, StageState, TracerStats)
from flowpacer.sources.sockdiag import Snapshot
from harness.testbed import wait_for
from flowpacer.surfaces.top import Tracker, render
from flowpacer.sources.tracer import Tracer
from harness.fakes import FakeFactory, FakeSockDiag, FakeTracer, inprocess_daemon

RATE = 5_000_000
RULES = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                (Rule("web", Match(process=("nginx",), protocol=Protocol.ANY), RATE),))


def _flow(k: FlowKey, comm="nginx") -> Flow:
    return Flow(k, Direction.INBOUND, ProcessInfo(pid=100, comm=comm), FlowSource.TRACER,
                seen_ns=time.monotonic_ns())


KEYS = [
    FlowKey(ipaddress.ip_address("10.1.0.1"), 80, ipaddress.ip_address("10.2.0.1"), 40001),
    FlowKey(ipaddress.ip_address("fd00:1::1"), 80, ipaddress.ip_address("fd00:2::1"), 40002),
    FlowKey.wire("::ffff:10.1.0.1", 8080, "::ffff:10.3.0.1", 41000),
    FlowKey(ipaddress.ip_address("10.1.0.1"), 443, ipaddress.ip_address("10.2.0.9"), 50000,
            Protocol.UDP),
    FlowKey(ipaddress.ip_address("::"), 443, ipaddress.ip_address("fd00:2::9"), 50001,
            Protocol.UDP),
]


# ----------------------------------------------------- the status answer, written and read

def test_status_is_read_back_typed_by_status_and_top(tmp_path):
    tr, sd = FakeTracer(), FakeSockDiag()
    flows = [_flow(k) for k in KEYS]
    sd.flows = {f.key: f for f in flows}
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd) as d:
        tr.push([FlowEvent(EventKind.OPEN, f) for f in flows])
        wait_for(lambda: set(d.supervisor.backend.installed()) == set(KEYS), 5, what="shaped")
        st = call(d.opts.socket_path, {"cmd": "status"}, timeout=5)
        a = views.parse_status(st)
        assert {f.key for f in a.flows} == set(KEYS) and a.shaped_flows == len(KEYS)
        assert {f.rule for f in a.flows} == {"web"} and {f.rate_bit for f in a.flows} == {RATE * 8}
        assert a.flow_source == "tracer (fake) + sock_diag reconcile"
        assert {s.name: s.state for s in a.stages}["tracer"] == StageState.RUNNING.value
        assert st["healthy"] is True
        assert set(st["counters"]) == {"applies", "op_errors", "reloads_ok", "reloads_failed",
                                       "backend_rebuild_failures", "shape_latency_us",
                                       "apply_latency_us", "reconcile_added",
                                       "reconcile_removed", "spares_made", "spare_errors",
                                       "events"}
        ev = st["counters"]["events"]
        assert ev["tracer_open"] + ev["reconcile_open"] == len(KEYS)      # whichever was first
        assert set(st["counters"]["events"]) == {"tracer_open", "tracer_close", "reconcile_open",
                                                 "reconcile_close", "idle_close"}
        assert st["counters"]["applies"] >= 1 and "n" in st["counters"]["shape_latency_us"]
        assert st["tracer"]["lost"] == 0 and st["tracer"]["udp"]["adopted"] == 0
        # top's rows show each key as FlowKey writes it
        v = Tracker(d.opts.socket_path, 1.0).update(st, 1.0)
        assert {f"{r.local}->{r.remote}" for r in v.rows} == {str(k) for k in KEYS}
        assert any(r.remote.endswith("/udp") for r in v.rows)
        text = "\n".join(t for _s, t in render(v, 200, 40))
        assert "[fd00:2::9]:50001/udp" in text and "10.3.0.1:41000" in text   # mapped: IPv4
        # the CLI's table, from the same typed answer
        out = subprocess.run([sys.executable, "-m", "flowpacer", "status", "--socket",
                              d.opts.socket_path], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        for k in KEYS:
            assert k.remote_endpoint in out.stdout and k.local_endpoint in out.stdout
        assert "source: tracer (fake) + sock_diag reconcile" in out.stdout
        assert f"link {1_000_000_000 / 1e9:.3g} Gbit/s" in out.stdout
        assert "udp" in out.stdout and "Traceback" not in out.stderr


json_values = hs.recursive(
    hs.none() | hs.booleans() | hs.integers() | hs.floats(allow_nan=False) | hs.text(max_size=8),
    lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(hs.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
flow_fields = hs.fixed_dictionaries({}, optional={
    "local": hs.sampled_from(["1.2.3.4:80", "[::1]:5", "x", "1.2.3.4:99999"]) | json_values,
    "remote": hs.sampled_from(["5.6.7.8:9", "[fd00::2]:7", ":"]) | json_values,
    "protocol": hs.sampled_from(["tcp", "udp", "any", "sctp"]) | json_values,
    "side": hs.sampled_from(["send", "receive", "up"]) | json_values,
    "rate_bit": json_values, "bytes": json_values, "rule": json_values, "pid": json_values})


@settings(max_examples=300, deadline=None)
@given(hs.fixed_dictionaries({}, optional={
    "flows": hs.lists(flow_fields, max_size=3) | json_values, "stages": json_values,
    "receive": json_values, "first_byte": json_values, "counters": json_values,
    "link_rate_bit": json_values, "backend": json_values}) | json_values)
def test_any_other_answer_is_one_value_error(st):
    """A daemon of another version or a broken answer: ``status`` and ``top`` say so, never a
    traceback (ValueError is the only way ``parse_status`` fails)."""
    try:
        a = views.parse_status(st)
    except ValueError:
        return
    for f in a.flows:
        assert isinstance(f.key, FlowKey) and isinstance(f.bytes, int)


@given(hs.sampled_from([4, 6]), hs.integers(0, 2**32 - 1), hs.integers(0, 65535),
       hs.integers(0, 2**32 - 1), hs.integers(0, 65535), hs.sampled_from([Protocol.TCP,
                                                                        Protocol.UDP]))
def test_flow_key_text_is_read_back(fam, a, p, b, q, proto):
    ip = ipaddress.IPv4Address if fam == 4 else (lambda n: ipaddress.IPv6Address(n << 96 | 1))
    k = FlowKey(ip(a), p, ip(b), q, proto)
    assert FlowKey.parse(k.local_endpoint, k.remote_endpoint, proto.value) == k
    assert "->".join(k.endpoints()) == str(k)


# ----------------------------------------------------------------- typed parts of the view

def test_flow_source_texts():
    """The flow_source text of each mode (tests, docs and operators read these)."""
    S, M = FlowSourceStatus, FlowSourceMode
    assert S(M.TRACER, "tracepoints+cgroup udp").text == \
        "tracer (tracepoints+cgroup udp) + sock_diag reconcile"
    assert S(M.TRACER).text == "tracer (tracepoints) + sock_diag reconcile"
    assert S(M.TRACER, "tp", "rules shaped from the first byte: a").text == \
        "tracer (tp) + sock_diag reconcile; rules shaped from the first byte: a"
    assert S(M.NO_TRACER).text == "sock_diag polling only (--no-tracer)"
    assert S(M.TRACER_CANNOT_LOAD, "No module named 'bcc'").text == \
        "sock_diag polling only (tracer cannot load: No module named 'bcc')"
    assert S(M.TRACER_UNAVAILABLE, "EPERM").text == \
        "sock_diag polling only (tracer unavailable: EPERM)"
    assert S(M.TRACER_FAILED, "5 failures").text == \
        "sock_diag polling only (tracer failed: 5 failures)"
    assert [m for m in M if not S(m, "x").text] == []
    assert not S(M.TRACER).polling and S(M.TRACER_FAILED).polling


def test_tracer_stats_keep_the_status_names():
    raw = {"hooks": "tp", "events": {"open": 3, "close": 2}, "lost": 1, "unattributed": 4,
           "filtered": 5, "accept_untracked": 6, "missed": 7, "late_open_dropped": 8,
           "udp": {"idle": 1, "released": 2, "forgotten": 3, "woken": 4, "adopted": 5,
                   "peers": 6, "connected": 7},
           "bad_records": 9, "programs": {"sock:inet_sock_set_state": {
               "run_time_ns": 10, "run_cnt": 2, "recursion_misses": 0}, "syscalls:x": {}}}
    t = TracerStats.from_stats(raw)
    assert t.udp.adopted == 5 and t.opens == 3 and t.programs[0].run_cnt == 2
    assert views._tracer_json(t) == raw
    assert TracerStats.from_stats({"lost": 0, "unattributed": 0}) == TracerStats()


def test_reload_answers_keep_their_json(tmp_path):
    state = {"rs": RULES}

    def load():
        if isinstance(state["rs"], Exception):
            raise state["rs"]
        return state["rs"]
    with inprocess_daemon(tmp_path, load, tracer_enabled=False) as d:
        r = call(d.opts.socket_path, {"cmd": "reload"}, timeout=5)
        assert r == {"ok": True, "rules_changed": False, "switched_backend": False,
                     "added": 0, "changed": 0, "removed": 0, "errors": []}
        state["rs"] = RulesError(["rules.yaml:3:5: rule 'web': rate: bad"])
        r = call(d.opts.socket_path, {"cmd": "reload"}, timeout=5)
        assert r == {"ok": False, "errors": ["rules.yaml:3:5: rule 'web': rate: bad"]}
        assert isinstance(d.reload(), ReloadResult)
        assert views.parse_reload(views.reload_json(d.reload())) == d.reload()
        with pytest.raises(ValueError):
            views.parse_reload({"errors": "x"})
        assert call(d.opts.socket_path, {"cmd": "ping"}, timeout=5) == {"ok": True}
        with pytest.raises(FlowpacerError, match="unknown command 'nope'"):
            call(d.opts.socket_path, {"cmd": "nope"}, timeout=5)


def test_the_command_table():
    def boom(req):
        raise FlowpacerError("no backend")
    table = {"ping": lambda req: {"ok": True}, "bad": boom}
    assert dispatch(table, {"cmd": "ping"}) == {"ok": True}
    assert dispatch(table, {"cmd": "bad"}) == {"error": "no backend"}
    assert dispatch(table, {"cmd": ["ping"]}) == {"error": "unknown command ['ping']"}
    assert dispatch(table, {}) == {"error": "unknown command None"}
    h = command_handler(table)
    table.clear()                      # the handler keeps its own table
    assert h({"cmd": "ping"}) == {"ok": True}


# ------------------------------------------------------------------- wiring (app only wires)

class _AdoptingTracer(FakeTracer):
    def __init__(self):
        super().__init__()
        self.adopted = []

    def adopt_udp_connected(self, by_cookie):
        self.adopted.append(dict(by_cookie))


class _UdpSockDiag(FakeSockDiag):
    def snapshot(self):
        snap = Snapshot(super().snapshot())
        snap.udp_cookies = {k: 1000 + i for i, k in enumerate(snap) if k.protocol is Protocol.UDP}
        return snap


def test_udp_adoption_is_the_reconcilers(tmp_path):
    """Connected UDP sockets a rule shapes go to the tracer by cookie at each reconcile pass
    (issue 17); those no rule shapes do not; without a tracer nothing is adopted."""
    tr, sd = _AdoptingTracer(), _UdpSockDiag()
    udp = [k for k in KEYS if k.protocol is Protocol.UDP]
    sd.flows = {k: _flow(k) for k in udp}
    sd.flows[KEYS[0]] = _flow(KEYS[0])
    other = FlowKey(ipaddress.ip_address("10.1.0.1"), 53, ipaddress.ip_address("10.2.0.3"), 53,
                    Protocol.UDP)
    sd.flows[other] = _flow(other, comm="named")
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd) as d:
        wait_for(lambda: tr.adopted, 5, what="an adoption")
        cookies = tr.adopted[-1]
        assert {f.key for f in cookies.values()} == set(udp)
        assert d.reconciler.udp_adopter is not None
    assert set(cookies) <= {1000 + i for i in range(len(sd.flows))}


def test_the_first_byte_switch_is_an_option(tmp_path):
    made = []

    def firstbyte_factory():
        made.append(1)
        raise OSError("not in this test")
    rules = tmp_path / "rules.yaml"
    opts = Options(rules_path=str(rules), socket_path=str(tmp_path / "ctl.sock"),
                   metrics_listen=None, first_byte=False)
    d = Daemon(opts, backend_factory=FakeFactory(), sockdiag=FakeSockDiag(),
               tracer_factory=FakeTracer, load=lambda p: RULES, notify=lambda s: None,
               firstbyte_factory=firstbyte_factory)
    try:
        d.start()
        fb = next(s for s in d.stages if s.name == "firstbyte")
        assert fb.view().state is StageState.DISABLED and made == []
    finally:
        d.shutdown()
    d = Daemon(Options(rules_path=str(rules), socket_path=str(tmp_path / "ctl2.sock"),
                       metrics_listen=None),
               backend_factory=FakeFactory(), sockdiag=FakeSockDiag(), tracer_factory=FakeTracer,
               load=lambda p: RULES, notify=lambda s: None, firstbyte_factory=firstbyte_factory)
    try:
        d.start()
        fb = next(s for s in d.stages if s.name == "firstbyte")
        assert made == [1] and "unavailable: not in this test" in fb.view().detail
    finally:
        d.shutdown()


def test_the_rules_loader_checks_access(tmp_path):
    from flowpacer.policy import rules
    f = tmp_path / "rules.yaml"
    f.write_text("interface: lo\nrules:\n  - {name: a, match: {process: a}, rate: 8mbit}\n")
    f.chmod(0o666)
    with pytest.raises(FlowpacerError, match="writable by group or others"):
        rules.load_checked(str(f))
    with pytest.raises(FlowpacerError, match="cannot read"):
        rules.load_checked(str(tmp_path / "missing.yaml"))


# ----------------------------------------------------------- the IPv4-mapped rule: FlowKey's

def test_every_reader_of_kernel_addresses_uses_flow_keys_rule():
    mapped_l = ipaddress.IPv6Address("::ffff:10.1.0.1").packed
    mapped_r = ipaddress.IPv6Address("::ffff:10.3.0.7").packed
    plain_r = ipaddress.IPv6Address("fd00::7").packed
    any6 = ipaddress.IPv6Address("::").packed
    AF_INET6 = 10
    for la, ra in ((mapped_l, mapped_r), (mapped_l, plain_r), (any6, mapped_r), (any6, plain_r)):
        got = Tracer._key(AF_INET6, la, 1, ra, 2, Protocol.UDP)
        assert got == FlowKey.wire(ipaddress.IPv6Address(la), 1, ipaddress.IPv6Address(ra), 2,
                                   Protocol.UDP)
    assert str(Tracer._key(AF_INET6, mapped_l, 1, mapped_r, 2, Protocol.TCP)) == \
        "10.1.0.1:1->10.3.0.7:2"
    assert address_label("::ffff:10.1.2.3", AddressLabels.PREFIX) == "10.1.2.0/24"
    assert address_label(ipaddress.ip_address("::ffff:10.1.2.3"), AddressLabels.PREFIX) == \
        address_label("10.1.2.3", AddressLabels.PREFIX)
