"""Prometheus metrics: collector logic with plain values, the endpoint of a real daemon, and a
real Prometheus server scraping it."""
import dataclasses
import ipaddress
import json
import shutil
import subprocess
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowpacer.surfaces import metrics
from flowpacer.surfaces.metrics import FlowpacerCollector
from flowpacer.model import ClassStats, Direction, FlowKey, FlowSource, FlowView, Side
from harness.testbed import client_argv, in_netns, server_argv, wait_for

from harness.daemon import Daemon
from harness.metricsview import daemon_view as _view, flow_view as _flow


def scrape(collector):
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    text = generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples, name, **labels):
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_collector_bounds_series_and_counts_overflow():
    flows = [_flow(i) for i in range(10)]
    stats = {f.stats_key("eth0"): ClassStats(bytes=100, packets=1) for f in flows}
    c = FlowpacerCollector(lambda: _view(flows), lambda: stats, max_flow_series=4, addresses="full")
    m = scrape(c)
    assert len(m["flowpacer_flow_sent_bytes_total"]) == 4
    assert value(m, "flowpacer_flow_series_overflow") == 6
    assert value(m, "flowpacer_rule_flows", rule="r") == 10           # totals include all flows
    assert value(m, "flowpacer_rule_sent_bytes_total", rule="r") == 1000
    assert value(m, "flowpacer_rule_flows", rule="s") == 0
    # untrusted process names: control characters (newline, ESC) replaced by their \xNN text
    assert m["flowpacer_flow_sent_bytes_total"][0].labels["process"] == "srv\\x0a\\x1b[31m"


def test_rule_totals_are_counters_across_flow_ends_and_rule_changes():
    flows = [_flow(0), _flow(1)]
    stats = {f.stats_key("eth0"): ClassStats(bytes=500) for f in flows}
    view = {"v": _view(flows)}
    c = FlowpacerCollector(lambda: view["v"], lambda: stats)
    assert value(scrape(c), "flowpacer_rule_sent_bytes_total", rule="r") == 1000
    # flow 1 ends; flow 0 moves to rule s (reload) and sends 200 more
    moved = dataclasses.replace(flows[0], rule="s")
    stats[moved.stats_key("eth0")] = ClassStats(bytes=700)
    view["v"] = _view([moved])
    m = scrape(c)
    assert value(m, "flowpacer_rule_sent_bytes_total", rule="r") == 1000     # kept
    assert value(m, "flowpacer_rule_sent_bytes_total", rule="s") == 200      # only what came after
    assert value(m, "flowpacer_apply_duration_seconds_count") == 1


def _client_flow(i, net="198.51.100", port=80, direction=Direction.INBOUND, **kw):
    k = FlowKey(ipaddress.ip_address("10.0.0.1"), port, ipaddress.ip_address(f"{net}.{i}"),
                40000 + i)
    return FlowView(k, f"f1f0:{0x10 + i:x}", "r", 1000, 1000, 1, "srv", 0, direction,
                    FlowSource.TRACER, **kw)


def test_defaults_follow_the_cardinality_advice():
    """By default (the daemon's options, the collector's) no series names a client's address or
    its ephemeral port: new connections from a known network add no series. IPv4, IPv6 and
    IPv4-mapped clients of one network share their series."""
    from flowpacer.daemon.app import Options
    from flowpacer.surfaces.cli import run
    opt = {p.name: p.default for p in run.params}
    assert opt["metrics_addresses"] == Options("r").metrics_addresses == metrics.DEFAULT_ADDRESSES \
        == "prefix"
    assert opt["metrics_max_flows"] == Options("r").max_flow_series == metrics.DEFAULT_MAX_FLOW_SERIES
    flows = [_client_flow(i) for i in range(1, 30)]
    mapped = FlowKey(ipaddress.ip_address("::ffff:10.0.0.1"), 80,
                     ipaddress.ip_address("::ffff:198.51.100.200"), 50000)
    flows.append(dataclasses.replace(flows[0], key=mapped))
    v6 = [_client_flow(i) for i in (1, 2)]
    v6 = [dataclasses.replace(f, key=FlowKey(ipaddress.ip_address("2001:db8::1"), 80,
                                             ipaddress.ip_address(f"2001:db8:7:1::{i}"), 41000 + i))
          for i, f in enumerate(v6)]
    flows += v6
    stats = {f.stats_key("eth0"): ClassStats(bytes=10, packets=1) for f in flows}
    c = FlowpacerCollector(lambda: _view(flows), lambda: stats)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(c)
    text = generate_latest(reg).decode()
    m = scrape(c)
    sent = m["flowpacer_flow_sent_bytes_total"]
    assert sorted((s.labels["remote_address"], s.labels["remote_port"], s.labels["local_port"],
                   s.value) for s in sent) == [("198.51.100.0/24", "", "80", 300.0),
                                               ("2001:db8:7::/48", "", "80", 20.0)]
    assert "198.51.100.7" not in text and "40007" not in text and "2001:db8:7:1::" not in text
    assert value(m, "flowpacer_rule_flows", rule="r") == 32


