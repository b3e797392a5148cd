"""The alerting rules (docs/flowpacer-alerts.yml, issue 28 item 6): valid for `promtool check
rules`, each alert fires on the condition it names and not on a healthy daemon (`promtool test
rules` with made-up series), only metrics the daemon exports, and `promtool check metrics` on a
real scrape of a running daemon."""
import ipaddress
import os
import shutil
import subprocess
import urllib.request

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowpacer.surfaces.metrics import FlowpacerCollector
from harness.testbed import client_argv, in_netns, server_argv, wait_for
from harness.metricsview import daemon_view as _view, flow_view as _flow
from harness.promql import promql_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALERTS = os.path.join(ROOT, "docs", "flowpacer-alerts.yml")
WANTED = {"FlowpacerDown", "FlowpacerNotShaping", "FlowpacerStageFailing",
          "FlowpacerFlowSourceDegraded", "FlowpacerBackendFellBack",
          "FlowpacerClassSpaceNearlyFull", "FlowpacerNetlinkErrors"}


def promtool():
    p = shutil.which("promtool")
    if p is None:
        if os.environ.get("FLOWPACER_CHECK"):
            pytest.skip("promtool (Debian's prometheus) is make test's: make deps installs it")
        pytest.fail("promtool not found: make deps installs Debian's prometheus")
    return p


def rules():
    doc = yaml.safe_load(open(ALERTS))
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    out = subprocess.run([promtool(), "check", "rules", ALERTS], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(WANTED)} rules found" in out.stdout
    assert {r["alert"] for r in rules()} == WANTED


def test_alerts_use_only_exported_metrics():
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FlowpacerCollector(lambda: _view([_flow(0)]), dict))
    exported = {line.split("{")[0].split(" ")[0] for line in generate_latest(reg).decode().splitlines()
                if line and not line.startswith("#")}
    for r in rules():
        metrics, _labels = promql_names(r["expr"])
        assert metrics and metrics <= exported | {"up"}, (r["alert"], metrics - exported)


def _series(name, labels, values):
    lab = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


def _alert(name, at, *labelsets, severity="warning"):
    return {"eval_time": at, "alertname": name,
            "exp_alerts": [{"exp_labels": {"severity": severity, **ls}} for ls in labelsets]}


