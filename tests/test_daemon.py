"""The daemon end to end: real server and client processes, real kernel, rates measured at the
receiver. Each test runs `flowpacer run` inside the server namespace of its own testbed."""
import json
import os
import signal
import subprocess

import pytest

from flowpacer.surfaces.control import call
from harness.capture import qdisc_kind
from harness.daemon import RULES, Daemon
from harness.testbed import PY, client_argv, server_argv, wait_for
from harness import traffic
from harness.traffic import WIRE

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_flows_get_their_rule_rates_and_unmatched_is_unshaped(testbed, daemon, v6):
    testbed.popen(testbed.server_ns, server_argv([9101, 9102, 9103], "fp-test-srv", v6=True))
    testbed.wait_listening(9101)
    daemon.start()
    host = str(testbed.server_v6 if v6 else testbed.server_v4)
    clients = {p: testbed.popen(testbed.client_ns, client_argv(host, p, 6, warmup=1.5),
                                stdout=subprocess.PIPE, text=True) for p in (9101, 9102, 9103)}
    res = {p: json.loads(c.communicate(timeout=60)[0].splitlines()[-1]) for p, c in clients.items()}
    # payload per wire byte of the family: IPv6's headers are 20 bytes longer (with IPv4's
    # figure an IPv6 flow had only 1.6 % of the 3 % band below it, and a loaded run fell out)
    wire = traffic.wire(v6)
    assert res[9101]["goodput_bps"] == pytest.approx(10e6 / 8 * wire, rel=0.03)
    assert res[9102]["goodput_bps"] == pytest.approx(100e6 / 8 * wire, rel=0.03)
    assert res[9103]["goodput_bps"] > 2 * 100e6 / 8          # unmatched: far above any rule
    # all flows closed: their classes go within a second or so
    wait_for(lambda: not daemon.flows(), 3, 0.05, "classes of closed flows to go")


def test_status_shows_each_flow(testbed, daemon):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    daemon.start()
    c = testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 4, local_port=45001),
                      stdout=subprocess.PIPE, text=True)
    flows = wait_for(lambda: [f for f in daemon.flows() if f["bytes"] > 0], 5, 0.05, "a shaped flow")
    f = flows[0]
    assert f["rule"] == "slow" and f["process"] == "fp-test-srv" and f["pid"] > 0
    assert f["local"] == f"{testbed.server_v4}:9101" and f["remote"] == f"{testbed.client_v4}:45001"
    assert f["classid"].startswith("f1f0:") and f["rate_bit"] == 10_000_000
    assert f["direction"] == "inbound"
    st = daemon.status()
    assert st["backend"] == "htb" and st["interface"] == testbed.server_if
    # the CLI prints the same as a table
    out = testbed.run(testbed.server_ns, [PY, "-m", "flowpacer", "status", "--socket", daemon.sock]).stdout
    assert "slow" in out and "fp-test-srv" in out and f"{testbed.client_v4}:45001" in out
    c.communicate(timeout=30)


def test_outbound_flows_of_a_client_process(testbed, daemon):
    """Connections the target process makes (outbound) get their rule; they go when closed."""
    testbed.popen(testbed.client_ns, server_argv([9201], "fp-peer-srv"))
    testbed.wait_listening(9201, ns=testbed.client_ns)
    daemon.start()
    c = testbed.popen(testbed.server_ns, [PY, "-m", "harness.blaster", "fetch", "--host",
                                          str(testbed.client_v4), "--port", "9201", "--seconds", "3",
                                          "--name", "fp-test-cli"], stdout=subprocess.PIPE, text=True)
    f = wait_for(lambda: [x for x in daemon.flows() if x["rule"] == "out"], 5, 0.05,
                 "the outbound flow")[0]
    assert f["direction"] == "outbound" and f["process"] == "fp-test-cli"
    assert f["remote"] == f"{testbed.client_v4}:9201"
    assert json.loads(c.communicate(timeout=60)[0].splitlines()[-1])["bytes"] > 0
    wait_for(lambda: not daemon.flows(), 3, 0.05, "the closed flow's class to go")


def test_daemon_started_after_flows_exist_shapes_them(testbed, tmp_path):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    c = testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 8, warmup=4),
                      stdout=subprocess.PIPE, text=True)
    wait_for(lambda: "9101" in testbed.run(testbed.server_ns, ["ss", "-Htn", "state", "established"]).stdout,
             5, 0.05, "the flow")
    d = Daemon(testbed, tmp_path, RULES, "--no-tracer").start()
    try:
        f = wait_for(lambda: d.flows(), 3, 0.05, "the existing flow to be shaped")[0]
        assert f["rule"] == "slow" and f["source"] == "reconcile"
        res = json.loads(c.communicate(timeout=60)[0].splitlines()[-1])
        assert res["goodput_bps"] == pytest.approx(10e6 / 8 * WIRE, rel=0.03)
        wait_for(lambda: not d.flows(), 3, 0.05, "the closed flow's class to go")
    finally:
        assert d.stop() == 0
    assert qdisc_kind(testbed) != "htb"           # SIGTERM removed everything


