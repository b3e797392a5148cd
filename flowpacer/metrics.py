"""Prometheus endpoint: collected at scrape time from the kernel's class statistics.

Nothing is pushed from the hot path: a scrape takes a short-lived copy of the daemon's view
(flows, classes, counters) under its lock, then dumps the classes' counters over its own netlink
socket and renders them. The number of per-flow series is bounded; flows past the bound are
counted in ``flowpacer_flow_series_overflow``, never silently cut. Per-rule totals keep the
bytes of flows that have ended, so they are real counters.

The HTTP server answers ``GET /metrics`` (and HEAD) and nothing else.
"""
from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional, Tuple

from .memory import trim_heap
from .model import BackendHealth, StageState

# prometheus_client is imported where it is used: the daemon's start (and so its recovery after
# a crash) does not pay for it before the flows are shaped, nor at all with --no-metrics

log = logging.getLogger(__name__)


DEFAULT_LISTEN = "127.0.0.1:9717"
DEFAULT_MAX_FLOW_SERIES = 10_000
FLOW_LABELS = ["rule", "process", "direction", "local_address", "local_port", "remote_address",
               "remote_port"]

# apply latency buckets, seconds
APPLY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LatencyHistogram:
    """Cumulative histogram filled by the daemon's loop (one add per apply), read by scrapes."""

    def __init__(self, buckets=APPLY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += seconds

    def cumulative(self):
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append((repr(b), acc))
        acc += self.counts[-1]
        out.append(("+Inf", acc))
        return out, self.total


class FlowpacerCollector:
    """``view()`` returns the daemon's ``DaemonView``; ``class_stats()`` returns
    {classid: ClassStats} read from the kernel at this moment."""

    def __init__(self, view: Callable[[], dict], class_stats: Callable[[], dict],
                 max_flow_series: int = DEFAULT_MAX_FLOW_SERIES):
        self.view = view
        self.class_stats = class_stats
        self.max_flow_series = max_flow_series
        self._lock = threading.Lock()
        # key -> (rule, bytes, packets, drops, and those counters when the rule began counting)
        self._last: Dict[object, tuple] = {}
        self._retired: Dict[str, list] = {}                         # rule -> [bytes, pkts, drops]
        self.scrapes = 0

    def collect(self):
        with self._lock:          # scrapes are serialized: the retired totals stay consistent
            yield from self._collect()

    def _collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        v = self.view()
        try:
            stats = self.class_stats()
        except Exception as e:
            log.warning("metrics: cannot read class statistics: %s", e)
            stats = {}
        self.scrapes += 1
        fam = {n: CounterMetricFamily(f"flowpacer_flow_{n}", d, labels=FLOW_LABELS) for n, d in (
            ("sent_bytes", "Bytes sent by the flow through its class."),
            ("sent_packets", "Packets sent by the flow through its class."),
            ("dropped_packets", "Packets of the flow dropped by its class."))}
        target = GaugeMetricFamily("flowpacer_flow_target_rate_bytes_per_second",
                                   "The flow's rule rate.", labels=FLOW_LABELS)
        rules_now: Dict[str, list] = {}
        seen = set()
        exported = overflow = 0
        for f in v.flows:
            st = stats.get(f.classid)
            b, p, d = (st.bytes, st.packets, st.drops) if st else (0, 0, 0)
            key = f.key
            seen.add(key)
            last = self._last.get(key)
            base = (0, 0, 0)
            if last is not None:
                base = last[4:]
                if last[0] != f.rule:          # re-rated into another rule: the old rule keeps
                    self._retire(last)        # what was sent so far, the new one counts from here
                    base = last[1:4]
            self._last[key] = (f.rule, b, p, d) + tuple(base)
            r = rules_now.setdefault(f.rule, [0, 0, 0, 0])
            r[0] += 1
            r[1] += b - base[0]
            r[2] += p - base[1]
            r[3] += d - base[2]
            if exported >= self.max_flow_series:
                overflow += 1
                continue
            exported += 1
            labels = [f.rule, f.process, f.direction.value if f.direction else "",
                      str(key.local_addr), str(key.local_port), str(key.remote_addr),
                      str(key.remote_port)]
            fam["sent_bytes"].add_metric(labels, b)
            fam["sent_packets"].add_metric(labels, p)
            fam["dropped_packets"].add_metric(labels, d)
            target.add_metric(labels, f.rate_bps)
        for key in [k for k in self._last if k not in seen]:
            self._retire(self._last.pop(key))
        yield from fam.values()
        yield target
        ov = GaugeMetricFamily("flowpacer_flow_series_overflow",
                               "Shaped flows not exported as series in this scrape (over the limit).")
        ov.add_metric([], overflow)
        yield ov

        r_flows = GaugeMetricFamily("flowpacer_rule_flows", "Flows shaped by the rule now.",
                                    labels=["rule"])
        r_bytes = CounterMetricFamily("flowpacer_rule_sent_bytes", "Bytes sent by the rule's flows.",
                                      labels=["rule"])
        r_pkts = CounterMetricFamily("flowpacer_rule_sent_packets",
                                     "Packets sent by the rule's flows.", labels=["rule"])
        r_drops = CounterMetricFamily("flowpacer_rule_dropped_packets",
                                      "Packets of the rule's flows dropped.", labels=["rule"])
        for rule in sorted(set(rules_now) | set(self._retired) | set(v.rule_names)):
            now = rules_now.get(rule, [0, 0, 0, 0])
            old = self._retired.get(rule, [0, 0, 0])
            r_flows.add_metric([rule], now[0])
            r_bytes.add_metric([rule], now[1] + old[0])
            r_pkts.add_metric([rule], now[2] + old[1])
            r_drops.add_metric([rule], now[3] + old[2])
        yield from (r_flows, r_bytes, r_pkts, r_drops)

        info = GaugeMetricFamily("flowpacer_info", "The daemon's backend and flow source.",
                                 labels=["backend", "interface", "flow_source"])
        info.add_metric([v.backend or "", v.interface or "", v.flow_source], 1)
        yield info
        ev = CounterMetricFamily("flowpacer_events", "Flow events by source and kind.",
                                 labels=["source", "kind"])
        for (src, kind), n in sorted(v.events.items()):
            ev.add_metric([src, kind], n)
        yield ev
        lost = CounterMetricFamily("flowpacer_tracer_lost_events",
                                   "Events the tracer's ring buffer could not take.")
        lost.add_metric([], (v.tracer or {}).get("lost", 0))
        yield lost
        una = CounterMetricFamily("flowpacer_tracer_unattributed_events",
                                  "Tracer events that could not be attributed to a process.")
        una.add_metric([], (v.tracer or {}).get("unattributed", 0))
        yield una
        nle = CounterMetricFamily("flowpacer_netlink_errors", "Requests the kernel refused.")
        nle.add_metric([], v.counters["op_errors"])
        yield nle
        rbf = CounterMetricFamily("flowpacer_backend_rebuild_failures",
                                  "Failed attempts to rebuild a lost root qdisc (e.g. the psp "
                                  "module was unloaded).")
        rbf.add_metric([], v.counters["backend_rebuild_failures"])
        yield rbf
        bst = GaugeMetricFamily("flowpacer_backend_state",
                                "1 for the backend's current state, 0 for the others: ok, gone (no "
                                "interface), lost (our root qdisc missing, not rebuilt yet), "
                                "foreign (someone else's root qdisc), speed (link speed changed).",
                                labels=["state"])
        for st in BackendHealth:
            bst.add_metric([st.value], 1 if st is v.backend_health else 0)
        yield bst
        sst = GaugeMetricFamily("flowpacer_stage_state",
                                "1 for each supervised stage's current state (running, restarting, "
                                "stalled, degraded, failed, disabled, ...), 0 for the others.",
                                labels=["stage", "state"])
        sfail = CounterMetricFamily("flowpacer_stage_failures",
                                    "Unexpected failures of each supervised stage (each one logged "
                                    "and the stage restarted).", labels=["stage"])
        for stage in v.stages:
            for st in StageState:
                sst.add_metric([stage.name, st.value], 1 if st is stage.state else 0)
            sfail.add_metric([stage.name], stage.failures)
        yield sst
        yield sfail
        deg = GaugeMetricFamily("flowpacer_flow_source_degraded",
                                "1 when the eBPF tracer is not running and flows are found by "
                                "sock_diag polling only.")
        deg.add_metric([], 0 if any(s.name == "tracer" and s.state is StageState.RUNNING
                                    for s in v.stages) else 1)
        yield deg
        rel = CounterMetricFamily("flowpacer_reloads", "Rules reloads by outcome.",
                                  labels=["outcome"])
        rel.add_metric(["ok"], v.counters["reloads_ok"])
        rel.add_metric(["failed"], v.counters["reloads_failed"])
        yield rel
        live = GaugeMetricFamily("flowpacer_flows", "Flows known to the daemon.", labels=["state"])
        live.add_metric(["live"], v.live_flows)
        live.add_metric(["shaped"], len(v.flows))
        yield live
        buckets, total = v.counters["apply_hist"]
        h = HistogramMetricFamily("flowpacer_apply_duration_seconds",
                                  "Time to apply one plan to the kernel.")
        h.add_metric([], buckets, total)
        yield h
        sc = CounterMetricFamily("flowpacer_scrapes", "Scrapes answered.")
        sc.add_metric([], self.scrapes)
        yield sc

    def _retire(self, last) -> None:
        rule, b, p, d, b0, p0, d0 = last
        r = self._retired.setdefault(rule, [0, 0, 0])
        r[0] += b - b0
        r[1] += p - p0
        r[2] += d - d0


def _handler(registry):
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        server_version = "flowpacer"
        sys_version = ""

        def _answer(self, body: bool) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                out = generate_latest(registry)
            except Exception as e:      # never take the daemon down from a scrape
                log.warning("metrics: scrape failed: %s", e)
                self.send_error(500, "scrape failed")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            if body:
                self.wfile.write(out)
            del out
            trim_heap()        # a 10 000-flow exposition is ~8 MB of short-lived strings

        def do_GET(self):
            self._answer(True)

        def do_HEAD(self):
            self._answer(False)

        def log_message(self, fmt, *args):
            log.debug("metrics: %s", fmt % args)

    return Handler


def parse_listen(text: str) -> Tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"metrics address {text!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


class MetricsServer:
    def __init__(self, listen: str, collector: FlowpacerCollector):
        host, port = parse_listen(listen)
        from prometheus_client import CollectorRegistry
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        server_cls = type("MetricsHTTPServer", (ThreadingHTTPServer,), {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
            "daemon_threads": True})
        self.httpd = server_cls((host, port), _handler(self.registry))
        self.address = f"{host}:{self.httpd.server_address[1]}"
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self.httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s/metrics", self.address)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
