"""The flow sources' contracts (flowpacer/sources/contract.py): the real tracer and sock_diag
source and the test kit's stand-ins declare every member the daemon uses, and the daemon calls
them as declared, without probing (issue 25)."""
import ipaddress
import time

from flowpacer.kernel.backend.contract import members, missing_members
from flowpacer.model import (BackendKind, Direction, Flow, FlowKey, FlowSource, Match,
                             ProcessInfo, Protocol, Rule, RuleSet)
from flowpacer.policy import engine
from flowpacer.sources.contract import FlowTracer, Snapshot, SnapshotSource
from flowpacer.sources.sockdiag import SockDiagSource
from flowpacer.sources.tracer import Tracer
from harness.fakes import FakeSockDiag, FakeTracer, inprocess_daemon
from harness.testbed import wait_for

RULES = RuleSet("fake0", BackendKind.HTB, 125_000_000,
                (Rule("web", Match(process=("nginx",), protocol=Protocol.ANY), 5_000_000),))


def test_the_contracts_name_what_the_daemon_uses():
    assert {"hooks", "set_watch", "set_udp_idle", "start", "poll", "adopt_udp_connected",
            "stats", "close"} <= set(members(FlowTracer))
    assert members(SnapshotSource) == ["snapshot"]


def test_real_sources_and_stand_ins_keep_them():
    for klass in (Tracer, FakeTracer):
        assert missing_members(klass, FlowTracer) == [], klass
    for klass in (SockDiagSource, FakeSockDiag):
        assert missing_members(klass, SnapshotSource) == [], klass
    assert isinstance(FakeSockDiag().snapshot(), Snapshot)


def test_the_tracer_stage_gives_the_rules_udp_timeouts_and_the_reconciler_adopts(tmp_path):
    """At start the tracer gets the rules' UDP idle timeouts; the connected UDP sockets of a
    sock_diag snapshot that a rule shapes are handed to it by cookie."""
    tr = FakeTracer()
    key = FlowKey(ipaddress.ip_address("10.1.0.1"), 443, ipaddress.ip_address("10.2.0.9"),
                  50000, Protocol.UDP)
    flow = Flow(key, Direction.INBOUND, ProcessInfo(pid=100, comm="nginx"), FlowSource.RECONCILE,
                seen_ns=time.monotonic_ns())

    class WithCookies(FakeSockDiag):
        def snapshot(self):
            snap = super().snapshot()
            snap.udp_cookies = {key: 4242}
            return snap

    sd = WithCookies()
    sd.flows = {key: flow}
    with inprocess_daemon(tmp_path, RULES, tracer=tr, sockdiag=sd):
        wait_for(lambda: tr.udp_idle is not None and tr.adopted_udp, 5, what="timeouts and adoption")
    assert tr.udp_idle == engine.udp_idle_timeouts(RULES)
    assert tr.adopted_udp[0] == {4242: flow}
