"""The metrics endpoint as a door (issue 13): a bounded server, labels that cannot carry terminal
escapes, address labels that need not give away who the clients are, TLS and basic auth
(exporter web configuration), a Unix-socket listener.

In-process: the label functions, the collector's address modes and the server itself (a real
socket, a real event loop thread) under idle, slow and vanishing clients. Against a real daemon:
1 000 idle connections from an unprivileged user (bounded threads and fds, a scrape still
answers), TLS + basic auth and the address modes on the command line, and a process whose name
holds an escape sequence, checked everywhere its name is printed: the daemon's log, `flowpacer
status`, `flowpacer top` and the metrics.
"""
import base64
import dataclasses
import ipaddress
import logging
import os
import socket
import ssl
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowpacer.surfaces import webconfig
from flowpacer.daemon.latency import LatencyHistogram
from flowpacer.surfaces.metrics import (MAX_CONNECTIONS, REUSE_S, AddressLabels, FlowpacerCollector,
                                        FlowSeries, MetricsServer, address_label, flow_labels)
from flowpacer.model import (BackendHealth, ClassStats, DaemonCounters, DaemonView, Direction,
                             EventCounts, FlowKey, FlowSource, FlowSourceMode, FlowSourceStatus,
                             FlowView, Histogram, Protocol, StageState, StageView, TracerStats)
from flowpacer.text import printable as label_safe
from harness.daemon import Daemon, tracebacks
from harness.testbed import PY, client_argv, in_netns, server_argv, wait_for
from harness.fakes import StageCtx as Ctx

ESC_NAME = "py\x1b[31mX"            # a process name holding a terminal escape sequence
ESC_SHOWN = "py\\x1b[31mX"          # how every output must show it


# ------------------------------------------------------------------ labels

def test_label_safe_replaces_every_control_character():
    assert label_safe("fp-test-srv") == "fp-test-srv"
    assert label_safe(ESC_NAME) == ESC_SHOWN
    assert label_safe("a\nb\tc\x7f\x9b\u202e\u2028") == "a\\x0ab\\x09c\\x7f\\x9b\\u202e\\u2028"
    assert label_safe("caf\u00e9 \u4e2d") == "caf\u00e9 \u4e2d"        # printable text stays
    for c in map(chr, range(0x110000)):
        if not c.isprintable():
            assert label_safe(c).isprintable()


@pytest.mark.parametrize("addr,prefix", [
    ("10.77.5.200", "10.77.5.0/24"),
    ("::ffff:10.77.5.200", "10.77.5.0/24"),          # v4-mapped: as IPv4
    ("fd77:5:abcd:1::2", "fd77:5:abcd::/48"),
    ("2001:db8::1", "2001:db8::/48"),
])
def test_address_label_modes(addr, prefix):
    a = ipaddress.ip_address(addr)
    assert address_label(a, AddressLabels.FULL) == str(a)
    assert address_label(a, AddressLabels.PREFIX) == prefix
    assert address_label(a, AddressLabels.NONE) == ""


def _key(i, remote="10.0.0.2"):
    return FlowKey(ipaddress.ip_address("10.0.0.1"), 80, ipaddress.ip_address(remote), 1000 + i)


def test_flow_labels_drop_ports_with_addresses():
    k = _key(1, "10.9.8.7")
    assert flow_labels("r", "p", "inbound", k, AddressLabels.FULL) == \
        ("r", "p", "inbound", "10.0.0.1", "80", "10.9.8.7", "1001", "tcp", "send", "")
    assert flow_labels("r", "p", "inbound", k, AddressLabels.PREFIX, "send", "eth1") == \
        ("r", "p", "inbound", "10.0.0.0/24", "80", "10.9.8.0/24", "", "tcp", "send", "eth1")
    # prefix keeps the service's port only: the remote one of an outbound flow, none unknown
    assert flow_labels("r", "p", "outbound", k, AddressLabels.PREFIX)[4:7] == ("", "10.9.8.0/24", "1001")
    assert flow_labels("r", "p", "", k, AddressLabels.PREFIX)[4:7] == ("", "10.9.8.0/24", "")
    assert flow_labels("r", "p", "inbound", k, AddressLabels.NONE, "receive") == \
        ("r", "p", "inbound", "", "", "", "", "tcp", "receive", "")   # the side stays (17)
    u = dataclasses.replace(k, protocol=Protocol.UDP)      # issue 17: the protocol label
    assert flow_labels("r", "p", "inbound", u, AddressLabels.NONE)[-3] == "udp"


