"""The psp module in the kernel: load/unload, qdisc and class life cycle under real traffic, and
every bad option refused with its extack message (dmesg checked by the autouse fixture).

Traffic is iperf3 between the two namespaces of a ``pacing.Testbed``, captured at the receiver;
rates are frame bytes per second there (what psp paces), over windows well after each change.
"""
from __future__ import annotations

import errno
import struct
import time

from harness import psplib
from harness.pacing import Capture, Iperf, IPERF_PORT, Psp, Testbed, mbit, to_mbit, wait_for, window_rate
from harness.psplib import (NLM_F_CREATE, NLM_F_EXCL, QDISC, RTM_DELTCLASS, RTM_NEWQDISC,  # noqa: F401
                    RTM_NEWTCLASS, TC_H_ROOT, PspNl, expect_refused, h)
from flowpacer.kernel.tc import nl as N
from flowpacer.kernel.tc import psp as enc

U32 = lambda v: struct.pack("=I", v)  # noqa: E731
U64 = lambda v: struct.pack("=Q", v)  # noqa: E731
RATE_MAX = enc.PSP_RATE_MAX
FILTER = ["protocol", "ip", "prio", "1", "u32", "match", "ip", "dport", str(IPERF_PORT), "0xffff",
          "flowid"]


def opts(*attrs: bytes, nested: bool = True) -> bytes:
    """TCA_KIND psp + TCA_OPTIONS holding ``attrs`` (raw, as given)."""
    return N.nla_str(N.TCA_KIND, "psp") + N.nla(N.TCA_OPTIONS | (N.NLA_F_NESTED if nested else 0),
                                                b"".join(attrs))


def a64(t: int, v: int) -> bytes:
    return N.nla(t, U64(v))


def a32(t: int, v: int) -> bytes:
    return N.nla(t, U32(v))


def snapshot(sock: PspNl, dev: str):
    """What a refused request must not change: the qdisc's options and every class's."""
    q = sock.root(dev)
    cls = {m: (c.rate, c.ceil, c.limit, c.xstats["flags"] & 3)
           for m, c in sock.classes(dev).items()}
    return (q.link_rate, q.defcls, q.overhead, q.limit, q.catchup_ns) if q else None, cls


def add_filter(tb: Testbed, minor: int) -> None:
    tb.s("tc", "filter", "add", "dev", tb.sender_dev, "parent", "f1f0:", *FILTER, f"f1f0:{minor:x}")


def del_filter(tb: Testbed) -> None:
    tb.s("tc", "filter", "del", "dev", tb.sender_dev, "parent", "f1f0:", "protocol", "ip",
         "prio", "1")


# ------------------------------------------------------------------ load / unload

def test_module_load_use_unload(psp_module):
    """rmmod/insmod with a clean kernel log; a qdisc in use pins the module; once it is gone
    the module unloads, and loads again."""
    psplib.unload()
    assert not psplib.loaded()
    psplib.load()
    assert psplib.loaded() and psplib.refcnt() == 0
    with Testbed() as tb, PspNl(tb.sender_ns) as sock:
        sock.add_qdisc(tb.sender_dev, link_rate_bps=mbit(100))
        assert psplib.refcnt() >= 1
        busy = psplib._run(["rmmod", psplib.MODULE])
        assert busy.returncode != 0 and psplib.loaded(), "a module in use must refuse to unload"
        tb.s("busybox", "ping", "-c", "3", "-i", "0.2", "-W", "5", tb.receiver_addr)
        default = sock.classes(tb.sender_dev)[2]
        assert default.stats["packets"] >= 3          # unclassified: the default class
        assert sock.root(tb.sender_dev).xstats["unpaced_pkts"] >= 3
        assert sock.del_root(tb.sender_dev) == (0, None)
    wait_for(lambda: psplib.refcnt() == 0, 15, "the last psp qdisc to be freed")
    psplib.unload()
    assert not psplib.loaded()
    psplib.load()
    assert psplib.loaded()


