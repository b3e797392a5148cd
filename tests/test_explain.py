"""Issue 28: a way to ask why (``flowpacer explain``, ``status --all``, ``rules check``'s
warnings), reloads that fail when refused, logs with syslog priorities, ``--version``.

The pure tests run in ``make check``; ``test_explain_a_live_flow_...`` runs a real daemon on the
host's kernel with real traffic of both families (marker ``kernel``)."""
from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import json
import logging
import os
import re
import socket
import struct
import subprocess
import textwrap

import pytest
from click.testing import CliRunner

from flowpacer.model import (Direction, Flow, FlowKey, Match, PortSet, ProcessInfo, Protocol,
                             Rule)
from flowpacer.policy import engine
from flowpacer.surfaces import logs
from flowpacer.surfaces.cli import main

RULES = """\
    interface: eth0
    link_rate: 1gbit
    rules:
      - name: backup
        match: {exe: /usr/bin/rsync}
        rate: 100mbit
      - name: hifi
        match: {process: nginx, local_port: 8443, user: 33}
        rate: 20mbit
      - name: web
        match: {process: nginx, direction: inbound}
        rate: 8mbit
      - name: quic
        match: {process: nginx, protocol: udp}
        rate: 8mbit
        idle_timeout: 10s
      - name: up
        match: {process: "ngin*", remote: 198.51.100.0/24}
        receive_rate: 8mbit
"""


def write(tmp_path, text, name="rules.yaml", mode=0o644):
    f = tmp_path / name
    f.write_text(textwrap.dedent(text))
    f.chmod(mode)
    return f


def run(*args):
    r = CliRunner().invoke(main, list(args), prog_name="flowpacer")
    assert "Traceback" not in r.output and not isinstance(r.exception, (AssertionError,
                                                                       TypeError, KeyError)), \
        r.output
    return r


# ------------------------------------------------------------------ one matcher

def _flows():
    procs = [ProcessInfo(1, "nginx", "/usr/sbin/nginx", 33), ProcessInfo(2, "rsync",
                                                                        "/usr/bin/rsync", 0),
             ProcessInfo(3, "curl", "", 1000)]
    keys = [FlowKey(ipaddress.ip_address("192.0.2.1"), 8443, ipaddress.ip_address("198.51.100.9"),
                    40000),
            FlowKey(ipaddress.ip_address("2001:db8::1"), 443, ipaddress.ip_address("2001:db8::9"),
                    40000, Protocol.UDP),
            FlowKey.wire(ipaddress.ip_address("::ffff:192.0.2.1"), 80,
                         ipaddress.ip_address("::ffff:198.51.100.7"), 5000)]
    for p, k, d in itertools.product(procs, keys, (Direction.INBOUND, Direction.OUTBOUND)):
        yield Flow(k, d, p)


def _rules():
    from flowpacer.policy import rules
    return rules.loads(textwrap.dedent(RULES), "r.yaml")


def test_explain_walks_the_engines_own_matcher():
    rs = _rules()
    for flow in _flows():
        e = engine.explain(rs.rules, flow)
        assert e.rule is engine.first_match(rs.rules, flow)
        assert [r for r, _ in e.passed] == list(rs.rules[:e.index if e.rule else None])
        for r in rs.rules:
            every = engine.mismatches(r, flow, every=True)
            assert engine.rule_matches(r, flow) is (every == ())
            # the first failing field found when matching is one explain names
            assert engine.mismatches(r, flow)[:1] == every[:1]
        for r, fails in e.passed:
            assert fails and all(f in {x.name for x in dataclasses.fields(Match)}
                                 for f in fails)


