"""Prometheus endpoint: collected at scrape time from the kernel's class statistics.

Nothing is pushed from the hot path: a scrape takes a short-lived copy of the daemon's view
(flows, classes, counters) under its lock, then dumps the classes' counters over its own netlink
socket and renders them. The number of per-flow series is bounded; flows past the bound are
counted in ``flowpacer_flow_series_overflow``, never silently cut. Per-rule totals keep the
bytes of flows that have ended, so they are real counters.

Every label value has its control characters replaced (``text.printable``); the address labels
are ``full``, ``prefix`` or ``none`` (``AddressLabels``), ``prefix`` by default: Prometheus's
cardinality advice (no label whose values grow with the connections, no client list on a port
every local user can read). The send and the receive side (issue 17) are counted apart: a flow
with both rates is one flow, its received bytes are never in a ``sent`` total. The HTTP server
(``MetricsServer``) answers ``GET /metrics`` (and HEAD) and nothing else, from one event-loop
thread with a connection cap and timeouts, optionally with TLS and basic auth (``webconfig``)
or on a Unix socket.
"""
from __future__ import annotations

import enum
import ipaddress
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from flowpacer.daemon.memory import trim_heap
from flowpacer.model import BackendHealth, FlowKey, StageState
from flowpacer.text import printable

# prometheus_client is imported where it is used: the daemon's start (and so its recovery after
# a crash) does not pay for it before the flows are shaped, nor at all with --no-metrics

log = logging.getLogger(__name__)


DEFAULT_LISTEN = "127.0.0.1:9717"
DEFAULT_MAX_FLOW_SERIES = 10_000
DEFAULT_ADDRESSES = "prefix"          # --metrics-addresses (AddressLabels)
FLOW_LABELS = ["rule", "process", "direction", "local_address", "local_port", "remote_address",
               "remote_port", "protocol", "side", "interface"]


# ------------------------------------------------------- groups (issue 15)

MAX_CLIENT_SERIES = 100     # per-client series: the busiest clients only (bounded cardinality)


def group_families(v, stats, addresses, limit: int = MAX_CLIENT_SERIES):
    """The aggregate-rate series: each rule group's cap and current rate, and for the ``limit``
    busiest client groups (most bytes sent through their class) their bytes and current share,
    each labelled with the interface its class is on (a rule's group is one per shaped
    interface, issue 29). Client labels follow ``--metrics-addresses`` (``prefix``: the
    client's /24 or /48; ``none``: no per-client series); clients beyond the limit are counted
    in ``flowpacer_client_series_overflow``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    rule_cap = GaugeMetricFamily("flowpacer_rule_total_rate_bytes_per_second",
                                 "The rule's total_rate (the cap of all its flows together on "
                                 "one interface).", labels=["rule", "interface"])
    rule_now = GaugeMetricFamily("flowpacer_rule_group_rate_bytes_per_second",
                                 "The rate the rule's group class has now (what its flows want, "
                                 "at most total_rate).", labels=["rule", "interface"])
    c_bytes = CounterMetricFamily("flowpacer_client_sent_bytes",
                                  "Bytes sent to one client by a rule with client_rate (busiest "
                                  "clients only).", labels=["rule", "client", "interface"])
    c_rate = GaugeMetricFamily("flowpacer_client_rate_bytes_per_second",
                               "The client group's rate now: client_rate, or its share of the "
                               "rule's total_rate (busiest clients only).",
                               labels=["rule", "client", "interface"])
    clients: Dict[tuple, list] = {}
    for g in v.groups:
        if g.kind is None or not g.id:
            continue
        ifname = g.interface or v.interface or ""
        if g.kind.value == "rule":
            rule_cap.add_metric([g.id, ifname], g.ceil_bps)
            rule_now.add_metric([g.id, ifname], g.rate_bps)
            continue
        if addresses is AddressLabels.NONE:
            continue
        rule, _, net = g.id.partition("/")
        label = net if addresses is AddressLabels.FULL else \
            address_label(net.split("/")[0], addresses)
        st = stats.get(g.stats_key(v.interface or ""))
        c = clients.setdefault((rule, label, ifname), [0, 0])
        c[0] += st.bytes if st else 0
        c[1] += g.rate_bps
    busiest = sorted(clients.items(), key=lambda kv: (-kv[1][0], kv[0]))
    for labels, (b, rate) in busiest[:limit]:
        c_bytes.add_metric(list(labels), b)
        c_rate.add_metric(list(labels), rate)
    over = GaugeMetricFamily("flowpacer_client_series_overflow",
                             "Client groups not exported as series in this scrape (over the "
                             f"limit of {limit} busiest).")
    over.add_metric([], max(0, len(busiest) - limit))
    yield from (rule_cap, rule_now, c_bytes, c_rate, over)


# ------------------------------------------------------------------------ labels

class AddressLabels(str, enum.Enum):
    """What the per-flow series say of a flow's addresses (``--metrics-addresses``)."""
    FULL = "full"        # addresses and ports as they are
    PREFIX = "prefix"    # addresses as their /24 (IPv4) or /48 (IPv6) network; the service
    #                      port kept, the client's ephemeral port dropped (flow_labels)
    NONE = "none"        # addresses and ports empty: flows of one rule/process/direction merge