def test_merged_series_never_go_backwards():
    s = FlowSeries()
    L = ("r", "p", "inbound", "", "", "", "")
    a, b = _key(1), _key(2)
    out = s.update([(a, L, 100, 1, 0, 10), (b, L, 50, 1, 0, 10)], {a, b})
    assert out == {L: [150, 2, 0, 20]}
    # a ends: its bytes stay in the series; b goes on
    out = s.update([(b, L, 80, 2, 0, 10)], {b})
    assert out == {L: [180, 3, 0, 10]}
    # a new flow joins: counted from its own counter
    c = _key(3)
    out = s.update([(b, L, 90, 2, 0, 10), (c, L, 5, 1, 0, 10)], {b, c})
    assert out[L][0] == 195
    # all end: the series goes (and starts over if the label set comes back)
    assert s.update([], set()) == {}
    assert s.update([(a, L, 7, 1, 0, 10)], {a}) == {L: [7, 1, 0, 10]}


def _view(flows):
    h = LatencyHistogram()
    return DaemonView(
        backend="htb", backend_reason="", interface="eth\x1b0", backend_health=BackendHealth.OK,
        backend_problem="", link_rate_bps=125_000_000, rules_path="/r.yaml",
        rule_names=("r", "ru\x07le"),
        flow_source=FlowSourceStatus(FlowSourceMode.TRACER_FAILED, "x\r\n"),
        tracer=TracerStats(lost=0, unattributed=0),
        live_flows=len(flows), flows=tuple(flows),
        stages=(StageView("main", StageState.RUNNING),),
        counters=DaemonCounters(apply_hist=Histogram(*h.cumulative())),
        events=EventCounts(tracer_open=1))


def _flow(i, remote="10.0.0.2", process=ESC_NAME, rule="r"):
    return FlowView(_key(i, remote), f"f1f0:{0x10 + i:x}", rule, 1000, 1000, 7, process, 0,
                    Direction.INBOUND, FlowSource.TRACER)


