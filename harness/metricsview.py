"""Daemon views made of plain values, for the tests of what reads them (metrics, docs, alerts)."""
import ipaddress

from flowpacer.model import (BackendHealth, DaemonCounters, DaemonView, Direction, EventCounts,
                             FlowKey, FlowSource, FlowSourceMode, FlowSourceStatus, FlowView,
                             Histogram, InterfaceView, Side, StageState, StageView,
                             TracerStats)
from flowpacer.kernel.backend.handles import FLOW_CLASS_IDS
from flowpacer.daemon.latency import LatencyHistogram


def flow_view(i, rule="r", rate=1000, process="srv\n\x1b[31m"):
    """Flow ``i`` of rule ``rule``: 10.0.0.1:80 <- 10.0.0.2:(1000 + i), inbound, by the tracer
    (the default process name carries control characters, as a hostile process may)."""
    k = FlowKey(ipaddress.ip_address("10.0.0.1"), 80, ipaddress.ip_address("10.0.0.2"), 1000 + i)
    return FlowView(k, f"f1f0:{0x10 + i:x}", rule, rate, rate, 1, process, 0, Direction.INBOUND,
                    FlowSource.TRACER)


def daemon_view(flows, **kw):
    """A healthy htb daemon on eth0 with rules r and s shaping ``flows``; ``kw`` replaces any
    field (``counters`` updates the counters)."""
    h = LatencyHistogram()
    h.observe(0.0003)
    buckets, total = h.cumulative()
    counters = dict(applies=1, op_errors=0, reloads_ok=1, reloads_failed=0,
                    backend_rebuild_failures=0, apply_hist=Histogram(tuple(buckets), total))
    counters.update(kw.pop("counters", {}))
    v = dict(backend="htb", backend_reason="", interface="eth0",
             backend_health=BackendHealth.OK, backend_problem="", link_rate_bps=125_000_000,
             rules_path="/r.yaml", rule_names=("r", "s"),
             flow_source=FlowSourceStatus(FlowSourceMode.TRACER),
             tracer=TracerStats(lost=0, unattributed=0), live_flows=len(flows), flows=tuple(flows),
             stages=(StageView("main", StageState.RUNNING), StageView("tracer", StageState.RUNNING)),
             counters=DaemonCounters(**counters), events=EventCounts(tracer_open=3))
    v.update(kw)
    if "interfaces" not in v:        # a built view has its interfaces: here eth0 with an htb
        #                              backend's class ids
        v["interfaces"] = (InterfaceView(
            v["interface"], v["backend"], v["backend_health"], v["backend_problem"],
            v["link_rate_bps"], sum(f.side is Side.SEND for f in v["flows"]),
            groups=len(v.get("groups", ())), class_id_limit=FLOW_CLASS_IDS),)
    return DaemonView(**v)


def daemon_samples(d):
    """(name, labels, value) of every sample the daemon ``d`` (an in-process ``app.Daemon``)
    exposes: its view and class statistics through the real collector and exposition."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from flowpacer.surfaces.metrics import FlowpacerCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FlowpacerCollector(d.view, d._class_stats))
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            yield s.name, s.labels, s.value