def test_each_field_is_named_when_it_alone_fails():
    flow = Flow(FlowKey(ipaddress.ip_address("192.0.2.1"), 8443,
                        ipaddress.ip_address("198.51.100.9"), 40000),
                Direction.INBOUND, ProcessInfo(1, "nginx", "/usr/sbin/nginx", 33))
    cases = {"process": Match(process=("apache2",)), "exe": Match(exe=("/usr/bin/*sync",)),
             "user": Match(user=(0,)), "direction": Match(direction=Direction.OUTBOUND),
             "local_port": Match(local_port=PortSet(((80, 80),))),
             "remote_port": Match(remote_port=PortSet(((1, 1024),))),
             "remote": Match(remote=(ipaddress.ip_network("2001:db8::/32"),)),
             "protocol": Match(process=("nginx",), protocol=Protocol.UDP)}
    for field, m in cases.items():
        assert engine.mismatches(Rule("r", m, 1000), flow, every=True) == (field,), field


# ------------------------------------------------------------------ explain offline

def test_explain_a_described_flow_offline(tmp_path):
    f = write(tmp_path, RULES)
    r = run("explain", "--rules", str(f), "--process", "nginx", "--user", "33", "--exe",
            "/usr/sbin/nginx", "--direction", "inbound", "--local", "192.0.2.1:8443", "--remote",
            "198.51.100.9:40000")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [
        "flow: tcp 192.0.2.1:8443 <-> 198.51.100.9:40000, inbound, process nginx, exe "
        "/usr/sbin/nginx, uid 33",
        "  backup (line 4): no match on exe",
        "rule: hifi (line 7) wins: rate 20 Mbit/s per flow",
        "first byte: no: rule 'backup' (line 4) comes first and the kernel cannot tell that it "
        "does not match, so the flow is left to user space: exe patterns are matched in user "
        "space (the kernel has no path of the owner's executable at the handshake)"]


def test_explain_says_what_depends_on_fields_not_given(tmp_path):
    f = write(tmp_path, RULES)
    r = run("explain", "--rules", str(f), "--process", "nginx", "--local", ":443", "--remote",
            "[::ffff:198.51.100.9]:40000", "--direction", "outbound")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert out[0] == "flow: tcp *:443 <-> 198.51.100.9:40000, outbound, process nginx"
    assert out[1].startswith("  not given: exe, local address, user")
    assert out[2] == "  backup (line 4): may match, depends on exe (not given)"
    assert out[3] == "  hifi (line 7): no match on local_port (not given: user)"
    assert out[6] == ("rule: up (line 17) wins if the rules that may match above do not: "
                      "receive only: what the flow is sent is not shaped, receive_rate set "
                      "(uploads shaped)")


def test_explain_udp_and_no_match_and_json(tmp_path):
    f = write(tmp_path, RULES)
    r = run("explain", "--rules", str(f), "--process", "nginx", "--exe", "/usr/sbin/nginx",
            "--user", "0", "--direction", "inbound", "--protocol", "udp", "--local",
            "[2001:db8::1]:443", "--remote", "[2001:db8::9]:5000")
    assert "rule: quic (line 13) wins: rate 8 Mbit/s per flow" in r.output
    assert "first byte: no: not TCP: the first-byte program sees TCP handshakes only" in r.output
    r = run("explain", "--rules", str(f), "--process", "curl", "--exe", "/usr/bin/curl",
            "--user", "0", "--direction", "outbound", "--local", "192.0.2.1:5000", "--remote",
            "192.0.2.9:443", "--json")
    e = json.loads(r.output)["flows"][0]
    assert e["rule"] is None and [p["rule"] for p in e["passed"]] == [
        "backup", "hifi", "web", "quic", "up"]
    assert e["passed"][4]["fails"] == ["process", "remote"]


@pytest.mark.parametrize("args,msg", [
    (["--remote", "2001:db8::1:80000"], "an IPv6 address with a port is written [IPV6]:PORT"),
    (["--remote", "192.0.2.1:99999"], "'99999' is not a port"),
    (["--local", "nowhere:80"], "'nowhere' is not an IP address"),
    (["--local", "192.0.2.1:80", "--remote", "[2001:db8::1]:80"], "different address families"),
    (["--user", "no-such-user-here"], "unknown user 'no-such-user-here'"),
])
def test_explain_bad_input_is_one_line_no_traceback(tmp_path, args, msg):
    f = write(tmp_path, RULES)
    r = run("explain", "--rules", str(f), "--process", "x", *args)
    assert r.exit_code == 2 and msg in r.output, r.output