def test_qdisc_defaults_dump_and_change(bed):
    tb, sock = bed
    dev = tb.sender_dev
    # no options: the veth's ethtool speed (10000 Mb/s), the documented defaults
    err = sock.qdisc_req(dev, NLM_F_CREATE | NLM_F_EXCL, opts())
    assert err == (0, None)
    q = sock.root(dev)
    assert (q.link_rate, q.defcls, q.overhead, q.limit) == (10_000 * 10**6 // 8, 2, 0, 1000)
    assert q.catchup_ns == enc.PSP_DEFAULT_CATCHUP_NS == 50 * 10**6
    assert q.xstats["classes"] == 1 and q.xstats["link_rate"] == q.link_rate
    cls = sock.classes(dev)
    assert list(cls) == [2]
    d = cls[2]
    assert (d.rate, d.ceil, d.limit) == (0, 0, 1000)
    assert d.xstats["flags"] == enc.PSP_CLASS_F_UNPACED | enc.PSP_CLASS_F_DEFAULT
    # change in place: every option dumps back
    sock.change_qdisc(dev, link_rate_bps=mbit(250), overhead=24, limit=77, catchup_ns=10**9)
    q = sock.root(dev)
    assert (q.link_rate, q.defcls, q.overhead, q.limit) == (mbit(250), 2, 24, 77)
    assert q.catchup_ns == enc.PSP_CATCHUP_MAX_NS
    sock.change_qdisc(dev, catchup_ns=0)           # 0: one packet time; others stay
    q = sock.root(dev)
    assert (q.link_rate, q.overhead, q.limit, q.catchup_ns) == (mbit(250), 24, 77, 0)
    # classes made afterwards get the qdisc's limit; ceil defaults to the rate
    sock.add_class(dev, 0x10, mbit(3))
    sock.add_class(dev, 0x11, mbit(2), ceil_bps=mbit(5), limit=5)
    cls = sock.classes(dev)
    assert (cls[0x10].rate, cls[0x10].ceil, cls[0x10].limit) == (mbit(3), mbit(3), 77)
    assert (cls[0x11].rate, cls[0x11].ceil, cls[0x11].limit) == (mbit(2), mbit(5), 5)
    assert cls[0x10].xstats["flags"] == 0 and cls[0x10].parent == TC_H_ROOT
    # a rate change without ceil moves a non-borrowing class's ceil along, keeps a borrower's
    sock.change_class(dev, 0x10, rate_bps=mbit(4))
    sock.change_class(dev, 0x11, rate_bps=mbit(3))
    sock.change_class(dev, 0x11, limit=9)
    cls = sock.classes(dev)
    assert (cls[0x10].rate, cls[0x10].ceil) == (mbit(4), mbit(4))
    assert (cls[0x11].rate, cls[0x11].ceil, cls[0x11].limit) == (mbit(3), mbit(5), 9)
    # the default class: only its limit changes
    sock.must(RTM_NEWTCLASS, 0, N.tcmsg(sock.ifindex(dev), h(2), QDISC)
              + opts(a32(enc.TCA_PSP_CLASS_LIMIT, 33)), "default class limit")
    assert sock.classes(dev)[2].limit == 33
    # the default may move to another class; the old one is then an ordinary unpaced class
    sock.change_qdisc(dev, defcls=0x10)
    assert sock.root(dev).defcls == 0x10
    cls = sock.classes(dev)
    assert cls[0x10].xstats["flags"] == enc.PSP_CLASS_F_DEFAULT
    assert cls[2].xstats["flags"] == enc.PSP_CLASS_F_UNPACED
    expect_refused(sock, RTM_DELTCLASS, 0, N.tcmsg(sock.ifindex(dev), h(0x10), QDISC), errno.EBUSY,
                   "cannot delete the default class")
    assert sock.del_class(dev, 2) == (0, None)
    assert sorted(sock.classes(dev)) == [0x10, 0x11]
    assert sock.root(dev).xstats["classes"] == 2
    # the default class can also be named by its full handle
    sock.change_qdisc(dev, defcls=h(0x11))
    assert sock.root(dev).defcls == 0x11
    assert sock.del_root(dev) == (0, None)


# ------------------------------------------------------------------ bad options

def _qdisc_cases(lo_dev: str, dummy: str):
    """(id, device or None for the veth, create?, options bytes, errno, extack text)."""
    L = enc.TCA_PSP_LINK_RATE
    ok_rate = a64(L, mbit(100))
    return [
        ("link-rate-0", None, True, opts(a64(L, 0)), errno.EINVAL, "link rate must be > 0"),
        ("link-rate-above-range", None, True, opts(a64(L, RATE_MAX + 1)), errno.ERANGE,
         "link rate above 2^40 bytes/s"),
        ("link-rate-u64-max", None, True, opts(a64(L, 2**64 - 1)), errno.ERANGE,
         "link rate above 2^40 bytes/s"),
        ("no-link-rate-dummy", dummy, True, opts(), errno.EINVAL,
         "link rate required: the device reports no link speed"),
        ("no-link-rate-lo", lo_dev, True, opts(a32(enc.TCA_PSP_LIMIT, 10)), errno.EINVAL,
         "link rate required: the device reports no link speed"),
        ("overhead-above-1024", None, True, opts(ok_rate, a32(enc.TCA_PSP_OVERHEAD, 1025)),
         errno.EINVAL, "overhead above 1024 bytes"),
        ("limit-0", None, True, opts(ok_rate, a32(enc.TCA_PSP_LIMIT, 0)), errno.EINVAL,
         "limit must be at least 1 packet"),
        ("limit-above-2^20", None, True, opts(ok_rate, a32(enc.TCA_PSP_LIMIT, 2**20 + 1)),
         errno.EINVAL, "limit above 1048576 packets"),
        ("defcls-minor-0", None, True, opts(ok_rate, a32(enc.TCA_PSP_DEFCLS, 0)), errno.EINVAL,
         "default class minor must be 1..0xffff"),
        ("defcls-other-major", None, True, opts(ok_rate, a32(enc.TCA_PSP_DEFCLS, 0x12340002)),
         errno.EINVAL, "default class is not in this qdisc"),
        ("class-rate-in-qdisc", None, True, opts(ok_rate, a64(enc.TCA_PSP_CLASS_RATE, 1000)),
         errno.EINVAL, "class rate given in qdisc options"),
        ("class-ceil-in-qdisc", None, True, opts(a64(enc.TCA_PSP_CLASS_CEIL, 1000)),
         errno.EINVAL, "class ceil given in qdisc options"),
        ("class-limit-in-qdisc", None, True, opts(a32(enc.TCA_PSP_CLASS_LIMIT, 10)),
         errno.EINVAL, "class limit given in qdisc options"),
        ("not-nested", None, True, opts(ok_rate, nested=False), errno.EINVAL,
         "NLA_F_NESTED is missing"),
        ("pad-attribute", None, True, opts(N.nla(enc.TCA_PSP_PAD, U32(0)), ok_rate), errno.EINVAL,
         "Unsupported attribute"),
        ("unknown-attribute", None, True, opts(ok_rate, a32(enc.TCA_PSP_MAX + 1, 1)), errno.EINVAL,
         "Unknown attribute type"),
        ("catchup-above-1s", None, True,
         opts(ok_rate, a64(enc.TCA_PSP_CATCHUP, enc.PSP_CATCHUP_MAX_NS + 1)), errno.ERANGE,
         "catch-up window above 1 s"),
        ("catchup-given-as-u32", None, True, opts(ok_rate, a32(enc.TCA_PSP_CATCHUP, 1000)),
         errno.EINVAL, "invalid attribute length"),
        ("u64-given-as-u32", None, True, opts(N.nla(L, U32(12500))), errno.EINVAL,
         "invalid attribute length"),
        ("trailing-bytes", None, True, opts(ok_rate, b"\0\0\0\0"), errno.EINVAL,
         "bytes leftover after parsing attributes"),
        # changes of the existing qdisc
        ("change-unknown-default", None, False, opts(a32(enc.TCA_PSP_DEFCLS, 0x77)), errno.ENOENT,
         "unknown default class"),
        ("change-link-rate-0", None, False, opts(a64(L, 0)), errno.EINVAL, "link rate must be > 0"),
        ("change-link-rate-above-range", None, False, opts(a64(L, RATE_MAX + 1)), errno.ERANGE,
         "link rate above 2^40 bytes/s"),
        ("change-class-rate-in-qdisc", None, False, opts(a64(enc.TCA_PSP_CLASS_RATE, 5)),
         errno.EINVAL, "class rate given in qdisc options"),
        # validated fully before anything changes: the good link rate is not applied either
        ("change-catchup-u64-max", None, False,
         opts(a64(L, mbit(300)), a64(enc.TCA_PSP_CATCHUP, 2**64 - 1)), errno.ERANGE,
         "catch-up window above 1 s"),
    ]


def _class_cases():
    """(id, message type, flags, classid, parent, options, errno, extack text)."""
    R, C, LI = enc.TCA_PSP_CLASS_RATE, enc.TCA_PSP_CLASS_CEIL, enc.TCA_PSP_CLASS_LIMIT
    NEW = NLM_F_CREATE | NLM_F_EXCL
    est_bad = N.nla(N.TCA_RATE, struct.pack("=bB", 9, 1))
    return [
        ("rate-0", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a64(R, 0)), errno.EINVAL,
         "rate must be > 0"),
        ("ceil-below-rate", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, mbit(2)), a64(C, mbit(1))), errno.EINVAL, "ceil must be >= rate"),
        ("rate-above-range", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a64(R, RATE_MAX + 1)),
         errno.ERANGE, "rate above 2^40 bytes/s"),
        ("ceil-above-range", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), a64(C, RATE_MAX + 1)), errno.ERANGE, "ceil above 2^40 bytes/s"),
        ("limit-0", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a64(R, 1000), a32(LI, 0)),
         errno.EINVAL, "limit must be at least 1 packet"),
        ("limit-above-2^20", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), a32(LI, 2**20 + 1)), errno.EINVAL, "limit above 1048576 packets"),
        ("rate-missing", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a32(LI, 10)), errno.EINVAL,
         "psp class rate missing"),
        ("options-missing", RTM_NEWTCLASS, NEW, h(0x20), QDISC, N.nla_str(N.TCA_KIND, "psp"),
         errno.EINVAL, "psp class options missing"),
        ("link-rate-in-class", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), a64(enc.TCA_PSP_LINK_RATE, 1000)), errno.EINVAL,
         "link rate given in class options"),
        ("qdisc-limit-in-class", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), a32(enc.TCA_PSP_LIMIT, 10)), errno.EINVAL,
         "qdisc limit given in class options"),
        ("defcls-in-class", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), a32(enc.TCA_PSP_DEFCLS, 2)), errno.EINVAL,
         "default class given in class options"),
        ("catchup-in-class", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), a64(enc.TCA_PSP_CATCHUP, 1000)), errno.EINVAL,
         "catch-up window given in class options"),
        ("parent-is-a-class", RTM_NEWTCLASS, NEW, h(0x20), h(0x10), opts(a64(R, 1000)),
         errno.EINVAL, "parent class is not a group: only groups have members"),
        ("minor-0", RTM_NEWTCLASS, NEW, h(0), QDISC, opts(a64(R, 1000)), errno.EINVAL,
         "class id must be MAJOR:MINOR of this qdisc, MINOR > 0"),
        ("not-nested", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a64(R, 1000), nested=False),
         errno.EINVAL, "NLA_F_NESTED is missing"),
        ("u64-given-as-u32", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(N.nla(R, U32(1000))),
         errno.EINVAL, "invalid attribute length"),
        ("bad-estimator", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a64(R, 1000)) + est_bad,
         errno.EINVAL, "bad rate estimator parameters"),
        ("change-rate-0", RTM_NEWTCLASS, 0, h(0x10), QDISC, opts(a64(R, 0)), errno.EINVAL,
         "rate must be > 0"),
        ("change-ceil-below-rate", RTM_NEWTCLASS, 0, h(0x10), QDISC, opts(a64(C, mbit(1) - 1)),
         errno.EINVAL, "ceil must be >= rate"),
        ("change-rate-above-ceil", RTM_NEWTCLASS, 0, h(0x11), QDISC, opts(a64(R, mbit(9))),
         errno.EINVAL, "ceil must be >= rate"),
        ("change-default-rate", RTM_NEWTCLASS, 0, h(2), QDISC, opts(a64(R, 1000)), errno.EINVAL,
         "the default class is unpaced: only its limit can change"),
        ("change-default-limit-0", RTM_NEWTCLASS, 0, h(2), QDISC, opts(a32(LI, 0)), errno.EINVAL,
         "limit must be at least 1 packet"),
        ("change-bad-estimator", RTM_NEWTCLASS, 0, h(0x10), QDISC, opts(a64(R, 1000)) + est_bad,
         errno.EINVAL, "bad rate estimator parameters"),
        ("delete-default", RTM_DELTCLASS, 0, h(2), QDISC, b"", errno.EBUSY,
         "cannot delete the default class"),
        ("delete-with-filter", RTM_DELTCLASS, 0, h(0x10), QDISC, b"", errno.EBUSY,
         "class is used by filters: delete them first"),
    ]