def _scrape(collector):
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    text = generate_latest(reg).decode()
    return text, [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.mark.parametrize("mode", list(AddressLabels))
def test_collector_address_modes_and_clean_labels_everywhere(mode):
    flows = [_flow(1, "10.1.2.3"), _flow(2, "10.1.2.4"), _flow(3, "192.0.2.9", rule="ru\x07le")]
    stats = {f.stats_key(_view(flows).interface): ClassStats(bytes=100 * (i + 1), packets=1)
             for i, f in enumerate(flows)}
    c = FlowpacerCollector(lambda: _view(flows), lambda: stats, addresses=mode)
    text, samples = _scrape(c)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    for s in samples:
        assert all(v.isprintable() for v in s.labels.values()), s
    sent = [s for s in samples if s.name == "flowpacer_flow_sent_bytes_total"]
    assert {s.labels["process"] for s in sent} == {ESC_SHOWN}
    assert {s.labels["rule"] for s in sent} == {"r", "ru\\x07le"}
    info = next(s for s in samples if s.name == "flowpacer_info")
    assert info.labels["interface"] == "eth\\x1b0" and info.labels["flow_source"] == \
        "sock_diag polling only (tracer failed: x\\x0d\\x0a)"
    remotes = sorted(s.labels["remote_address"] for s in sent)
    if mode is AddressLabels.FULL:
        assert remotes == ["10.1.2.3", "10.1.2.4", "192.0.2.9"]
    elif mode is AddressLabels.PREFIX:
        # the two flows from 10.1.2.0/24 share a series: their ephemeral ports are dropped
        assert remotes == ["10.1.2.0/24", "192.0.2.0/24"]
        assert all(s.labels["remote_port"] == "" and s.labels["local_port"] == "80" for s in sent)
    else:
        # nothing of the address or ports; the two flows of rule r share one series
        assert remotes == ["", ""] and all(s.labels["remote_port"] == "" for s in sent)
        r = next(s for s in sent if s.labels["rule"] == "r")
        assert r.value == 300


def test_only_the_busiest_flows_get_series():
    flows = [_flow(i, process="srv") for i in range(10)]
    stats = {f.stats_key(_view(flows).interface): ClassStats(bytes=i * 10)
             for i, f in enumerate(flows)}
    c = FlowpacerCollector(lambda: _view(flows), lambda: stats, max_flow_series=3,
                           addresses="full")
    _text, samples = _scrape(c)
    sent = [s for s in samples if s.name == "flowpacer_flow_sent_bytes_total"]
    assert sorted(s.value for s in sent) == [70, 80, 90]
    assert next(s.value for s in samples if s.name == "flowpacer_flow_series_overflow") == 7


# ------------------------------------------------------------------ the server, in-process

class Fixed:
    """A collector of ``n`` samples (about 60 bytes each)."""

    def __init__(self, n=3):
        self.n = n

    def collect(self):
        g = GaugeMetricFamily("fp_test", "test", labels=["i"])
        for i in range(self.n):
            g.add_metric([str(i)], i)
        yield g


class Running:
    def __init__(self, srv):
        self.srv = srv
        self.ctx = Ctx()
        self.thread = threading.Thread(target=srv.run, args=(self.ctx,), daemon=True)
        self.thread.start()

    def stop(self):
        self.ctx.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.srv.close()


@pytest.fixture
def serve():
    running = []

    def start(collector=None, listen="127.0.0.1:0", **kw):
        r = Running(MetricsServer(listen, collector or Fixed(), **kw))
        running.append(r)
        return r.srv
    yield start
    for r in running:
        r.stop()


def _port(srv):
    return int(srv.address.rsplit(":", 1)[1])


def _raw(srv, data: bytes, timeout=5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", _port(srv)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def test_only_get_and_head_of_metrics(serve):
    srv = serve()
    body = urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=5).read().decode()
    assert 'fp_test{i="2"} 2.0' in body
    for path in ("/", "/admin", "/metrics/../etc/passwd"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://{srv.address}{path}", timeout=5)
        assert e.value.code == 404
    head = _raw(srv, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    assert _raw(srv, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert _raw(srv, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(srv, b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 2000).startswith(b"HTTP/1.1 431 ")


@pytest.mark.slow
def test_idle_connections_are_capped_timed_out_and_cannot_lock_scrapes_out(serve):
    srv = serve(head_timeout_s=5.0)
    threads = threading.active_count()
    idle = []
    t0 = time.monotonic()
    for _ in range(300):
        idle.append(socket.create_connection(("127.0.0.1", _port(srv)), timeout=5))
    wait_for(lambda: srv.refused["evicted"] >= 300 - MAX_CONNECTIONS, 5, 0.02,
             "the oldest idle connections to make way")
    assert threading.active_count() == threads           # no thread per connection

    def ended(s):
        s.setblocking(False)
        try:
            return s.recv(10) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True
    wait_for(lambda: sum(map(ended, idle)) == 300 - MAX_CONNECTIONS, 2, 0.05,
             f"all but {MAX_CONNECTIONS} connections closed by the server")
    assert not any(map(ended, idle[-MAX_CONNECTIONS:]))  # the newest ones kept their place
    body = urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=5).read()
    # answered long before the idle connections' 5 s: one of them made way
    assert b"fp_test" in body and time.monotonic() - t0 < 2.0
    assert srv.refused["full"] == 0
    # the rest are timed out (no request head within 5 s): every one of them sees its end
    for s in idle:
        s.settimeout(8)
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass
        s.close()
    assert srv.refused["timeout"] >= 1


@pytest.mark.slow
def test_clients_that_leave_mid_answer_leave_no_trace(serve, caplog):
    srv = serve(Fixed(200_000))                 # a ~6 MB exposition
    caplog.set_level(logging.DEBUG, logger="flowpacer.surfaces.metrics")
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", _port(srv)), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        s.recv(100)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()                                   # RST in the middle of the answer
    body = urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=30).read()
    assert body.count(b"\nfp_test{") == 200_000
    wait_for(lambda: any("reset" in r.getMessage().lower() or "pipe" in r.getMessage().lower()
                         for r in caplog.records), 5, 0.05, "the disconnect to be logged")
    assert all(r.levelno <= logging.DEBUG for r in caplog.records
               if "reset" in r.getMessage().lower() or "pipe" in r.getMessage().lower())
    assert not any(r.exc_info for r in caplog.records)


class Counting:
    """~10 MB per scrape (more than the sockets buffer), and which scrape it was."""

    def __init__(self):
        self.n = 0

    def collect(self):
        self.n += 1
        g = GaugeMetricFamily("fp_big", "test", labels=["pad"])
        for i in range(50_000):
            g.add_metric([f"{i:0200d}"], self.n)
        yield g


@pytest.mark.slow          # waits out its slow readers: 10 s
def test_slow_readers_hold_at_most_two_renderings(serve):
    now = [1000.0]
    c = Counting()
    srv = serve(c, clock=lambda: now[0])
    readers = []
    for k in range(4):                           # one slow reader per (fake) second
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        s.connect(("127.0.0.1", _port(srv)))
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        wait_for(lambda: c.n == min(k + 1, 2) and s.recv(1, socket.MSG_PEEK), 30, 0.02,
                 "the answer to start")
        readers.append(s)
        now[0] += 1.0
    assert c.n == 2             # the 3rd and 4th were given the 2nd rendering, not a new one

    def value(s):
        out = b""
        while chunk := s.recv(1 << 20):
            out += chunk
        s.close()
        return int(float(out.rsplit(b" ", 1)[1]))
    assert [value(s) for s in readers] == [1, 2, 2, 2]


def test_the_rendering_is_let_go_between_scrapes(serve):
    """A 10 000-flow exposition is ~9.5 MB: the server holds it only while a scrape may reuse it
    (REUSE_S) or a reader is still being sent it, not until the next scrape."""
    now = [1000.0]
    c = Counting()
    srv = serve(c, clock=lambda: now[0])
    assert urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=30).read().count(
        b"\nfp_big{") == 50_000
    assert srv.rendering_held                   # reusable for REUSE_S
    now[0] += REUSE_S
    wait_for(lambda: not srv.rendering_held, 5, 0.02, "the rendering to be let go")
    assert urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=30).read().endswith(
        b" 2.0\n")                              # the next scrape renders anew
    assert c.n == 2


def _cert(tmp_path):
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=30)
    return crt, key