PREFIX_V4 = 24
PREFIX_V6 = 48


def clean_labels(fam):
    """``fam`` with every sample's label values made printable (``text.printable``: the
    exposition format itself escapes only backslash, double quote and newline), in place."""
    for i, smp in enumerate(fam.samples):
        if not all(v.isprintable() for v in smp.labels.values()):
            fam.samples[i] = smp._replace(labels={k: printable(v) for k, v in smp.labels.items()})
    return fam


def address_label(addr, mode: AddressLabels) -> str:
    if mode is AddressLabels.FULL:
        return str(addr)
    if mode is AddressLabels.NONE:
        return ""
    a = FlowKey.wire_address(addr)
    bits = PREFIX_V4 if a.version == 4 else PREFIX_V6
    return str(ipaddress.ip_network(f"{a}/{bits}", strict=False))


def flow_labels(rule: str, process: str, direction: str, key, mode: AddressLabels,
                side: str = "send", interface: str = "") -> tuple:
    """The per-flow series' label values, in ``FLOW_LABELS`` order (``side``: send, or receive
    for a class on the receive side, issue 17; ``interface``: the one it is shaped on, 29). ``prefix`` keeps the service's port only: the
    local one of an inbound flow, the remote one of an outbound flow (neither when the direction
    is unknown), so a new connection from a known network adds no series."""
    if mode is AddressLabels.NONE:
        ports = ("", "")
    elif mode is AddressLabels.PREFIX:
        ports = (str(key.local_port) if direction == "inbound" else "",
                 str(key.remote_port) if direction == "outbound" else "")
    else:
        ports = (str(key.local_port), str(key.remote_port))
    return (rule, process, direction, address_label(key.local_addr, mode), ports[0],
            address_label(key.remote_addr, mode), ports[1], key.protocol.value, side, interface)


class FlowSeries:
    """The per-flow series after the address mapping, which may put several flows into one
    label set (``prefix``, ``none``). A label set's counters are the sum over every flow that
    was in it since the set last had no exported flow, so a counter never goes backwards when
    one of its flows ends; the target rate is the sum of its flows' rates. With ``full``
    addresses every flow has its own label set and this is the plain per-flow value."""

    def __init__(self):
        self._flows: Dict[object, tuple] = {}      # flow key -> (labels, bytes, pkts, drops)
        self._ended: Dict[tuple, list] = {}        # labels -> [bytes, pkts, drops] of ended flows

    def _end(self, last) -> None:
        e = self._ended.setdefault(last[0], [0, 0, 0])
        for i in range(3):
            e[i] += last[1 + i]

    def update(self, rows, live_keys) -> Dict[tuple, list]:
        """``rows``: (key, labels, bytes, packets, drops, rate_bps) of the exported flows;
        ``live_keys``: every flow that still exists (exported or not)."""
        out: Dict[tuple, list] = {}
        for key, labels, b, p, d, rate in rows:
            last = self._flows.get(key)
            if last is not None and last[0] != labels:   # re-rated into another rule
                self._end(last)
            self._flows[key] = (labels, b, p, d)
            o = out.setdefault(labels, [0, 0, 0, 0])
            o[0] += b
            o[1] += p
            o[2] += d
            o[3] += rate
        for key in [k for k in self._flows if k not in live_keys]:
            self._end(self._flows.pop(key))
        for labels in list(self._ended):
            o = out.get(labels)
            if o is None:
                del self._ended[labels]        # the series is gone; it starts over if it returns
            else:
                for i in range(3):
                    o[i] += self._ended[labels][i]
        return out