def test_bad_options_refused_with_extack(bed):
    """Each bad qdisc or class request is refused with its errno and extack message and changes
    nothing (the options of the qdisc and of every class dump back as before)."""
    tb, sock = bed
    dev = tb.sender_dev
    tb.s("ip", "link", "add", f"fpd{tb.suffix}", "type", "dummy")
    dummy = f"fpd{tb.suffix}"
    sock.add_qdisc(dev, link_rate_bps=mbit(100))
    sock.add_class(dev, 0x10, mbit(1))
    sock.add_class(dev, 0x11, mbit(2), ceil_bps=mbit(4))
    add_filter(tb, 0x10)
    before = snapshot(sock, dev)
    seen = {}
    for cid, on, create, body, code, text in _qdisc_cases("lo", dummy):
        target = on or dev
        flags = NLM_F_CREATE | NLM_F_EXCL if create else 0
        if create and target == dev:
            # a fresh qdisc: take the existing one away first, put it back after
            assert sock.del_root(dev) == (0, None)
        try:
            seen[cid] = expect_refused(sock, RTM_NEWQDISC, flags,
                                       N.tcmsg(sock.ifindex(target), QDISC, TC_H_ROOT) + body,
                                       code, text)
        except AssertionError as e:
            raise AssertionError(f"qdisc case {cid}: {e}") from None
        if create and target == dev:
            sock.add_qdisc(dev, link_rate_bps=mbit(100))
            sock.add_class(dev, 0x10, mbit(1))
            sock.add_class(dev, 0x11, mbit(2), ceil_bps=mbit(4))
            add_filter(tb, 0x10)
        assert not any(q.kind == "psp" for q in sock.qdiscs(dummy)), cid
        assert snapshot(sock, dev) == before, f"qdisc case {cid} changed the configuration"
    for cid, mtype, flags, classid, parent, body, code, text in _class_cases():
        try:
            seen[cid] = expect_refused(sock, mtype, flags,
                                       N.tcmsg(sock.ifindex(dev), classid, parent) + body,
                                       code, text)
        except AssertionError as e:
            raise AssertionError(f"class case {cid}: {e}") from None
        assert snapshot(sock, dev) == before, f"class case {cid} changed the configuration"
    # the generic layer's refusals (no extack of ours): an existing class with EXCL
    err, _ = sock.send(RTM_NEWTCLASS, NLM_F_CREATE | NLM_F_EXCL,
                       N.tcmsg(sock.ifindex(dev), h(2), QDISC)
                       + opts(a32(enc.TCA_PSP_CLASS_LIMIT, 5)))
    assert err == errno.EEXIST
    # a filter on a class instead of the qdisc: tc shows psp's reason
    r = tb.s("tc", "filter", "add", "dev", dev, "parent", "f1f0:10", *FILTER, "f1f0:11",
             check=False)
    assert r.returncode != 0 and "filters attach to the psp qdisc, not to its classes" in r.stderr
    assert snapshot(sock, dev) == before
    psplib.record(f"psp bad options: {len(seen)} refused with their extack")