def test_explain_of_a_refused_file_prints_its_problems(tmp_path):
    f = write(tmp_path, "interface: eth0\nrules: [{name: a, match: {process: a}, rate: 8mbits}]\n")
    r = run("explain", "--rules", str(f), "--process", "a")
    assert r.exit_code == 2 and f"{f}:2:" in r.output and "did you mean 'mbit'" in r.output


def test_live_explain_without_a_daemon_is_one_line(tmp_path):
    r = run("explain", "--socket", str(tmp_path / "none.sock"), "--remote", "192.0.2.1")
    assert r.exit_code == 1 and r.output.startswith("flowpacer: no daemon answers on")
    r = run("explain", "--socket", str(tmp_path / "none.sock"))
    assert r.exit_code == 2 and "give the live flow's --local and/or --remote" in r.output


# ------------------------------------------------------------------ rules check

def test_rules_check_warns_and_strict_fails(tmp_path):
    f = write(tmp_path, RULES.replace("rate: 20mbit", "rate: 2500kbps") + textwrap.indent(
        "  - name: web2\n    match: {process: nginx, direction: inbound, local_port: 80}\n"
        "    rate: 8mbit\n", "    "))
    r = run("rules", "check", str(f))
    assert r.exit_code == 0, r.output
    assert f"{f}:9:11: rule 'hifi': rate: warning: '2500kbps' uses tc's byte unit" in r.output
    assert (f"{f}:21:12: rule 'web2': match: warning: never matches: rule 'web' (line 10)"
            in r.output)
    r = run("rules", "check", "--strict", str(f))
    assert r.exit_code == 2 and f"{f}:9:11: rule 'hifi': rate: '2500kbps'" in r.output
    r = run("rules", "check", "--strict", str(write(tmp_path, RULES, "clean.yaml")))
    assert r.exit_code == 0 and "warning" not in r.output, r.output


@pytest.mark.skipif(os.geteuid() != 0, reason="the files' owner is the test's user")
def test_rules_check_says_when_the_daemon_refuses_the_owner_or_mode(tmp_path):
    from flowpacer.policy import rules
    f = write(tmp_path, RULES, mode=0o664)
    r = run("rules", "check", str(f))
    why = rules.access_problem(str(f))          # the daemon's own check says the same
    assert why and "writable by group or others (mode 0664)" in why
    assert r.exit_code == 0 and f"{why}: warning: the daemon refuses this file" in r.output
    assert run("rules", "check", "--strict", str(f)).exit_code == 2
    os.chown(f, 1000, 0)
    f.chmod(0o644)
    r = run("rules", "check", str(f))
    assert "owned by uid 1000, not root" in r.output and "the daemon refuses" in r.output
    os.chown(f, 0, 0)
    assert "refuses" not in run("rules", "check", str(f)).output


# ------------------------------------------------------------------ logs, version

def test_version_is_the_packages():
    import re as _re
    text = open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")).read()
    want = _re.search(r'^version = "([^"]+)"', text, _re.M).group(1)
    r = run("--version")
    assert r.exit_code == 0 and r.output == f"flowpacer {want}\n"
    assert run("-V").output == r.output


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("flowpacer").level,
             logging.getLogger("pyroute2").level)
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])
    logging.getLogger("flowpacer").setLevel(saved[2])
    logging.getLogger("pyroute2").setLevel(saved[3])


def _journal_env(stream):
    st = os.fstat(stream.fileno())
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon's loader wants a root-owned file")
def test_under_journald_a_rules_warning_has_priority_4(tmp_path, restore_logging):
    from flowpacer.policy import rules
    f = write(tmp_path, RULES.replace("rate: 20mbit", "rate: 2500kbps"))
    with open(tmp_path / "stderr", "w+") as err:
        logs.setup(0, err, _journal_env(err), journal_socket=str(tmp_path / "no-journald"))
        rules.load_checked(str(f))
        logging.getLogger("flowpacer.x").info("an info line\nof two lines")
        logging.getLogger("flowpacer.x").debug("not shown without -v")
        err.seek(0)
        lines = err.read().splitlines()
    assert lines[0].startswith(f"<4>WARNING flowpacer.policy.rules: {f}:9:11: rule 'hifi': "
                               "rate: warning: '2500kbps'")
    assert lines[1:] == ["<6>INFO flowpacer.x: an info line", "<6>of two lines"]