class FlowpacerCollector:
    """``view()`` returns the daemon's ``DaemonView``; ``class_stats()`` returns
    {StatsKey: ClassStats} read from the kernel at this moment."""

    def __init__(self, view: Callable[[], dict], class_stats: Callable[[], dict],
                 max_flow_series: int = DEFAULT_MAX_FLOW_SERIES,
                 addresses: "AddressLabels" = None):
        self.view = view
        self.class_stats = class_stats
        self.max_flow_series = max_flow_series
        self.addresses = AddressLabels(addresses or DEFAULT_ADDRESSES)
        self._series = FlowSeries()
        self._lock = threading.Lock()
        # key -> (rule, bytes, packets, drops, and those counters when the rule began counting)
        self._last: Dict[object, tuple] = {}
        self._retired: Dict[tuple, list] = {}             # (rule, side) -> [bytes, pkts, drops]
        self.scrapes = 0

    def collect(self):
        with self._lock:          # scrapes are serialized: the retired totals stay consistent
            for fam in self._collect():
                yield clean_labels(fam)

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
        rules_now: Dict[tuple, list] = {}        # (rule, side) -> [bytes, packets, drops]
        rule_flows: Dict[str, set] = {}          # rule -> its flows (a flow with both sides once)
        seen = set()
        rows = []
        for f in v.flows:
            key = f.stats_key(v.interface or "")      # one flow, two classes (two sides)
            st = stats.get(key)
            b, p, d = (st.bytes, st.packets, st.drops) if st else (0, 0, 0)
            seen.add(key)
            last = self._last.get(key)
            base = (0, 0, 0)
            if last is not None:
                base = last[4:]
                if last[0] != f.rule:          # re-rated into another rule: the old rule keeps
                    self._retire(last, key.side.value)   # what was sent so far, the new one
                    #                                      counts from here
                    base = last[1:4]
            self._last[key] = (f.rule, b, p, d) + tuple(base)
            rule_flows.setdefault(f.rule, set()).add(f.key)
            r = rules_now.setdefault((f.rule, key.side.value), [0, 0, 0])
            r[0] += b - base[0]
            r[1] += p - base[1]
            r[2] += d - base[2]
            rows.append((key, flow_labels(f.rule, f.process,
                                          f.direction.value if f.direction else "", f.key,
                                          self.addresses, f.side.value,
                                          f.interface or v.interface or ""),
                         b, p, d, f.rate_bps))
        # the busiest flows (most bytes sent) get series; the rest are counted as overflow
        rows.sort(key=lambda r: -r[2])
        overflow = max(0, len(rows) - self.max_flow_series)
        for labels, (b, p, d, rate) in self._series.update(rows[:self.max_flow_series],
                                                            seen).items():
            fam["sent_bytes"].add_metric(labels, b)
            fam["sent_packets"].add_metric(labels, p)
            fam["dropped_packets"].add_metric(labels, d)
            target.add_metric(labels, rate)
        for key in [k for k in self._last if k not in seen]:
            self._retire(self._last.pop(key), key.side.value)
        yield from fam.values()
        yield target
        ov = GaugeMetricFamily("flowpacer_flow_series_overflow",
                               "Shaped flows not exported as series in this scrape (over the limit).")
        ov.add_metric([], overflow)
        yield ov

        yield from self._rule_families(v, rules_now, rule_flows)
        yield build_info()

        info = GaugeMetricFamily("flowpacer_info", "The daemon's backend and flow source, one "
                                 "series per shaped interface.",
                                 labels=["backend", "interface", "flow_source"])
        for i in _interfaces(v):
            info.add_metric([i.backend or "", i.name, v.flow_source.text], 1)
        yield info
        um = GaugeMetricFamily("flowpacer_flows_unmanaged_interface",
                               "Live flows a rule shapes whose packets leave by an interface "
                               "flowpacer does not shape (or by no route): not shaped, listed "
                               "in status' unmanaged_interface (issue 29).")
        um.add_metric([], len(v.unmanaged))
        yield um
        lr = GaugeMetricFamily("flowpacer_link_rate_bytes_per_second",
                               "Each shaped interface's link rate as its root qdisc has it: the "
                               "rules' link_rate, else the device's speed, for a bond the sum of "
                               "its sending members (the active one's in active-backup), "
                               "followed when a member goes down or up (issue 29).",
                               labels=["interface"])
        for i in _interfaces(v):
            lr.add_metric([i.name], i.link_rate_bps)
        yield lr
        sp = GaugeMetricFamily("flowpacer_spare_classes",
                               "Classes of closed flows kept (no filter) to be changed for new "
                               "flows instead of making classes, per interface (htb, issue 26: "
                               "the kernel walks every class for each class made or deleted).",
                               labels=["interface"])
        for i in v.interfaces:
            sp.add_metric([i.name], i.spares)
        yield sp
        rc = GaugeMetricFamily("flowpacer_ready_classes",
                               "The rules' ready_classes where the backend keeps spares (htb; 0 "
                               "elsewhere): flow classes made ahead for a flash crowd, per "
                               "interface (issue 26); flows and spare classes together reach it.",
                               labels=["interface"])
        for i in v.interfaces:
            rc.add_metric([i.name], i.ready_classes)
        yield rc
        fb = GaugeMetricFamily("flowpacer_backend_fallback",
                               "1 while backend auto runs another kind than the one it wants "
                               "(psp), with why in one line (e.g. the kernel refused the unsigned "
                               "sch_psp module: Key was rejected by service); 0 otherwise. One "
                               "series per shaped interface.",
                               labels=["wanted", "used", "reason", "interface"])
        for i in _interfaces(v):
            wanted = (_auto_preferred() if (i.wanted or v.backend_wanted) in ("", "auto")
                      else i.wanted or v.backend_wanted)
            fb.add_metric([wanted if i.fallback else (i.backend or wanted), i.backend or "",
                           i.fallback, i.name], 1 if i.fallback else 0)
        yield fb
        ev = CounterMetricFamily("flowpacer_events", "Flow events by source and kind.",
                                 labels=["source", "kind"])
        for src, kind, n in sorted(v.events.items()):
            ev.add_metric([src, kind], n)
        yield ev
        lost = CounterMetricFamily("flowpacer_tracer_lost_events",
                                   "Events the tracer's ring buffer could not take.")
        lost.add_metric([], v.tracer.lost if v.tracer else 0)
        yield lost
        una = CounterMetricFamily("flowpacer_tracer_unattributed_events",
                                  "Tracer events that could not be attributed to a process.")
        una.add_metric([], v.tracer.unattributed if v.tracer else 0)
        yield una
        udp = CounterMetricFamily("flowpacer_tracer_udp_events",
                                  "UDP flow events of the tracer: idle (a flow reported silent "
                                  "for the shortest idle_timeout), woken (a connected socket "
                                  "sending again after that), released (a socket with flows "
                                  "closed), forgotten (a silent peer dropped from the kernel "
                                  "map).", labels=["kind"])
        if v.tracer is not None:
            u = v.tracer.udp
            for kind, n in (("forgotten", u.forgotten), ("idle", u.idle),
                            ("released", u.released), ("woken", u.woken)):
                udp.add_metric([kind], n)
        yield udp
        yield from _first_byte_metrics(v.first_byte, CounterMetricFamily, GaugeMetricFamily)
        nle = CounterMetricFamily("flowpacer_netlink_errors", "Requests the kernel refused.")
        nle.add_metric([], v.counters.op_errors)
        yield nle
        rbf = CounterMetricFamily("flowpacer_backend_rebuild_failures",
                                  "Failed attempts to rebuild a lost root qdisc (e.g. the psp "
                                  "module was unloaded), per shaped interface.",
                                  labels=["interface"])
        for i in _interfaces(v):
            rbf.add_metric([i.name], i.rebuild_failures if v.interfaces
                           else v.counters.backend_rebuild_failures)
        yield rbf
        bst = GaugeMetricFamily("flowpacer_backend_state",
                                "1 for each shaped interface's backend's current state, 0 for the "
                                "others: ok, gone (no interface), lost (our root qdisc missing, "
                                "not rebuilt yet), foreign (someone else's root qdisc), speed "
                                "(link speed changed).", labels=["interface", "state"])
        for i in _interfaces(v):
            for st in BackendHealth:
                bst.add_metric([i.name, st.value], 1 if st is i.health else 0)
        yield bst
        rst = GaugeMetricFamily("flowpacer_receive_state",
                                "1 for the current state of each shaped interface's receive side "
                                "(its ifb, while a rule has a receive_rate), 0 for the others: "
                                "the states of flowpacer_backend_state.",
                                labels=["interface", "ifb", "state"])
        for i in _interfaces(v):
            if i.receive_interface or i.receive_problem:
                for st in BackendHealth:
                    rst.add_metric([i.name, i.receive_interface, st.value],
                                   1 if st is i.receive_health else 0)
        yield rst
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
        # the flow source's own mode (--no-tracer, the tracer could not load or was given up);
        # a tracer stage waiting out its back-off is still the flow source (stage metrics)
        deg.add_metric([], 1 if v.flow_source.polling else 0)
        yield deg
        rel = CounterMetricFamily("flowpacer_reloads", "Rules reloads by outcome.",
                                  labels=["outcome"])
        rel.add_metric(["ok"], v.counters.reloads_ok)
        rel.add_metric(["failed"], v.counters.reloads_failed)
        yield rel
        live = GaugeMetricFamily("flowpacer_flows", "Flows known to the daemon.", labels=["state"])
        live.add_metric(["live"], v.live_flows)
        live.add_metric(["shaped"], len({f.key for f in v.flows}))   # both sides: one flow
        yield live
        hist = v.counters.apply_hist
        h = HistogramMetricFamily("flowpacer_apply_duration_seconds",
                                  "Time to apply one plan to the kernel.")
        h.add_metric([], list(hist.buckets), hist.total_s)
        yield h
        sc = CounterMetricFamily("flowpacer_scrapes", "Scrapes answered.")
        sc.add_metric([], self.scrapes)
        yield sc
        yield from group_families(v, stats, self.addresses)
        yield from health_families(v)

    # per-rule totals, always there whatever the per-flow options: (name, help) per side, the
    # counters in [bytes, packets, drops] order
    RULE_SIDES = (
        ("send", (("flowpacer_rule_sent_bytes", "Bytes the server sent in the rule's flows."),
                  ("flowpacer_rule_sent_packets", "Packets the server sent in the rule's flows."),
                  ("flowpacer_rule_dropped_packets",
                   "Packets of the rule's flows dropped by their send classes."))),
        ("receive", (("flowpacer_rule_received_bytes",
                      "Bytes the server received in the rule's flows (receive_rate, shaped on "
                      "the ifb)."),
                     ("flowpacer_rule_received_packets",
                      "Packets the server received in the rule's flows."),
                     ("flowpacer_rule_receive_dropped_packets",
                      "Packets to the server of the rule's flows dropped by their receive "
                      "classes."))),
    )

    def _rule_families(self, v, rules_now, rule_flows):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        r_flows = GaugeMetricFamily("flowpacer_rule_flows", "Flows shaped by the rule now (a flow "
                                    "shaped both ways counts once).", labels=["rule"])
        names = sorted(set(rule_flows) | {r for r, _ in rules_now} | {r for r, _ in self._retired}
                       | set(v.rule_names))
        for rule in names:
            r_flows.add_metric([rule], len(rule_flows.get(rule, ())))
        yield r_flows
        for side, fams in self.RULE_SIDES:
            out = [CounterMetricFamily(n, h, labels=["rule"]) for n, h in fams]
            for rule in names:
                now = rules_now.get((rule, side), (0, 0, 0))
                old = self._retired.get((rule, side), (0, 0, 0))
                for i, fam in enumerate(out):
                    fam.add_metric([rule], now[i] + old[i])
            yield from out

    def _retire(self, last, side: str) -> None:
        rule, b, p, d, b0, p0, d0 = last
        r = self._retired.setdefault((rule, side), [0, 0, 0])
        r[0] += b - b0
        r[1] += p - p0
        r[2] += d - d0


