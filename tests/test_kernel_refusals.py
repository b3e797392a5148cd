"""The kernel says no (EEXIST, EBUSY, ENOBUFS): counted, reported in one line, healed, no crash."""
import errno
import socket
import subprocess

import pytest

from flowpacer.kernel.backend import tc as tcb
from flowpacer.kernel.backend.htb import HtbCodec
from flowpacer.errors import NetlinkError
from flowpacer.model import FlowKey, Op, OpKind, Shape
from flowpacer.kernel.tc import nl, u32
from harness.testbed import client_argv, in_netns, server_argv, wait_for

from harness.daemon import RULES, Daemon

pytestmark = pytest.mark.kernel
MBIT = 125_000


def tc(tb, *args):
    return tb.run(tb.server_ns, ["tc", *args], check=False)


def test_foreign_class_at_our_next_id_is_left_alone(testbed):
    with in_netns(testbed.server_ns):
        b = tcb.TcBackend(HtbCodec(), testbed.server_if, 1000 * MBIT)
        b.setup()
    tc(testbed, "class", "add", "dev", testbed.server_if, "parent", "f1f0:1", "classid", "f1f0:10",
       "htb", "rate", "3mbit")
    k = FlowKey(testbed.server_v4, 80, testbed.client_v4, 1234)
    with in_netns(testbed.server_ns):
        r = b.apply([Op(OpKind.ADD, k, Shape("t", MBIT, MBIT))])
        assert r.added == 0 and "File exists" in r.errors[0].reason
        r = b.apply([Op(OpKind.ADD, k, Shape("t", MBIT, MBIT))])       # the retry takes a new id
    assert r.added == 1 and b.classid_of(k) == nl.tc_handle(0xF1F0, 0x11)
    assert "rate 3Mbit" in tc(testbed, "class", "show", "dev", testbed.server_if, "classid", "f1f0:10").stdout


def test_enobufs_resyncs_from_the_kernel(testbed, tmp_path):
    """A receive buffer too small for the kernel's answers: the batch fails with ENOBUFS;
    resync() rebuilds the bookkeeping from the kernel and everything can be removed again.
    A batch asks for one ack per sendmsg, but the kernel answers each refusal: here, class ids
    of ours that someone else took (EEXIST), more of them than the buffer holds."""
    with in_netns(testbed.server_ns):
        rt = nl.RtnlSocket()
        b = tcb.TcBackend(HtbCodec(), testbed.server_if, 1000 * MBIT, rtnl=rt)
        b.setup()
    batch = tmp_path / "foreign.tc"
    batch.write_text("".join(f"class add dev {testbed.server_if} parent f1f0:1 classid f1f0:{m:x} "
                             "htb rate 3mbit\n" for m in range(0x10, 0x10 + 40)))
    testbed.run(testbed.server_ns, ["tc", "-batch", str(batch)])
    with in_netns(testbed.server_ns):
        rt._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        keys = [FlowKey(testbed.server_v4, 80, testbed.client_v4, 10000 + i) for i in range(3000)]
        with pytest.raises(NetlinkError) as e:
            b.apply([Op(OpKind.ADD, k, Shape("t", MBIT, MBIT)) for k in keys])
        assert e.value.errno == errno.ENOBUFS
        rt._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        b.resync()
        inst = b.installed()
        assert 0 < len(inst) <= 3000 and set(inst) <= set(keys)
        r = b.apply([Op(OpKind.REMOVE, k) for k in inst])
    assert r.removed == len(inst) and not r.errors
    out = tc(testbed, "filter", "show", "dev", testbed.server_if).stdout
    assert "flowid" not in out


def test_busy_class_is_retried_until_it_can_go(testbed, tmp_path):
    testbed.popen(testbed.server_ns, server_argv([9101], "fp-test-srv"))
    testbed.wait_listening(9101)
    d = Daemon(testbed, tmp_path, RULES, "--rescan", "0.2").start()
    try:
        # the download lasts until it is stopped below: a loaded CI host once took long enough to
        # list the flow that a 2 s download had ended before the admin's filter went in, and a
        # filter pointing at a class that is gone makes nothing busy
        c = testbed.popen(testbed.client_ns, client_argv(str(testbed.server_v4), 9101, 60),
                          stdout=subprocess.DEVNULL)
        f = wait_for(lambda: d.flows(), 15, 0.05, "the flow")[0]
        # an admin points a filter of their own at our flow's class: the class is busy
        r = tc(testbed, "filter", "add", "dev", testbed.server_if, "parent", "f1f0:", "protocol",
               "ip", "prio", "9", "u32", "match", "ip", "dst", "192.0.2.1/32", "flowid", f["classid"])
        assert r.returncode == 0, r.stderr
        assert f["classid"] in tc(testbed, "class", "show", "dev", testbed.server_if).stdout
        assert d.flows(), "the download ended before the filter went in"
        c.kill()                       # the flow ends: its class cannot go while the filter holds it
        c.wait(timeout=30)
        wait_for(lambda: "Device or resource busy" in d.log.read_text(), 15, 0.05, "EBUSY reported")
        assert d.proc.poll() is None and d.status()["counters"]["op_errors"] >= 1
        tc(testbed, "filter", "del", "dev", testbed.server_if, "parent", "f1f0:", "protocol", "ip",
           "prio", "9")
        wait_for(lambda: not d.flows() and f["classid"] not in
                 tc(testbed, "class", "show", "dev", testbed.server_if).stdout, 5, 0.05,
                 "the class to go once it is free")
    finally:
        d.stop()