def test_without_journald_lines_are_plain_and_v_shows_debug(tmp_path, restore_logging):
    with open(tmp_path / "stderr", "w+") as err:
        logs.setup(1, err, {"JOURNAL_STREAM": "1:2"})      # not our stream: no prefixes
        logging.getLogger("flowpacer.x").debug("shown with -v")
        logging.getLogger("pyroute2.x").debug("a library's: only with -vv")
        err.seek(0)
        text = err.read()
    assert re.search(r"^\S+ \S+ DEBUG flowpacer.x: shown with -v$", text, re.M), text
    assert "library" not in text and "<7>" not in text
    logs.setup(0, err)
    assert not logging.getLogger("flowpacer.x").isEnabledFor(logging.DEBUG)
    logs.setup(2, err)
    assert logging.getLogger("pyroute2.x").isEnabledFor(logging.DEBUG)


def _fields(datagram: bytes) -> dict:
    """journald's native protocol, read back (KEY=value lines; KEY\\n le64 size data\\n)."""
    out, i = {}, 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        line = datagram[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out[k.decode()] = v.decode()
            i = nl + 1
        else:
            size = struct.unpack("<Q", datagram[nl + 1:nl + 9])[0]
            out[line.decode()] = datagram[nl + 9:nl + 9 + size].decode()
            assert datagram[nl + 9 + size:nl + 10 + size] == b"\n"
            i = nl + 10 + size
    return out


def test_under_journald_records_carry_priority_and_fields(tmp_path, restore_logging):
    path = str(tmp_path / "journal.socket")
    journald = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journald.bind(path)
    journald.settimeout(5)
    try:
        with open(tmp_path / "stderr", "w+") as err:
            h = logs.setup(0, err, _journal_env(err), journal_socket=path)
            assert isinstance(h, logs.JournalHandler)
            log = logging.getLogger("flowpacer.daemon.x")
            log.warning("class space %d%% full", 95, extra={"FLOWPACER_RULE": "dl",
                                                          "not_a_field": 1})
            got = _fields(journald.recv(65536))
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("it failed")
            tb = _fields(journald.recv(65536))
            journald.close()
            log.error("journald went away")           # to stderr, with its priority
            err.seek(0)
            assert err.read() == "<3>ERROR flowpacer.daemon.x: journald went away\n"
    finally:
        journald.close()
    assert got["MESSAGE"] == "class space 95% full" and got["PRIORITY"] == "4"
    assert got["SYSLOG_IDENTIFIER"] == "flowpacer" and got["LOGGER"] == "flowpacer.daemon.x"
    assert got["CODE_FILE"] == __file__ and got["CODE_FUNC"] == \
        "test_under_journald_records_carry_priority_and_fields"
    assert got["FLOWPACER_RULE"] == "dl" and "not_a_field" not in got
    assert tb["PRIORITY"] == "3" and tb["MESSAGE"].startswith("it failed\nTraceback")
    assert "ValueError: boom" in tb["MESSAGE"]


# ------------------------------------------------------------------ a live daemon

LIVE_RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: byexe
        match: {exe: /nonexistent/fp-adm}
        rate: 5mbit
      - name: slow
        match: {process: fp-adm-srv, direction: inbound, local_port: 9101}
        rate: 1250kbps
"""


def _cli(*args, check_rc=0):
    from harness.testbed import PY
    r = subprocess.run([PY, "-m", "flowpacer", *args], capture_output=True, text=True,
                       timeout=60)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    if check_rc is not None:
        assert r.returncode == check_rc, r.stdout + r.stderr
    return r


@pytest.mark.kernel
def test_explain_a_live_flow_status_all_reload_refusal_and_log_priorities(testbed, tmp_path):
    """Real traffic of both families (IPv4, IPv6, IPv4 to a dual-stack server) through a
    daemon on the host's kernel: explain names the rule, the rule before it and its field,
    the class with its counters; status --all the unshaped flow and why; `flowpacer reload`
    (the unit's ExecReload=) exits 2 on a refused file; log lines carry syslog priorities
    under journald, debug ones with -v."""
    from harness.testbed import Daemon, client_argv, server_argv, wait_for
    tb = testbed
    tb.popen(tb.server_ns, server_argv([9101], "fp-adm-srv", v6=True))
    tb.popen(tb.server_ns, server_argv([9102], "fp-adm-oth", v6=True))
    tb.wait_listening(9101)
    tb.wait_listening(9102)
    log = tmp_path / "daemon.log"
    log.touch()                      # the daemon's stderr: JOURNAL_STREAM names this file
    st = os.stat(log)
    d = Daemon(tb, tmp_path, LIVE_RULES, "--no-tracer", "--rescan", "0.2",
               env=dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")).start()
    try:
        v4, v6 = str(tb.client_v4), str(tb.client_v6)
        tb.popen(tb.client_ns, client_argv(str(tb.server_v4), 9101, 20, local_port=45101))
        tb.popen(tb.client_ns, client_argv(str(tb.server_v6), 9101, 20, local_port=45102))
        tb.popen(tb.client_ns, client_argv(str(tb.server_v4), 9102, 20, local_port=45103))

        def shaped():
            fl = {f["remote"]: f for f in d.flows()}
            ok = [fl.get(f"{v4}:45101"), fl.get(f"[{v6}]:45102")]
            return ok if all(f and f["bytes"] > 0 for f in ok) else None
        wait_for(shaped, 15, 0.05, "both flows shaped with bytes sent")

        # the IPv4 flow, asked as the dual-stack socket sees its peer (IPv4-mapped)
        r = _cli("explain", "--socket", d.sock, "--remote", f"[::ffff:{v4}]:45101")
        out = r.stdout.splitlines()
        assert re.fullmatch(rf"flow: tcp {tb.server_v4}:9101 <-> {v4}:45101, inbound, process "
                            r"fp-adm-srv \(pid \d+, uid 0\), exe /\S+", out[0]), out[0]
        assert out[1] == "  byexe (line 6): no match on exe"
        assert out[2] == "rule: slow (line 9) wins: rate 10 Mbit/s per flow"
        assert out[3].startswith("first byte: no: rule 'byexe' (line 6) comes first and the "
                                 "kernel cannot tell that it does not match")
        assert re.fullmatch(r"class: \S+ \(send\) rule slow, rate 10 Mbit/s, ceil 10 Mbit/s, "
                            r"sent [\d.]+ [kMG]?B in \d+ packets, 0 dropped", out[4]), out[4]
        # the IPv6 flow, by JSON: its class and counters are the status answer's
        e = json.loads(_cli("explain", "--socket", d.sock, "--remote", f"[{v6}]:45102",
                            "--json").stdout)
        assert e["matched"] == 1
        f = e["flows"][0]
        assert (f["rule"], f["process"], f["direction"]) == ("slow", "fp-adm-srv", "inbound")
        assert f["passed"] == [{"rule": "byexe", "line": 6, "fails": ["exe"],
                                "undecided": False}]
        c = f["classes"][0]
        assert c["rate_bit"] == 10_000_000 and c["bytes"] > 0 and c["packets"] > 0
        assert f["unshaped"] == ""
        # the flow no rule matches: explain and status --all say so
        e = json.loads(_cli("explain", "--socket", d.sock, "--local", ":9102", "--json").stdout)
        assert [(x["rule"], x["unshaped"], x["classes"]) for x in e["flows"]] == \
            [(None, "no rule matches it", [])]
        assert [p["fails"] for p in e["flows"][0]["passed"]] == [["exe"],
                                                                 ["process", "local_port"]]
        text = _cli("status", "--all", "--socket", d.sock).stdout
        assert "flows:     2 shaped of 3 live" in text, text
        rows = text[text.index("not shaped: 1"):].splitlines()
        assert re.fullmatch(rf"\d+\s+fp-adm-oth\s+tcp\s+inbound\s+{tb.server_v4}:9102\s+"
                            rf"{v4}:45103\s+no rule matches it", rows[2].strip()), rows
        assert "not shaped" not in _cli("status", "--socket", d.sock).stdout

        # ExecReload=flowpacer reload: a refused file fails the reload, the old rules stay
        good = d.rules.read_text()
        d.rules.write_text(good.replace("rate: 5mbit", "rate: 5mbits"))
        r = _cli("reload", "--socket", d.sock, check_rc=2)
        assert f"{d.rules}:8:11: rule 'byexe': rate: unknown rate unit 'mbits'" in r.stderr
        d.rules.chmod(0o666)
        d.rules.write_text(good)
        r = _cli("reload", "--socket", d.sock, check_rc=2)
        assert "writable by group or others (mode 0666)" in r.stderr
        d.rules.chmod(0o644)
        assert _cli("reload", "--socket", d.sock).stdout.startswith("reloaded:")
        assert all(f["rate_bit"] == 10_000_000 for f in d.flows())
    finally:
        code = d.stop()
    assert code == 0
    lines = d.log_text().splitlines()
    if os.path.exists(logs.JOURNAL_SOCKET):        # a host with journald: its native socket
        j = subprocess.run(["journalctl", f"_PID={d.proc.pid}", "-p", "warning", "-o", "cat",
                            "--no-pager"], capture_output=True, text=True, timeout=30).stdout
        assert "'1250kbps' uses tc's byte unit" in j and "reload refused" in j, j
    else:
        warn = [ln for ln in lines if "'1250kbps' uses tc's byte unit" in ln]
        assert warn and all(ln.startswith("<4>WARNING flowpacer.policy.rules: ") for ln in warn)
        assert any(ln.startswith("<3>ERROR flowpacer.daemon.reconciler: reload refused")
                   for ln in lines), lines
        assert any(ln.startswith("<6>INFO flowpacer.daemon.app: ready") for ln in lines)
        assert any(ln.startswith("<7>DEBUG flowpacer.") for ln in lines), lines   # -v
        assert all(re.match(r"<[0-7]>", ln) for ln in lines), lines


# ------------------------------------------------------------------ the daemon's answers (fakes)

def test_the_daemons_explain_and_status_all_answers(tmp_path):
    """The control socket's explain and status --all answers of a daemon wired to fakes: every
    live flow with its rule or the reason it has none, addresses of both families (an
    IPv4-mapped question finds the IPv4 flow), bad requests answered with one line."""
    from flowpacer.policy import rules
    from harness.fakes import FakeSockDiag, inprocess_daemon
    from harness.testbed import wait_for
    from flowpacer.surfaces.view import parse_explain, parse_unshaped
    rs = rules.loads(textwrap.dedent("""\
        interface: eth0
        link_rate: 1gbit
        rules:
          - {name: slow, match: {process: srv, local_port: 9101}, rate: 10mbit}
          - {name: up, match: {process: upl}, receive_rate: 8mbit}
    """), "r.yaml")
    A = ipaddress.ip_address

    def flow(local, lport, remote, rport, comm, pid=7):
        return Flow(FlowKey(A(local), lport, A(remote), rport), Direction.INBOUND,
                    ProcessInfo(pid, comm, "/usr/bin/" + comm if comm else "", 33 if pid else -1))
    flows = [flow("192.0.2.1", 9101, "198.51.100.7", 40001, "srv"),
             flow("2001:db8::1", 9101, "2001:db8::7", 40002, "srv"),
             flow("192.0.2.1", 9102, "198.51.100.7", 40003, "other"),
             flow("192.0.2.1", 9103, "198.51.100.7", 40004, "upl"),
             flow("192.0.2.1", 9101, "198.51.100.8", 40005, "", pid=0)]
    sd = FakeSockDiag()
    sd.flows = {f.key: f for f in flows}
    with inprocess_daemon(tmp_path, rs, sockdiag=sd, tracer_enabled=False) as d:
        wait_for(lambda: sorted(f["side"] for f in d.status()["flows"]) == [
            "receive", "send", "send"], 5, 0.01, "two flows shaped, one receiving")
        e = parse_explain(d._handle({"cmd": "explain", "remote_addr": "::ffff:198.51.100.7",
                                     "remote_port": 40001}))
        assert [(x.rule, x.local, x.remote, x.unshaped) for x in e] == [
            ("slow", "192.0.2.1:9101", "198.51.100.7:40001", "")]
        assert e[0].classes[0].rate_bit == 10_000_000 and e[0].first_byte is True
        e = parse_explain(d._handle({"cmd": "explain", "local_port": "9101", "protocol": "tcp"}))
        assert [x.remote for x in e] == ["198.51.100.7:40001", "198.51.100.8:40005",
                                         "[2001:db8::7]:40002"]
        assert e[2].rule == "slow" and e[2].classes and e[2].first_byte_why.startswith(
            "rule 'slow' is decided in the kernel")
        un = parse_unshaped(d._handle({"cmd": "status", "all": True}))
        assert [(k.local_port, why) for k, _pid, _p, _d, why in un] == [
            (9101, "its owner is not known yet (sock_diag found it before the tracer or /proc "
                   "did)"),
            (9102, "no rule matches it"),
            (9103, "rule 'up' matches and is receive-only: what the flow is sent is not shaped")]
        assert "unshaped" not in d._handle({"cmd": "status"})
        for bad in ({}, {"remote_port": "http"}, {"remote_port": 70000}, {"remote_addr": [1]},
                    {"local_addr": "example.org"}, {"protocol": "sctp"},
                    {"remote_port": True}):
            answer = d._handle({"cmd": "explain", **bad})
            assert list(answer) == ["error"] and answer["error"].startswith("explain: "), answer
        assert d._handle({"cmd": "explain", "remote_port": 1})["flows"] == []


def test_a_refused_class_is_logged_with_its_flow_and_rule_as_journal_fields(tmp_path, caplog):
    """What ``journalctl -u flowpacer FLOWPACER_RULE=slow`` finds: the reconciler's warning for
    a class the kernel refused carries the flow, the op and the rule (the JournalHandler sends
    every FLOWPACER_* attribute of a record as a field)."""
    from flowpacer.policy import rules
    from harness.fakes import FakeSockDiag, inprocess_daemon
    from harness.testbed import wait_for
    rs = rules.loads("interface: eth0\nlink_rate: 1gbit\nrules:\n"
                     "  - {name: slow, match: {process: srv}, rate: 10mbit}\n", "r.yaml")
    f = Flow(FlowKey(ipaddress.ip_address("2001:db8::1"), 9101, ipaddress.ip_address(
        "2001:db8::7"), 40001), Direction.INBOUND, ProcessInfo(7, "srv", "/usr/bin/srv", 33))
    caplog.set_level(logging.WARNING, logger="flowpacer.daemon.reconciler")
    with inprocess_daemon(tmp_path, rs, sockdiag=FakeSockDiag(), tracer_enabled=False) as d:
        d.supervisor.backend.refuse.add(f.key)
        d.sockdiag.flows = {f.key: f}            # the flow shows up once the refusal is set
        rec = wait_for(lambda: [r for r in caplog.records if hasattr(r, "FLOWPACER_FLOW")], 5,
                       0.01, "the refusal's warning")[0]
    fields = logs.JournalHandler("/nonexistent").fields(rec).decode()
    assert f"FLOWPACER_FLOW={f.key}\n" in fields and "FLOWPACER_RULE=slow\n" in fields
    assert "FLOWPACER_OP=add\n" in fields and "PRIORITY=4\n" in fields