def _htpasswd(user, password):
    """A $2y$ bcrypt hash, made as the exporter docs say (htpasswd -B)."""
    out = subprocess.run(["htpasswd", "-nbBC", "5", user, password], check=True,
                         capture_output=True, text=True, timeout=30).stdout.strip()
    return out.split(":", 1)[1]


def _web_config(tmp_path, tls=True, users=True):
    text = ""
    if tls:
        crt, key = _cert(tmp_path)
        text += f"tls_server_config:\n  cert_file: {crt.name}\n  key_file: {key.name}\n"
    if users:
        text += f"basic_auth_users:\n  prom: '{_htpasswd('prom', 's3cret')}'\n"
    p = tmp_path / "web.yml"
    p.write_text(text)
    return p


def _get(url, cafile=None, auth=None, timeout=5):
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    return urllib.request.urlopen(req, timeout=timeout, context=ctx)


def test_tls_and_basic_auth_from_the_web_config_file(serve, tmp_path, caplog):
    cfg = _web_config(tmp_path)
    srv = serve(web_config=webconfig.load(str(cfg)))
    url = f"https://{srv.address}/metrics"
    assert b"fp_test" in _get(url, tmp_path / "cert.pem", "prom:s3cret").read()
    for auth in (None, "prom:wrong", "other:s3cret", "prom"):
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(url, tmp_path / "cert.pem", auth)
        assert e.value.code == 401 and "Basic" in e.value.headers["WWW-Authenticate"]
    # plain HTTP to the TLS port and a half-done handshake: closed, nothing but debug lines
    caplog.set_level(logging.DEBUG, logger="flowpacer.surfaces.metrics")
    try:
        assert not _raw(srv, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200")
    except ConnectionResetError:
        pass
    with socket.create_connection(("127.0.0.1", _port(srv)), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x00\x05abc")
    assert b"fp_test" in _get(url, tmp_path / "cert.pem", "prom:s3cret").read()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_basic_auth_without_tls(serve, tmp_path):
    srv = serve(web_config=webconfig.load(str(_web_config(tmp_path, tls=False))))
    assert b"fp_test" in _get(f"http://{srv.address}/metrics", auth="prom:s3cret").read()
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(f"http://{srv.address}/metrics")
    assert e.value.code == 401


@pytest.mark.parametrize("text,why", [
    ("tls_server_config:\n  cert_file: a.pem\n", "key_file is required"),
    ("tls_server_config:\n  cert_file: a.pem\n  key_file: b.pem\n", "TLS certificate or key"),
    ("basic_auth_users:\n  prom: plaintext\n", "expected a bcrypt hash"),
    ("http_server_config:\n  http2: false\n", "unsupported keys: http_server_config"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  cipher_suites: [x]\n",
     "unsupported keys: cipher_suites"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAndVerifyClientCert\n",
     "needs client_ca_file"),
    ("[1, 2", "not YAML"),
    ("- a\n", "expected a mapping"),
])
def test_bad_web_config_is_one_line(tmp_path, text, why):
    p = tmp_path / "web.yml"
    p.write_text(text)
    with pytest.raises(webconfig.WebConfigError) as e:
        webconfig.load(str(p))
    assert why in str(e.value) and "\n" not in str(e.value)


@pytest.mark.kernel          # root: chown, root-owned files
def test_unix_socket_listener(serve, tmp_path):
    d = tmp_path / "m"
    d.mkdir(mode=0o750)
    os.chown(d, 0, 65534)
    path = str(d / "metrics.sock")
    serve(listen=f"unix:{path}")
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == 65534                      # the directory's group may scrape
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 ") and b'fp_test{i="1"} 1.0' in out
    # a regular file where the socket should go is not removed
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a socket"):
        MetricsServer(f"unix:{tmp_path / 'file'}", Fixed())
    with pytest.raises(ValueError, match="unix:/ABSOLUTE/PATH"):
        MetricsServer("unix:relative.sock", Fixed())


# ------------------------------------------------------------------ a real daemon

def _tasks_fds(pid):
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


IDLE_CLIENT = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
socks = []
for i in range(int(sys.argv[1])):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", 9717))
    if i % 2:
        try:
            s.send(b"GET /metr")          # half a request head, never finished
        except OSError:
            pass
    socks.append(s)
print("open", len(socks), flush=True)
sys.stdin.read()                          # held until the test closes our stdin
for s in socks:
    s.close()
print("closed", flush=True)
"""


@pytest.mark.kernel
def test_thousand_idle_unprivileged_connections(testbed, tmp_path):
    d = Daemon(testbed, tmp_path, RULES_ESC).start()
    try:
        pid = d.pid()

        def scrape():
            with in_netns(testbed.server_ns):
                return urllib.request.urlopen("http://127.0.0.1:9717/metrics", timeout=5).read()
        assert b"flowpacer_info" in scrape()
        base_tasks, base_fds = _tasks_fds(pid)
        p = testbed.popen(testbed.server_ns, ["setpriv", "--reuid=65534", "--regid=65534",
                                              "--clear-groups", PY, "-c", IDLE_CLIENT, "1000"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().split() == ["open", "1000"]
            most = (0, 0)
            t_end = time.monotonic() + 3
            while time.monotonic() < t_end:      # bounded: 3 s of samples while they are held
                tasks, fds = _tasks_fds(pid)
                most = (max(most[0], tasks), max(most[1], fds))
                t0 = time.monotonic()
                assert b"flowpacer_info" in scrape()      # a scrape still answers, promptly
                assert time.monotonic() - t0 < 1.0
            print(f"daemon tasks {base_tasks} -> at most {most[0]}, fds {base_fds} -> at most "
                  f"{most[1]} with 1000 idle connections", file=sys.stderr)
            assert most[0] <= base_tasks + 1
            assert most[1] <= base_fds + MAX_CONNECTIONS + 2
        finally:
            p.stdin.close()
            assert p.stdout.readline().strip() == "closed"
            p.wait(timeout=10)
        wait_for(lambda: _tasks_fds(pid)[1] <= base_fds + 2, 15, 0.1, "the fds to be given back")
        assert b"flowpacer_info" in scrape()
        assert d.alive()
    finally:
        assert d.stop() == 0
    assert not list(tracebacks(d.log_text()))
    assert "BrokenPipe" not in d.log_text() and "ConnectionReset" not in d.log_text()


RULES_ESC = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: esc
        match: {process: "py?[[]31mX", direction: inbound, local_port: 9105}   # ? is the ESC
        rate: 10mbit
"""


@pytest.mark.kernel
def test_a_process_name_with_an_escape_is_escaped_everywhere(testbed, tmp_path):
    from harness.terminal import Tmux
    testbed.popen(testbed.server_ns, server_argv([9105], ESC_NAME))
    testbed.wait_listening(9105)
    d = Daemon(testbed, tmp_path, RULES_ESC, "-v").start()          # -v -v: debug lines too
    tmux = Tmux(tmp_path)
    try:
        testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9105, 20))
        f = wait_for(lambda: [f for f in d.flows() if f["bytes"] > 0], 10, 0.05,
                     "the flow of the process with the escape")[0]
        assert f["process"] == ESC_NAME and f["rule"] == "esc"        # JSON carries it as \u001b

        # flowpacer status (text)
        out = testbed.run(testbed.server_ns, [PY, "-m", "flowpacer", "status", "--socket",
                                              d.sock]).stdout
        assert ESC_SHOWN in out and "\x1b" not in out, out

        # the metrics
        with in_netns(testbed.server_ns):
            text = urllib.request.urlopen("http://127.0.0.1:9717/metrics", timeout=5).read().decode()
        assert "\x1b" not in text
        assert f'process="{ESC_SHOWN}"' in text.replace("\\\\", "\\")

        # flowpacer top, in a real terminal: a raw ESC would colour the screen, not show
        tmux.start([PY, "-m", "flowpacer", "top", "--socket", d.sock, "--interval", "0.5"])
        screen = tmux.wait_screen(lambda s: ESC_SHOWN in s, 15, "the escaped name in top")
        assert "pyX" not in screen
        tmux("send-keys", "-t", "t", "q")
        assert tmux.wait_exit() == 0
    finally:
        tmux.close()
        assert d.stop() == 0
    # the daemon's log (debug level): flows are logged by address, never with a raw ESC (a rule
    # cannot name one: the rules loader refuses control characters in process patterns)
    raw = d.log.read_bytes()
    assert b"\x1b" not in raw and b"DEBUG" in raw