def test_send_and_receive_are_counted_apart():
    """A flow shaped both ways (rate and receive_rate) is one flow; its received bytes are in
    the rule's received totals only, never in flowpacer_rule_sent_bytes_total."""
    both = _client_flow(1)
    recv = dataclasses.replace(both, side=Side.RECEIVE)
    only_send = _client_flow(2)
    stats = {both.stats_key("eth0"): ClassStats(bytes=1000, packets=10, drops=1),
             recv.stats_key("eth0"): ClassStats(bytes=70, packets=7, drops=2),
             only_send.stats_key("eth0"): ClassStats(bytes=500, packets=5)}
    view = {"v": _view([both, recv, only_send])}
    c = FlowpacerCollector(lambda: view["v"], lambda: stats)
    m = scrape(c)
    assert value(m, "flowpacer_rule_flows", rule="r") == 2
    assert value(m, "flowpacer_flows", state="shaped") == 2
    assert value(m, "flowpacer_rule_sent_bytes_total", rule="r") == 1500
    assert value(m, "flowpacer_rule_sent_packets_total", rule="r") == 15
    assert value(m, "flowpacer_rule_dropped_packets_total", rule="r") == 1
    assert value(m, "flowpacer_rule_received_bytes_total", rule="r") == 70
    assert value(m, "flowpacer_rule_received_packets_total", rule="r") == 7
    assert value(m, "flowpacer_rule_receive_dropped_packets_total", rule="r") == 2
    assert value(m, "flowpacer_rule_received_bytes_total", rule="s") == 0     # every rule
    # the flow ends: both sides' totals keep what was counted, each on its own side
    view["v"] = _view([only_send])
    m = scrape(c)
    assert value(m, "flowpacer_rule_sent_bytes_total", rule="r") == 1500
    assert value(m, "flowpacer_rule_received_bytes_total", rule="r") == 70
    assert value(m, "flowpacer_rule_flows", rule="r") == 1


def test_the_class_id_limit_is_each_backends_declaration():
    """flowpacer_class_ids_limit is what each interface's backend declares
    (``Capabilities.class_ids``, carried by ``InterfaceView.class_id_limit``): metrics know no
    class id of their own; an interface without a backend now has no limit."""
    from flowpacer.model import BackendHealth, InterfaceView
    ifaces = (InterfaceView("eth0", "htb", BackendHealth.OK, "", 1000, 0, class_id_limit=7),
              InterfaceView("eth1", "", BackendHealth.GONE, "gone", 0, 0))
    m = scrape(FlowpacerCollector(lambda: _view([], interfaces=ifaces), dict))
    assert [(s.labels, s.value) for s in m["flowpacer_class_ids_limit"]] == [
        ({"interface": "eth0"}, 7)]
    assert value(m, "flowpacer_class_ids_used", interface="eth1", side="send") == 0