# ------------------------------------------------------------------------ the server

MAX_CONNECTIONS = 64          # open connections at once (see MetricsServer)
HEAD_TIMEOUT_S = 10.0         # from accept (TLS handshake included) to the request head's end
SEND_TIMEOUT_S = 10.0         # from the answer being ready to its last byte taken
MAX_HEAD = 8192               # bytes of request line and headers
REUSE_S = 0.25                # scrapes this close together share one rendering
MAX_BODIES = 2                # renderings being sent at once (memory bound under slow readers)
TICK_S = 0.25

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 431: "Request Header Fields Too Large",
           500: "Internal Server Error"}
_QUIET = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class Listen:
    """Where the endpoint listens: ``HOST:PORT`` / ``[V6]:PORT`` (TCP) or ``unix:/PATH``."""

    def __init__(self, text: str):
        self.text = text
        self.path: Optional[str] = None
        self.host = ""
        self.port = 0
        if text.startswith("unix:"):
            path = text[5:]
            if not path.startswith("/"):
                raise ValueError(f"metrics address {text!r}: expected unix:/ABSOLUTE/PATH")
            self.path = path
        else:
            self.host, self.port = parse_listen(text)


def parse_listen(text: str) -> Tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:   # 0: any free port
        raise ValueError(f"metrics address {text!r}: expected HOST:PORT or unix:/PATH")
    return host.strip("[]") or "127.0.0.1", int(port)