@pytest.mark.kernel
def test_tls_auth_and_prefix_addresses_on_the_command_line(testbed, tmp_path):
    cfg = _web_config(tmp_path)
    testbed.popen(testbed.server_ns, server_argv([9105], ESC_NAME))
    testbed.wait_listening(9105)
    d = Daemon(testbed, tmp_path, RULES_ESC, "--metrics-addresses", "prefix",
               "--web.config.file", str(cfg)).start()
    try:
        testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9105, 20,
                                                     local_port=46105))
        wait_for(lambda: [f for f in d.flows() if f["bytes"] > 0], 10, 0.05, "a shaped flow")

        def scrape(auth="prom:s3cret"):
            with in_netns(testbed.server_ns):
                return _get("https://127.0.0.1:9717/metrics", tmp_path / "cert.pem", auth).read()
        samples = [s for f in text_string_to_metric_families(scrape().decode()) for s in f.samples
                   if s.name == "flowpacer_flow_sent_bytes_total"]
        assert len(samples) == 1
        net = ipaddress.ip_network(f"{testbed.client_v4}/24", strict=False)
        assert samples[0].labels["remote_address"] == str(net)
        assert str(testbed.client_v4) not in scrape().decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(None)
        assert e.value.code == 401
    finally:
        assert d.stop() == 0
    # a broken web config stops the start with one line
    bad = tmp_path / "bad.yml"
    bad.write_text("basic_auth_users:\n  prom: plaintext\n")
    (tmp_path / "d2").mkdir()
    d2 = Daemon(testbed, tmp_path / "d2", RULES_ESC, "--web.config.file", str(bad)).start(wait=False)
    assert d2.proc.wait(timeout=60) == 1
    last = d2.log_text().strip().splitlines()[-1]
    assert "expected a bcrypt hash" in last and not list(tracebacks(d2.log_text()))
    assert testbed.run(testbed.server_ns, ["tc", "qdisc", "show", "dev",
                                           testbed.server_if]).stdout.split()[1] != "htb"