def test_each_alert_fires_on_its_condition_only(tmp_path):
    """Instance a is sick in the way each alert names, instance b healthy (or sick in a way the
    alert must not name): every alert fires for a, none for b."""
    bare = yaml.safe_load(open(ALERTS))
    for g in bare["groups"]:          # annotations are templates: checked by check rules
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(bare))
    A = {"job": "flowpacer", "instance": "a"}
    B = {"job": "flowpacer", "instance": "b"}
    S = "flowpacer_stage_state"
    series = [
        _series("up", A, "0x30"), _series("up", B, "1x30"),
        # per interface (issue 29): a's eth1 lost its qdisc, its eth0 is fine
        _series("flowpacer_backend_state", {**A, "interface": "eth1", "state": "ok"}, "0x30"),
        _series("flowpacer_backend_state", {**A, "interface": "eth1", "state": "lost"}, "1x30"),
        _series("flowpacer_backend_state", {**A, "interface": "eth0", "state": "ok"}, "1x30"),
        _series("flowpacer_backend_state", {**A, "interface": "eth0", "state": "lost"}, "0x30"),
        _series("flowpacer_backend_state", {**B, "interface": "eth0", "state": "ok"}, "1x30"),
        # a: the tracer keeps failing and restarting; main gave up (failed, no new failure)
        _series("flowpacer_stage_failures_total", {**A, "stage": "tracer"}, "0+1x30"),
        _series(S, {**A, "stage": "tracer", "state": "running"}, "0x30"),
        _series(S, {**A, "stage": "tracer", "state": "restarting"}, "1x30"),
        _series("flowpacer_stage_failures_total", {**A, "stage": "main"}, "3x30"),
        _series(S, {**A, "stage": "main", "state": "failed"}, "1x30"),
        _series(S, {**A, "stage": "main", "state": "running"}, "0x30"),
        # b: the tracer failed once and runs again
        _series("flowpacer_stage_failures_total", {**B, "stage": "tracer"}, "0 1x29"),
        _series(S, {**B, "stage": "tracer", "state": "running"}, "1x30"),
        _series(S, {**B, "stage": "tracer", "state": "failed"}, "0x30"),
        _series("flowpacer_flow_source_degraded", A, "1x30"),
        _series("flowpacer_flow_source_degraded", B, "0x30"),
        _series("flowpacer_backend_fallback", A, "1x30"),
        _series("flowpacer_backend_fallback", B, "0x30"),
        _series("flowpacer_class_ids_used", {**A, "interface": "eth0", "side": "send"},
                "45000x30"),
        _series("flowpacer_class_ids_used", {**A, "interface": "eth0", "side": "receive"},
                "10x30"),
        _series("flowpacer_class_ids_limit", {**A, "interface": "eth0"}, "49136x30"),
        _series("flowpacer_class_ids_used", {**A, "interface": "eth1", "side": "send"},
                "40000x30"),
        _series("flowpacer_class_ids_limit", {**A, "interface": "eth1"}, "49136x30"),
        _series("flowpacer_class_ids_used", {**B, "interface": "eth0", "side": "send"},
                "40000x30"),
        _series("flowpacer_class_ids_limit", {**B, "interface": "eth0"}, "49136x30"),
        _series("flowpacer_netlink_errors_total", A, "0+2x30"),
        _series("flowpacer_netlink_errors_total", B, "5x30"),
    ]
    at = "25m"
    test = {"rule_files": [str(tmp_path / "alerts.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                _alert("FlowpacerDown", at, A, severity="critical"),
                _alert("FlowpacerNotShaping", at, {**A, "interface": "eth1", "state": "ok"},
                       severity="critical"),
                _alert("FlowpacerStageFailing", at, {**A, "stage": "tracer"},
                       {**A, "stage": "main", "state": "failed"}),
                _alert("FlowpacerFlowSourceDegraded", at, A),
                _alert("FlowpacerBackendFellBack", at, A),
                _alert("FlowpacerClassSpaceNearlyFull", at,
                       {**A, "interface": "eth0", "side": "send"}),
                _alert("FlowpacerNetlinkErrors", at, A),
                # not yet: each waits its `for`
                {"eval_time": "1m", "alertname": "FlowpacerNotShaping", "exp_alerts": []},
            ]}, {
                # no target at all: absent(up) fires
                "interval": "1m", "input_series": [_series("flowpacer_flow_source_degraded", A, "0x10")],
                "alert_rule_test": [_alert("FlowpacerDown", "5m", {"job": "flowpacer"},
                                           severity="critical")]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    out = subprocess.run([promtool(), "test", "rules", str(tmp_path / "test.yml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.kernel
def test_promtool_check_metrics_on_a_real_scrape(testbed, tmp_path):
    """A running daemon shaping a flow (IPv4 and IPv6 clients): its scrape passes `promtool check
    metrics` and names neither client's address (prefix labels by default): the IPv4-mapped
    flow and the IPv6 one each under their network."""
    from harness.daemon import RULES, Daemon
    tool = promtool()
    # one dual-stack listener: the IPv4 client arrives IPv4-mapped, the IPv6 one as it is
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv", v6=True))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES).start()
    try:
        for addr in (testbed.server_v4, testbed.server_v6):
            testbed.popen(testbed.client_ns, client_argv(str(addr), 9101, 6))
        wait_for(lambda: len(d.flows()) >= 2, 10, 0.05, "two shaped flows")

        def scrape():
            with in_netns(testbed.server_ns):
                return urllib.request.urlopen("http://127.0.0.1:9717/metrics", timeout=5).read()
        body = wait_for(lambda: (b := scrape()) and b"flowpacer_flow_sent_bytes_total{" in b and b,
                        10, 0.1, "per-flow series in the scrape")
        out = subprocess.run([tool, "check", "metrics"], input=body, capture_output=True,
                             timeout=60)
        assert out.returncode == 0, (out.stdout + out.stderr).decode()
        text = body.decode()
        assert "flowpacer_build_info{" in text and "flowpacer_rule_received_bytes_total{" in text
        assert str(testbed.client_v4) not in text and str(testbed.client_v6) not in text
        remotes = {s.labels["remote_address"] for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "flowpacer_flow_sent_bytes_total"}
        assert remotes == {str(ipaddress.ip_network(f"{testbed.client_v4}/24", strict=False)),
                           str(ipaddress.ip_network(f"{testbed.client_v6}/48", strict=False))}
    finally:
        assert d.stop() == 0