class _Conn:
    __slots__ = ("sock", "head", "out", "body", "pos", "deadline", "handshake", "peer", "since")

    def __init__(self, sock, since: float, deadline: float, handshake: bool, peer: str):
        self.sock = sock
        self.since = since
        self.head = b""
        self.out: Optional[List[memoryview]] = None   # what is left to send: head, body
        self.body: Optional[bytes] = None              # the (shared) rendering being sent
        self.pos = 0
        self.deadline = deadline
        self.handshake = handshake      # TLS handshake still to finish
        self.peer = peer


class MetricsServer:
    """The Prometheus endpoint: ``GET``/``HEAD /metrics`` and nothing else, served by one
    event-loop thread (``run``, a supervised stage) with non-blocking sockets. Bounded whatever
    the clients do: at most ``max_connections`` open. One more takes the place of the oldest
    connection still without a whole request head, after what that one has sent so far is read
    (a scraper sends its request at once, so it is answered, never pushed out; idle connections
    cannot lock scrapes out); when every connection is being answered, the new one is closed at
    once. Each must deliver its request head (TLS handshake included) within ``head_timeout_s``
    and take its answer within ``send_timeout_s``; a connection is closed after its answer (no
    keep-alive). Clients that leave early are logged at debug level only.

    ``web_config`` (``webconfig.WebConfig``) adds TLS and/or basic authentication. A
    ``unix:/PATH`` listener makes its socket with mode 0660, group of its directory: access is
    given by the directory's group and mode."""

    def __init__(self, listen: str, collector: FlowpacerCollector, *, web_config=None,
                 max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S,
                 send_timeout_s: float = SEND_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.listen = Listen(listen)
        from prometheus_client import CollectorRegistry
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.web = web_config
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        self.send_timeout_s = send_timeout_s
        self.clock = clock
        self.refused = {"full": 0, "evicted": 0, "timeout": 0}
        self._body: Optional[Tuple[float, bytes]] = None     # (rendered at, exposition)
        if self.listen.path:
            self.sock = self._unix_socket(self.listen.path)
            self.address = f"unix:{self.listen.path}"
        else:
            host, port = self.listen.host, self.listen.port
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.sock.bind((host, port))
            except OSError:
                self.sock.close()
                raise
            shown = f"[{host}]" if family == socket.AF_INET6 else host
            self.address = f"{shown}:{self.sock.getsockname()[1]}"
        self.sock.listen(1024)          # a burst of connections is taken, not dropped (SYN retries)
        self.sock.setblocking(False)
        scheme = "https" if self.web is not None and self.web.tls is not None else "http"
        log.info("metrics on %s://%s/metrics%s", scheme, self.address,
                 " (basic auth)" if self.web is not None and self.web.auth else "")

    @staticmethod
    def _unix_socket(path: str) -> socket.socket:
        import stat
        d = os.path.dirname(path)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise ValueError(f"{path} exists and is not a socket")
            os.unlink(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)                  # 0600 until it has its directory's group
        try:
            s.bind(path)
            os.chown(path, -1, os.stat(d).st_gid)
            os.chmod(path, 0o660)
        except OSError:
            s.close()
            raise
        finally:
            os.umask(old)
        return s

    # ------------------------------------------------------------------ the stage
    def run(self, ctx) -> None:
        sel = selectors.DefaultSelector()
        conns: Dict[int, _Conn] = {}
        sel.register(self.sock, selectors.EVENT_READ, None)
        listening = True
        resume_at = 0.0
        try:
            while not ctx.stopping():
                now = self.clock()
                timeout = TICK_S
                if conns:
                    timeout = max(0.0, min(timeout, min(c.deadline for c in conns.values()) - now))
                for key, _ev in sel.select(timeout):
                    if key.data is None:
                        if not self._accept(sel, conns):      # out of fds: pause accepting
                            sel.unregister(self.sock)
                            listening, resume_at = False, self.clock() + 0.5
                    else:
                        self._service(sel, conns, key.data)
                now = self.clock()
                for c in [c for c in conns.values() if now >= c.deadline]:
                    self.refused["timeout"] += 1
                    log.debug("metrics: %s: %s timed out", c.peer,
                              "answer" if c.out is not None else "request")
                    self._close(sel, conns, c)
                if not listening and now >= resume_at:
                    sel.register(self.sock, selectors.EVENT_READ, None)
                    listening = True
                self._drop_stale_body(conns, now)
                ctx.beat()
        finally:
            for c in list(conns.values()):
                self._close(sel, conns, c)
            sel.close()

    def _accept(self, sel, conns: Dict[int, _Conn]) -> bool:
        for _ in range(256):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                log.warning("metrics: accept: %s", e)
                return False
            now = self.clock()
            if len(conns) >= self.max_connections and not self._make_room(sel, conns):
                self.refused["full"] += 1
                n = self.refused["full"]
                if n in (1, 10, 100, 1000) or n % 10000 == 0:
                    log.info("metrics: %d connections being answered: %d closed at once so far",
                             len(conns), n)
                conn.close()
                continue
            conn.setblocking(False)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "unix"
            tls = self.web is not None and self.web.tls is not None
            if tls:
                try:
                    conn = self.web.tls.wrap_socket(conn, server_side=True,
                                                    do_handshake_on_connect=False)
                except (OSError, ValueError) as e:
                    log.debug("metrics: %s: TLS: %s", peer, e)
                    conn.close()
                    continue
            c = _Conn(conn, now, now + self.head_timeout_s, tls, peer)
            conns[conn.fileno()] = c
            sel.register(conn, selectors.EVENT_READ, c)
        return True

    def _make_room(self, sel, conns) -> bool:
        """Free one place: the oldest connection still waiting for its request head is read
        first (a request it has sent is answered: it keeps its place), else closed."""
        for c in sorted((c for c in conns.values() if c.out is None), key=lambda c: c.since):
            self._service(sel, conns, c)
            if len(conns) < self.max_connections:
                return True                    # it had left
            if c.out is None:
                self.refused["evicted"] += 1
                self._close(sel, conns, c)
                return True
        return False

    def _want(self, sel, c: _Conn, events: int) -> None:
        if sel.get_key(c.sock).events != events:
            sel.modify(c.sock, events, c)

    def _service(self, sel, conns, c: _Conn) -> None:
        try:
            if c.handshake:
                c.sock.do_handshake()
                c.handshake = False
                self._want(sel, c, selectors.EVENT_READ)
            if c.out is None:
                self._read(sel, conns, c)
            if c.out is not None:
                self._write(sel, conns, c)
        except ssl.SSLWantReadError:
            self._want(sel, c, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(sel, c, selectors.EVENT_WRITE)
        except (BlockingIOError, InterruptedError):
            pass
        except (ssl.SSLError, OSError) as e:       # the client left or spoke nonsense
            log.debug("metrics: %s: %s", c.peer, e)
            self._close(sel, conns, c)

    def _read(self, sel, conns, c: _Conn) -> None:
        while True:
            chunk = c.sock.recv(MAX_HEAD + 1 - len(c.head))
            if not chunk:
                raise ConnectionResetError("closed before the request's end")
            c.head += chunk
            end = c.head.find(b"\r\n\r\n")
            if end < 0:
                end = c.head.find(b"\n\n")
            if end >= 0:
                self._respond(sel, conns, c, c.head[:end])
                return
            if len(c.head) > MAX_HEAD:
                self._respond(sel, conns, c, None)
                return

    def _respond(self, sel, conns, c: _Conn, head: Optional[bytes]) -> None:
        code, body, extra = self._route(head, conns)
        lines = [f"HTTP/1.1 {code} {REASONS[code]}", f"Content-Length: {len(body)}",
                 "Connection: close", "Server: flowpacer"] + extra
        if code == 200:
            from prometheus_client.exposition import CONTENT_TYPE_LATEST
            lines.append(f"Content-Type: {CONTENT_TYPE_LATEST}")
        else:
            lines.append("Content-Type: text/plain; charset=utf-8")
        method = head.split(b" ", 1)[0] if head else b""
        c.out = [memoryview(("\r\n".join(lines) + "\r\n\r\n").encode())]
        if method != b"HEAD":
            c.body = body          # shared, not copied: one rendering serves many answers
            c.out.append(memoryview(body))
        c.head = b""
        c.deadline = self.clock() + self.send_timeout_s
        self._want(sel, c, selectors.EVENT_WRITE)

    def _route(self, head: Optional[bytes], conns):
        if head is None:
            return 431, b"request head too large\n", []
        try:
            text = head.decode("latin-1")
            request, *header_lines = text.replace("\r\n", "\n").split("\n")
            method, target, version = request.split(" ")
            if not version.startswith("HTTP/1."):
                raise ValueError(version)
        except ValueError:
            return 400, b"bad request\n", []
        if self.web is not None and self.web.auth:
            auth = None
            for h in header_lines:
                name, _, value = h.partition(":")
                if name.strip().lower() == "authorization":
                    auth = value.strip()
            if not self.web.check(auth):
                return 401, b"unauthorized\n", ['WWW-Authenticate: Basic realm="flowpacer"']
        if method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD\n", ["Allow: GET, HEAD"]
        if target.split("?", 1)[0] != "/metrics":
            return 404, b"only /metrics is served here\n", []
        try:
            return 200, self._render(conns), []
        except Exception as e:            # never take the daemon down from a scrape
            log.warning("metrics: scrape failed: %s", e)
            return 500, b"scrape failed\n", []

    def _render(self, conns) -> bytes:
        """The exposition: rendered now, or the last one when it is under ``REUSE_S`` old or
        when ``MAX_BODIES`` renderings are still being sent to slow readers (memory stays
        bounded by a few renderings whatever the clients do)."""
        now = self.clock()
        if self._body is not None:
            sending = {id(c.body) for c in conns.values() if c.body is not None}
            if now - self._body[0] < REUSE_S or len(sending) >= MAX_BODIES:
                return self._body[1]
        from prometheus_client.exposition import generate_latest
        out = generate_latest(self.registry)
        self._body = (now, out)
        trim_heap()        # a 10 000-flow exposition is ~8 MB of short-lived strings
        return out

    @property
    def rendering_held(self) -> bool:
        """Whether the last exposition is still held (for reuse or for a reader)."""
        return self._body is not None

    def _drop_stale_body(self, conns, now: float) -> None:
        """Let go of the last rendering once no scrape can reuse it and no reader is sending
        it: between scrapes the daemon holds no exposition (~9.5 MB at 10 000 flows)."""
        if self._body is None or now - self._body[0] < REUSE_S:
            return
        body = self._body[1]
        if any(c.body is body for c in conns.values()):
            return
        self._body = None
        del body
        trim_heap()

    def _write(self, sel, conns, c: _Conn) -> None:
        step = 16384 if isinstance(c.sock, ssl.SSLSocket) else 1 << 18
        while c.out:
            part = c.out[0]
            n = c.sock.send(part[c.pos:c.pos + step])
            if n <= 0:
                return
            c.pos += n
            if c.pos >= len(part):
                c.out.pop(0)
                c.pos = 0
        c.body = None
        self._close(sel, conns, c, answered=True)

    def _close(self, sel, conns, c: _Conn, answered: bool = False) -> None:
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        for k in [k for k, v in conns.items() if v is c]:
            del conns[k]
        if answered and not isinstance(c.sock, ssl.SSLSocket):
            try:
                c.sock.recv(MAX_HEAD)               # unread bytes would turn FIN into RST
            except OSError:
                pass
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        c.out = c.body = None
        c.sock.close()

    def close(self) -> None:
        self.sock.close()
        if self.listen.path:
            try:
                os.unlink(self.listen.path)
            except OSError:
                pass


def health_families(v):
    """What the alerting rules (docs/flowpacer-alerts.yml) watch besides the stages and
    ``flowpacer_backend_fallback`` (a backend that fell back from psp to htb): how full the flow
    class-id space is (each side of an interface has the ids its backend declares,
    ``InterfaceView.class_id_limit``, for flow and group classes; one more flow is refused).
    An interface without a backend now has no limit series."""
    from prometheus_client.core import GaugeMetricFamily
    used = GaugeMetricFamily("flowpacer_class_ids_used",
                             "Class ids in use by flow and group classes, per interface and side.",
                             labels=["interface", "side"])
    lim = GaugeMetricFamily("flowpacer_class_ids_limit",
                            "Class ids each side of each interface has for flow and group classes.",
                            labels=["interface"])
    ifaces = _interfaces(v)
    first = ifaces[0].name
    for i in ifaces:
        mine = [f for f in v.flows if (f.interface or first) == i.name]
        used.add_metric([i.name, "send"], sum(1 for f in mine if f.side.value == "send")
                        + (i.groups if v.interfaces else len(v.groups)))
        used.add_metric([i.name, "receive"], sum(1 for f in mine if f.side.value == "receive"))
        if i.class_id_limit:
            lim.add_metric([i.name], i.class_id_limit)
    yield used
    yield lim


def _interfaces(v):
    """The shaped interfaces' views (issue 29); a view without them (one made by hand) stands
    for its one interface."""
    if v.interfaces:
        return v.interfaces
    from flowpacer.model import InterfaceView
    return (InterfaceView(v.interface or "", v.backend or "", v.backend_health,
                          v.backend_problem, v.link_rate_bps, 0, groups=len(v.groups),
                          receive_interface=v.receive_interface or "",
                          receive_health=v.receive_health, receive_problem=v.receive_problem,
                          fallback=v.backend_fallback, wanted=v.backend_wanted),)


def version() -> str:
    """flowpacer's version as installed (the wheel's or the .deb's metadata)."""
    from importlib import metadata
    try:
        return metadata.version("flowpacer")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_info():
    """``flowpacer_build_info``: 1, labelled with what was built and what runs it."""
    import platform
    from prometheus_client.core import GaugeMetricFamily
    fam = GaugeMetricFamily("flowpacer_build_info", "flowpacer's version and the Python that runs "
                            "it (always 1).", labels=["version", "python"])
    fam.add_metric([version(), platform.python_version()], 1)
    return fam


def _first_byte_metrics(fb, counter, gauge):
    """Issue 16's pools: ready classes and claims per kernel-decided rule (at most 64 rules),
    the fixed set of first-byte counters (``firstbyte.VIEW_COUNTERS``) and the pool ids held
    back. Nothing when the first-byte stage is off."""
    if fb is None:
        return
    ready = gauge("flowpacer_first_byte_pool_ready_classes",
                  "Ready classes in the rule's first-byte pool.", labels=["rule"])
    claims = counter("flowpacer_first_byte_rule_claims",
                     "Flows of the rule that got a pool class at their handshake.",
                     labels=["rule"])
    for p in fb.pools:
        ready.add_metric([p.rule], p.ready)
        claims.add_metric([p.rule], p.claims)
    yield ready
    yield claims
    c = fb.counters
    paced = counter("flowpacer_first_byte_flows",
                    "Flows decided at their handshake, by how their head was paced: 'class' (a "
                    "ready pool class), 'stopgap' (no class ready: TCP paced at the rule's rate "
                    "until the class is in), 'missed' (neither).", labels=["paced"])
    for k, n in (("class", c.claimed), ("stopgap", c.stopgap), ("missed", c.missed)):
        paced.add_metric([k], n)
    yield paced
    lifted = counter("flowpacer_first_byte_stopgaps_lifted",
                     "Stopgap limits lifted because their rule changed (a reload), or, with "
                     "several interfaces, because a guarded claim's class was placed on the "
                     "interface its flow leaves by.")
    lifted.add_metric([], c.lifted)
    yield lifted
    ev = counter("flowpacer_first_byte_events",
                 "First-byte shaping counters: claimed, refilled, returned (ready classes taken "
                 "back unclaimed), released (claims no flow took), exhausted (pool empty), and "
                 "why flows were left to user space.", labels=["kind"])
    for k, n in sorted(fb.counters.items()):
        ev.add_metric([k], n)
    yield ev
    ids = gauge("flowpacer_first_byte_pool_ids",
                "Pool class ids held back: 'held' carried by open sockets, 'awaiting' claimed "
                "ids whose class went and whose socket is still open.", labels=["state"])
    ids.add_metric(["held"], fb.ids_held)
    ids.add_metric(["awaiting"], fb.ids_awaiting)
    yield ids


def _auto_preferred() -> str:
    """The kind ``backend: auto`` wants (the first of its order: psp)."""
    from flowpacer.kernel.backend import registry
    return registry.auto_order()[0].kind.value