def test_flow_source_degraded_is_the_flow_source_mode():
    """flowpacer_flow_source_degraded is 1 exactly in the modes that poll sock_diag only, read
    from the view's typed flow source, whatever the stages are called or say."""
    from flowpacer.model import FlowSourceMode, FlowSourceStatus, StageState, StageView
    for mode in FlowSourceMode:
        for tracer in (StageState.RUNNING, StageState.RESTARTING, None):
            stages = (StageView("main", StageState.RUNNING),) + (
                (StageView("tracer", tracer),) if tracer else ())
            m = scrape(FlowpacerCollector(lambda: _view(
                [], flow_source=FlowSourceStatus(mode, "why"), stages=stages), dict))
            want = 1 if mode in (FlowSourceMode.NO_TRACER, FlowSourceMode.TRACER_CANNOT_LOAD,
                                 FlowSourceMode.TRACER_UNAVAILABLE,
                                 FlowSourceMode.TRACER_FAILED) else 0
            assert value(m, "flowpacer_flow_source_degraded") == want, (mode, tracer)


def test_build_info():
    from importlib import metadata
    import platform
    m = scrape(FlowpacerCollector(lambda: _view([]), dict))
    (s,) = m["flowpacer_build_info"]
    assert s.value == 1 and s.labels == {"version": metadata.version("flowpacer"),
                                         "python": platform.python_version()}


@pytest.mark.kernel
def test_daemon_endpoint_serves_flows_and_only_metrics(testbed, tmp_path):
    from harness.daemon import RULES
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES, "--metrics-addresses", "full").start()
    try:
        c = testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 4, local_port=46001),
                          stdout=subprocess.PIPE, text=True)
        wait_for(lambda: d.flows(), 5, 0.05, "a shaped flow")

        def get(path):
            with in_netns(testbed.server_ns):
                return urllib.request.urlopen(f"http://127.0.0.1:9717{path}", timeout=5)

        def sent():
            text = get("/metrics").read().decode()
            fams = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "flowpacer_flow_sent_bytes_total"}
            s = fams.get("flowpacer_flow_sent_bytes_total")
            return s if s and s.value > 0 else None
        s = wait_for(sent, 5, 0.1, "flow bytes in the metrics")
        assert s.labels == {"rule": "slow", "process": "fp-test-srv", "direction": "inbound",
                            "local_address": str(testbed.server_v4), "local_port": "9101",
                            "remote_address": str(testbed.client_v4), "remote_port": "46001",
                            "protocol": "tcp", "side": "send",
                            "interface": testbed.server_if}
        for bad in ("/", "/admin", "/metrics/../etc/passwd"):
            with pytest.raises(urllib.error.HTTPError) as e:
                get(bad)
            assert e.value.code == 404
        c.communicate(timeout=30)
    finally:
        d.stop()


@pytest.mark.kernel
def test_prometheus_rate_matches_rule(testbed, tmp_path):
    """A real Prometheus scrapes the daemon every second; rate() of a shaped flow is within 5 %
    of its rule's rate."""
    prom = shutil.which("prometheus")
    assert prom, "Debian's prometheus package is needed (make deps installs it)"
    from harness.daemon import RULES
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES.replace("rate: 10mbit", "rate: 20mbit")).start()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(textwrap.dedent("""\
        global: {scrape_interval: 1s, evaluation_interval: 1s}
        scrape_configs:
          - job_name: flowpacer
            static_configs: [{targets: ["127.0.0.1:9717"]}]
        """))
    testbed.popen(testbed.server_ns, [prom, f"--config.file={cfg}",
                                      f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                      "--web.listen-address=127.0.0.1:9090"],
                  stderr=open(tmp_path / "prom.log", "w"))

    def query(q):
        url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with in_netns(testbed.server_ns):
                r = json.load(urllib.request.urlopen(url, timeout=5))
        except (OSError, ValueError):
            return None
        return r["data"]["result"] if r.get("status") == "success" else None
    try:
        wait_for(lambda: query("up") , 30, 0.2, "prometheus to answer")
        c = testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 14),
                          stdout=subprocess.PIPE, text=True)
        q = 'rate(flowpacer_flow_sent_bytes_total{rule="slow"}[6s])'

        def steady():
            res = query(q)
            return res and float(res[0]["value"][1]) > 0 and time.monotonic() - t0 > 9 and res
        t0 = time.monotonic()
        res = wait_for(steady, 20, 0.5, "a rate from prometheus")
        got = float(res[0]["value"][1])
        assert got == pytest.approx(20e6 / 8, rel=0.05)
        assert query('flowpacer_info{backend="htb"}')
        c.communicate(timeout=30)
    finally:
        d.stop()