@pytest.mark.kernel
def test_unix_listener_and_no_addresses_on_the_command_line(testbed, tmp_path):
    path = tmp_path / "metrics.sock"
    testbed.popen(testbed.server_ns, server_argv([9105], ESC_NAME))
    testbed.wait_listening(9105)
    d = Daemon(testbed, tmp_path, RULES_ESC, "--metrics", f"unix:{path}",
               "--metrics-addresses", "none").start()
    try:
        testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9105, 20))
        testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9105, 20))
        wait_for(lambda: len([f for f in d.flows() if f["bytes"] > 0]) == 2, 10, 0.05,
                 "two shaped flows")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660

        def scrape():
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(path))
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
            return out.split(b"\r\n\r\n", 1)[1].decode()
        text = scrape()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "flowpacer_flow_sent_bytes_total"]
        assert len(samples) == 1                          # the two flows share one series
        assert {k: v for k, v in samples[0].labels.items() if k.endswith(("address", "port"))} == \
            {"local_address": "", "local_port": "", "remote_address": "", "remote_port": ""}
        assert str(testbed.client_v4) not in text and str(testbed.server_v4) not in text
        first = samples[0].value
        wait_for(lambda: [s for f in text_string_to_metric_families(scrape()) for s in f.samples
                          if s.name == "flowpacer_flow_sent_bytes_total"
                          and s.value > first], 5, 0.1, "the merged counter to grow")
    finally:
        assert d.stop() == 0
    assert not path.exists()