# ------------------------------------------------------------------ changes under traffic

def _rates(cap: Capture, windows):
    return [window_rate(cap.packets, a, b) for a, b in windows]


def test_rate_and_link_rate_changed_in_place_under_traffic(bed):
    """iperf3 through class f1f0:10 at 6 Mbit/s; its rate changed to 2 Mbit/s while it runs,
    then the qdisc's link rate to 1 Mbit/s. Each change keeps the queue (nothing dropped, no TCP
    retransmission, packets still queued right after it) and the class (same id); the receiver
    measures each new rate."""
    tb, sock = bed
    dev = tb.sender_dev
    tb.set_gso(True)
    Psp(mbit(6))(tb)
    marks = {}
    with Capture(tb.receiver_ns, tb.receiver_dev, IPERF_PORT) as cap:
        with Iperf(tb, [IPERF_PORT], duration=10) as ip:
            def busy(after_s):
                return lambda: ip.elapsed() >= after_s and sock.classes(dev)[0x10].stats["qlen"] > 0
            wait_for(busy(3.5), 15, "the class to be backlogged")
            before = sock.classes(dev)[0x10]
            marks["rate"] = time.time_ns()
            sock.change_class(dev, 0x10, rate_bps=mbit(2))
            after = sock.classes(dev)[0x10]
            wait_for(busy(6.5), 15, "the class to be backlogged again")
            marks["link"] = time.time_ns()
            sock.change_qdisc(dev, link_rate_bps=mbit(1))
            after_link = sock.classes(dev)[0x10]
            q_after_link = sock.root(dev)
            rep = ip.wait()[IPERF_PORT]
        end = time.time_ns()
    s = 1_000_000_000
    first = min(p.ts_ns for p in cap.packets)
    r6, r2, r1 = _rates(cap, [(first + s, marks["rate"]),
                              (marks["rate"] + s * 6 // 10, marks["link"]),
                              (marks["link"] + s * 6 // 10, min(end, first + 10 * s) - s // 2)])
    psplib.record(f"psp change under traffic: 6 Mbit {to_mbit(r6):.3f}, rate changed to 2 Mbit "
                  f"{to_mbit(r2):.3f}, link changed to 1 Mbit {to_mbit(r1):.3f} Mbit/s; qlen at "
                  f"the changes {before.stats['qlen']} -> {after.stats['qlen']}, "
                  f"{after_link.stats['qlen']}")
    assert before.stats["qlen"] > 0 and after.stats["qlen"] > 0 and after_link.stats["qlen"] > 0
    assert after.classid == before.classid and after.rate == mbit(2) and after.ceil == mbit(2)
    assert q_after_link.link_rate == mbit(1)
    assert abs(r6 / mbit(6) - 1) < 0.06
    assert abs(r2 / mbit(2) - 1) < 0.05
    assert abs(r1 / mbit(1) - 1) < 0.05
    final = sock.classes(dev)[0x10]
    assert final.stats["drops"] == 0 and sock.root(dev).stats["drops"] == 0
    assert rep["end"]["sum_sent"]["retransmits"] == 0


def test_class_added_and_deleted_under_traffic(bed):
    """Unshaped iperf3 through psp's default class; a class + filter added while it runs paces
    it at 2 Mbit/s; the class cannot go while its filter is there; filter then class deleted
    while packets are queued in it: the flow goes on unshaped, and once it ends the qdisc's
    packet and byte backlog are back to zero."""
    tb, sock = bed
    dev = tb.sender_dev
    tb.set_gso(True)
    sock.add_qdisc(dev, link_rate_bps=mbit(1000))
    marks = {}
    s = 1_000_000_000
    with Capture(tb.receiver_ns, tb.receiver_dev, IPERF_PORT) as cap:
        # the windows are measured from marks, not from iperf3's start: in plain TCG the class
        # and filter set-up alone can take seconds; each window is at least 1 s long
        with Iperf(tb, [IPERF_PORT], duration=14) as ip:
            wait_for(lambda: ip.elapsed() >= 2.5, 10, "unshaped traffic")
            sock.add_class(dev, 0x10, mbit(2))
            add_filter(tb, 0x10)
            marks["add"] = time.time_ns()          # both in place: from here on it is paced
            wait_for(lambda: time.time_ns() >= marks["add"] + 3 * s
                     and sock.classes(dev)[0x10].stats["qlen"] > 0,
                     15, "the new class to be backlogged for 3 s")
            expect_refused(sock, RTM_DELTCLASS, 0, N.tcmsg(sock.ifindex(dev), h(0x10), QDISC),
                           errno.EBUSY, "class is used by filters: delete them first")
            # paced up to here: once the filter is gone the flow is unshaped (~165 Mbit/s in
            # plain TCG), so the paced window ends before the filter's delete (a mark taken
            # after it let unshaped packets in: 3.1 Mbit/s measured for the 2 Mbit/s class)
            marks["unfilter"] = time.time_ns()
            del_filter(tb)
            queued = sock.classes(dev)[0x10].stats["qlen"]
            marks["del"] = time.time_ns()
            assert sock.del_class(dev, 0x10) == (0, None)
            assert 0x10 not in sock.classes(dev)
            rep = ip.wait()[IPERF_PORT]
        end = time.time_ns()
    first = min(p.ts_ns for p in cap.packets)
    windows = [(first + s // 2, marks["add"]), (marks["add"] + s, marks["unfilter"]),
               (marks["del"] + s // 2, end - s)]
    lengths = ", ".join(f"{(b - a) / s:.2f}" for a, b in windows)
    assert all(b - a >= s for a, b in windows), f"a window shorter than 1 s: {lengths} s"
    free1, paced, free2 = _rates(cap, windows)
    psplib.record(f"psp add/delete under traffic: unshaped {to_mbit(free1):.1f}, class 2 Mbit "
                  f"{to_mbit(paced):.3f}, after delete {to_mbit(free2):.1f} Mbit/s ({lengths} s "
                  f"windows); {queued} packets queued at the delete")
    assert free1 > 5 * mbit(2) and free2 > 5 * mbit(2)
    assert abs(paced / mbit(2) - 1) < 0.05
    q = sock.root(dev)
    assert q.stats["qlen"] == 0 and q.stats["backlog_bytes"] == 0
    assert q.xstats["active"] == 0 and q.xstats["rate_sum"] == 0 and q.xstats["classes"] == 1
    assert 0 < q.stats["drops"] <= queued          # the deleted class's queue, counted
    assert rep["end"]["sum_received"]["bytes"] > 0


def test_qdisc_deleted_under_traffic(bed):
    """The root psp qdisc deleted while a paced flow is backlogged: the flow carries on, and the
    module's reference goes with the qdisc."""
    tb, sock = bed
    dev = tb.sender_dev
    Psp(mbit(2))(tb)
    assert psplib.refcnt() >= 1
    with Iperf(tb, [IPERF_PORT], duration=5) as ip:
        wait_for(lambda: ip.elapsed() >= 2 and sock.classes(dev)[0x10].stats["qlen"] > 0, 15,
                 "a backlogged class")
        assert sock.del_root(dev) == (0, None)
        assert sock.root(dev) is None
        rep = ip.wait()[IPERF_PORT]
    assert rep["end"]["sum_received"]["bytes"] > 0
    wait_for(lambda: psplib.refcnt() == 0, 15, "the deleted qdisc to be freed")


# ------------------------------------------------------------------ groups (issue 15)

def _group_cases():
    """(id, message type, flags, classid, parent, options, errno, extack text) against rule
    group 30, client group 31 under it, class 32 in 31, class 10 at the qdisc."""
    R, C, LI, G = (enc.TCA_PSP_CLASS_RATE, enc.TCA_PSP_CLASS_CEIL, enc.TCA_PSP_CLASS_LIMIT,
                   enc.TCA_PSP_CLASS_GROUP)
    NEW = NLM_F_CREATE | NLM_F_EXCL
    flag = N.nla(G, b"")
    return [
        ("group-with-ceil", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), flag, a64(C, 2000)), errno.EINVAL,
         "a group has no ceil: its rate is its cap"),
        ("group-with-limit", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), flag, a32(LI, 10)), errno.EINVAL, "a group holds no packets: no limit"),
        ("group-rate-missing", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(flag), errno.EINVAL,
         "psp group rate missing"),
        ("group-rate-0", RTM_NEWTCLASS, NEW, h(0x20), QDISC, opts(a64(R, 0), flag), errno.EINVAL,
         "rate must be > 0"),
        ("group-rate-above-range", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, RATE_MAX + 1), flag), errno.ERANGE, "rate above 2^40 bytes/s"),
        ("group-three-levels", RTM_NEWTCLASS, NEW, h(0x20), h(0x31), opts(a64(R, 1000), flag),
         errno.EINVAL, "groups nest two levels deep at most"),
        ("parent-unknown", RTM_NEWTCLASS, NEW, h(0x20), h(0x7F), opts(a64(R, 1000)),
         errno.ENOENT, "parent is neither this qdisc nor one of its group classes"),
        ("class-becomes-group", RTM_NEWTCLASS, 0, h(0x10), QDISC, opts(a64(R, 1000), flag),
         errno.EINVAL, "a class cannot become a group: delete it and add the group"),
        ("class-leaves-its-group", RTM_NEWTCLASS, 0, h(0x32), QDISC, opts(a64(R, 1000)),
         errno.EINVAL, "a class cannot move to another parent: delete it and add it there"),
        ("class-into-a-group", RTM_NEWTCLASS, 0, h(0x10), h(0x30), opts(a64(R, 1000)),
         errno.EINVAL, "a class cannot move to another parent: delete it and add it there"),
        ("group-moves", RTM_NEWTCLASS, 0, h(0x31), QDISC, opts(a64(R, 1000)),
         errno.EINVAL, "a class cannot move to another parent: delete it and add it there"),
        ("group-change-with-ceil", RTM_NEWTCLASS, 0, h(0x31), h(0x30), opts(a64(C, 10**6)),
         errno.EINVAL, "a group has no ceil: its rate is its cap"),
        ("group-flag-with-payload", RTM_NEWTCLASS, NEW, h(0x20), QDISC,
         opts(a64(R, 1000), N.nla(G, U32(1))), errno.ERANGE, "Attribute failed policy validation"),
        ("delete-client-group-with-members", RTM_DELTCLASS, 0, h(0x31), QDISC, b"", errno.EBUSY,
         "group has member classes or groups: delete them first"),
        ("delete-rule-group-with-a-client", RTM_DELTCLASS, 0, h(0x30), QDISC, b"", errno.EBUSY,
         "group has member classes or groups: delete them first"),
    ]


def _group_snapshot(sock: PspNl, dev: str):
    q, cls = snapshot(sock, dev)
    par = {m: c.parent for m, c in sock.classes(dev).items()}
    return q, cls, par


def test_group_requests_refused_with_extack(bed):
    """Every bad group request is refused with its errno and extack and changes nothing; the
    default class cannot be a group; a group flag in qdisc options is refused."""
    tb, sock = bed
    dev = tb.sender_dev
    sock.add_qdisc(dev, link_rate_bps=mbit(100))
    sock.add_class(dev, 0x10, mbit(1))
    sock.add_group(dev, 0x30, mbit(9))
    sock.add_group(dev, 0x31, mbit(6), parent=0x30)
    sock.add_class(dev, 0x32, mbit(4), parent=0x31)
    before = _group_snapshot(sock, dev)
    for cid, mtype, flags, classid, parent, body, code, text in _group_cases():
        try:
            expect_refused(sock, mtype, flags, N.tcmsg(sock.ifindex(dev), classid, parent) + body,
                           code, text)
        except AssertionError as e:
            raise AssertionError(f"group case {cid}: {e}") from None
        assert _group_snapshot(sock, dev) == before, f"group case {cid} changed the configuration"
    qbody = N.tcmsg(sock.ifindex(dev), QDISC, TC_H_ROOT)
    expect_refused(sock, RTM_NEWQDISC, 0, qbody + opts(a32(enc.TCA_PSP_DEFCLS, 0x30)),
                   errno.EINVAL, "the default class cannot be a group")
    expect_refused(sock, RTM_NEWQDISC, 0, qbody + opts(N.nla(enc.TCA_PSP_CLASS_GROUP, b"")),
                   errno.EINVAL, "group flag given in qdisc options")
    assert _group_snapshot(sock, dev) == before
    # and in the right order they go: the class, then the client group, then the rule group
    for m in (0x32, 0x31, 0x30):
        assert sock.del_class(dev, m) == (0, None)
    assert sorted(sock.classes(dev)) == [2, 0x10]
    psplib.record(f"psp group requests: {len(_group_cases()) + 2} refused with their extack")