def test_sighup_reload_rerates_in_place_and_bad_file_keeps_old_rules(testbed, daemon):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    daemon.start()
    c = testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 6, warmup=3),
                      stdout=subprocess.PIPE, text=True)
    # the flow's class once its handshake's claim is handled (ci33: under load the tracer's
    # event made class :10 first, then the claim rebound the flow to its pool class)
    f = wait_for(daemon.settled_flows, 10, 0.05, "a shaped flow, its first-byte claim handled")[0]
    daemon.rules.write_text(daemon.rules.read_text().replace("rate: 10mbit", "rate: 30mbit"))
    daemon.proc.send_signal(signal.SIGHUP)
    g = wait_for(lambda: [x for x in daemon.flows() if x["rate_bit"] == 30_000_000], 5, 0.05,
                 "the new rate")[0]
    assert g["classid"] == f["classid"]                      # same class, changed in place
    res = json.loads(c.communicate(timeout=60)[0].splitlines()[-1])
    assert res["goodput_bps"] == pytest.approx(30e6 / 8 * WIRE, rel=0.03)
    # an invalid file changes nothing and says why
    daemon.rules.write_text(daemon.rules.read_text().replace("rate: 30mbit", "rate: 30parsecs"))
    r = call(daemon.sock, {"cmd": "reload"})
    assert r["ok"] is False and any(":" in e and "rate" in e for e in r["errors"])
    assert daemon.status()["counters"]["reloads_failed"] == 1
    assert daemon.proc.poll() is None


def test_bad_rules_exit_2_with_file_line_col(testbed, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("interface: x\nrules:\n  - name: a\n    match: {process: a}\n    rate: 0mbit\n")
    r = subprocess.run([PY, "-m", "flowpacer", "run", "--rules", str(p), "--socket",
                        str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(f"{p}:5:") and "Traceback" not in r.stderr


def test_occupied_root_qdisc_is_refused(testbed, daemon):
    testbed.run(testbed.server_ns, ["tc", "qdisc", "add", "dev", testbed.server_if, "root", "handle",
                                    "7:", "tbf", "rate", "5mbit", "burst", "10k", "latency", "5ms"])
    daemon.start(wait=False)
    assert daemon.proc.wait(timeout=60) == 1
    err = daemon.log.read_text().strip().splitlines()[-1]
    assert "already has a root qdisc (tbf 7:0)" in err and "--take-over" in err
    assert "Traceback" not in daemon.log.read_text()
    assert qdisc_kind(testbed) == "tbf"


def test_cleanup_command(testbed, daemon):
    daemon.start()
    daemon.proc.send_signal(signal.SIGKILL)                  # dies without cleaning up
    daemon.proc.wait(timeout=10)
    assert qdisc_kind(testbed) == "htb"
    r = testbed.run(testbed.server_ns, [PY, "-m", "flowpacer", "cleanup", "--interface",
                                        testbed.server_if])
    assert "removed" in r.stdout and qdisc_kind(testbed) != "htb"


@pytest.mark.parametrize("uid,mode,why", [(0, 0o664, "writable by group or others (mode 0664)"),
                                          (0, 0o646, "writable by group or others (mode 0646)"),
                                          (1000, 0o644, "owned by uid 1000, not root")])
def test_rules_file_must_be_root_owned_and_not_writable_by_others(testbed, tmp_path, uid, mode, why):
    d = Daemon(testbed, tmp_path, RULES)
    os.chown(d.rules, uid, 0)
    os.chmod(d.rules, mode)
    d.start(wait=False)
    assert d.proc.wait(timeout=60) == 1
    last = d.log.read_text().strip().splitlines()[-1]
    assert why in last and str(d.rules) in last and "Traceback" not in d.log.read_text()


def test_control_socket_is_root_only(testbed, daemon):
    import stat
    daemon.start()
    st = os.stat(daemon.sock)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    # an unprivileged local user cannot ask anything
    code = ("import socket,sys\n"
            "s=socket.socket(socket.AF_UNIX)\n"
            "try:\n s.connect(sys.argv[1])\nexcept PermissionError:\n print('refused')\n")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", PY, "-c",
                        code, daemon.sock], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "refused", r.stderr
