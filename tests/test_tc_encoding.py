"""Our packed tc structures against the uapi headers (compiled C) and pyroute2's declarations."""
import ipaddress
import shutil
import struct
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyroute2.netlink.rtnl.tcmsg import sched_htb as p2_htb

from flowpacer.kernel.tc import htb, nl, u32

C_PROBE = r"""
#include <stdio.h>
#include <stddef.h>
#include <linux/pkt_sched.h>
#include <linux/pkt_cls.h>
#include <linux/gen_stats.h>
#include <linux/rtnetlink.h>
#define P(x) printf(#x " %ld\n", (long)(x))
int main(void) {
  P(sizeof(struct tc_ratespec)); P(sizeof(struct tc_htb_opt)); P(sizeof(struct tc_htb_glob));
  P(offsetof(struct tc_htb_opt, buffer)); P(offsetof(struct tc_htb_opt, quantum));
  P(offsetof(struct tc_htb_opt, prio)); P(offsetof(struct tc_ratespec, rate));
  P(offsetof(struct tc_ratespec, linklayer));
  P(sizeof(struct tc_u32_sel)); P(sizeof(struct tc_u32_key));
  P(offsetof(struct tc_u32_sel, offmask)); P(offsetof(struct tc_u32_sel, hoff));
  P(offsetof(struct tc_u32_sel, hmask)); P(offsetof(struct tc_u32_key, off));
  P(sizeof(struct tcmsg)); P(sizeof(struct gnet_stats_queue)); P(sizeof(struct gnet_stats_basic));
  P(TCA_HTB_PARMS); P(TCA_HTB_INIT); P(TCA_HTB_RATE64); P(TCA_HTB_CEIL64);
  P(TCA_U32_CLASSID); P(TCA_U32_HASH); P(TCA_U32_LINK); P(TCA_U32_DIVISOR); P(TCA_U32_SEL);
  P(TCA_U32_FLAGS); P(TC_U32_TERMINAL); P(TC_HTB_PROTOVER); P(TC_LINKLAYER_ETHERNET);
  P(TCA_KIND); P(TCA_OPTIONS); P(TCA_STATS2); P(TCA_STATS_BASIC); P(TCA_STATS_QUEUE);
  P(TCA_STATS_RATE_EST); P(TCA_STATS_RATE_EST64); P(TCA_STATS_PKT64);
  P(RTM_NEWTCLASS); P(RTM_NEWTFILTER); P(RTM_NEWQDISC); P(RTM_DELTFILTER);
  return 0;
}
"""


@pytest.fixture(scope="module")
def uapi(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (build-essential)"
    d = tmp_path_factory.mktemp("uapi")
    (d / "probe.c").write_text(C_PROBE)
    subprocess.run([cc, "-Wall", "-o", str(d / "probe"), str(d / "probe.c")], check=True)
    out = subprocess.run([str(d / "probe")], capture_output=True, text=True, check=True).stdout
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}


def test_struct_layouts_match_uapi(uapi):
    assert uapi["sizeof(struct tc_ratespec)"] == htb.RATESPEC.size
    assert uapi["sizeof(struct tc_htb_opt)"] == htb.HTB_OPT.size
    assert uapi["sizeof(struct tc_htb_glob)"] == htb.HTB_GLOB.size
    assert uapi["offsetof(struct tc_htb_opt, buffer)"] == 2 * htb.RATESPEC.size
    assert uapi["offsetof(struct tc_htb_opt, quantum)"] == 2 * htb.RATESPEC.size + 8
    assert uapi["offsetof(struct tc_htb_opt, prio)"] == 2 * htb.RATESPEC.size + 16
    assert uapi["offsetof(struct tc_ratespec, rate)"] == 8
    assert uapi["offsetof(struct tc_ratespec, linklayer)"] == 1
    assert uapi["sizeof(struct tc_u32_sel)"] == u32.SEL_HEAD.size
    assert uapi["sizeof(struct tc_u32_key)"] == u32.KEY_SIZE
    assert uapi["offsetof(struct tc_u32_sel, offmask)"] == 4
    assert uapi["offsetof(struct tc_u32_sel, hoff)"] == 10
    assert uapi["offsetof(struct tc_u32_sel, hmask)"] == 12
    assert uapi["offsetof(struct tc_u32_key, off)"] == 8
    assert uapi["sizeof(struct tcmsg)"] == nl._TCMSG.size
    assert uapi["sizeof(struct gnet_stats_queue)"] == nl._QUEUE.size


def test_constants_match_uapi(uapi):
    pairs = {
        "TCA_HTB_PARMS": htb.TCA_HTB_PARMS, "TCA_HTB_INIT": htb.TCA_HTB_INIT,
        "TCA_HTB_RATE64": htb.TCA_HTB_RATE64, "TCA_HTB_CEIL64": htb.TCA_HTB_CEIL64,
        "TCA_U32_CLASSID": u32.TCA_U32_CLASSID, "TCA_U32_HASH": u32.TCA_U32_HASH,
        "TCA_U32_LINK": u32.TCA_U32_LINK, "TCA_U32_DIVISOR": u32.TCA_U32_DIVISOR,
        "TCA_U32_SEL": u32.TCA_U32_SEL, "TCA_U32_FLAGS": u32.TCA_U32_FLAGS,
        "TC_U32_TERMINAL": u32.TC_U32_TERMINAL, "TC_HTB_PROTOVER": htb.TC_HTB_PROTOVER,
        "TC_LINKLAYER_ETHERNET": htb.TC_LINKLAYER_ETHERNET, "TCA_KIND": nl.TCA_KIND,
        "TCA_OPTIONS": nl.TCA_OPTIONS, "TCA_STATS2": nl.TCA_STATS2,
        "TCA_STATS_BASIC": nl.TCA_STATS_BASIC, "TCA_STATS_QUEUE": nl.TCA_STATS_QUEUE,
        "TCA_STATS_RATE_EST": nl.TCA_STATS_RATE_EST, "TCA_STATS_RATE_EST64": nl.TCA_STATS_RATE_EST64,
        "TCA_STATS_PKT64": nl.TCA_STATS_PKT64, "RTM_NEWTCLASS": nl.RTM_NEWTCLASS,
        "RTM_NEWTFILTER": nl.RTM_NEWTFILTER, "RTM_NEWQDISC": nl.RTM_NEWQDISC,
        "RTM_DELTFILTER": nl.RTM_DELTFILTER,
    }
    for name, ours in pairs.items():
        assert uapi[name] == ours, name


def test_u32_nla_map_mirrors_uapi(uapi):
    names = [n for n, _ in u32.options.nla_map]
    for name in ("TCA_U32_CLASSID", "TCA_U32_HASH", "TCA_U32_LINK", "TCA_U32_DIVISOR",
                 "TCA_U32_SEL", "TCA_U32_FLAGS"):
        assert names.index(name) == uapi[name], name


def test_htb_class_bytes_decode_with_pyroute2():
    """pyroute2's own htb declaration reads our packed class as we meant it."""
    raw = htb.class_options(1_250_000, 2_500_000, 3200, 6400, 125_000, prio=3)
    top = nl.parse_attrs(raw)
    assert top[nl.TCA_KIND] == b"htb\0"
    opts = nl.parse_attrs(top[nl.TCA_OPTIONS])
    parms = opts[htb.TCA_HTB_PARMS]
    msg = p2_htb.options.htb_parms(bytearray(struct.pack("HH", 4 + len(parms), 1) + parms))
    msg.decode()
    assert (msg["rate"], msg["ceil"], msg["quantum"], msg["prio"]) == (1_250_000, 2_500_000, 125_000, 3)
    assert msg["buffer"] == htb.ticks(3200, 1_250_000) == 3200 * 10**9 // (1_250_000 * 64)
    assert htb.parse_class_rates(opts) == (1_250_000, 2_500_000)


def test_htb_64bit_rates():
    raw = htb.class_options(10**10, 2 * 10**10, 10**7, 10**7, 200_000)
    opts = nl.parse_attrs(nl.parse_attrs(raw)[nl.TCA_OPTIONS])
    assert htb.TCA_HTB_RATE64 in opts and htb.TCA_HTB_CEIL64 in opts
    assert htb.parse_class_rates(opts) == (10**10, 2 * 10**10)


def test_u32_keys_roundtrip():
    for la, ra in (("10.1.2.3", "192.0.2.9"), ("fd00::1", "2001:db8::77"),
                   ("0.0.0.0", "192.0.2.9"), ("::", "2001:db8::77")):
        la, ra = ipaddress.ip_address(la), ipaddress.ip_address(ra)
        for proto in (u32.IPPROTO_TCP, u32.IPPROTO_UDP):
            keys = u32.flow_keys(la, 8443, ra, 40001, proto)
            sel = u32.pack_sel(keys, u32.TC_U32_TERMINAL)
            flags, hoff, hmask, back = u32.unpack_sel(sel)
            assert flags == u32.TC_U32_TERMINAL and back == keys
            assert u32.keys_to_tuple(back) == (la, 8443, ra, 40001, proto)
            # the protocol byte is the guard's: IPv4 byte 9, IPv6 byte 6 (next header)
            off, mask, val = keys[0]
            assert (off, mask) == ((8, 0x00FF0000) if la.version == 4 else (4, 0x0000FF00))
            assert val == (proto << 16 if la.version == 4 else proto << 8)
        # unspecified local (unconnected UDP socket on the wildcard): no source address keys
        n = len(u32.flow_keys(la, 1, ra, 2, u32.IPPROTO_UDP))
        assert n == (3 if la.version == 4 else 6) if la.is_unspecified else n in (4, 10)
    # a leaf of the layout before issue 17 (no protocol key) is not ours any more
    old = [k for k in u32.flow_keys(ipaddress.ip_address("10.1.2.3"), 1,
                                    ipaddress.ip_address("10.1.2.4"), 2)][1:]
    assert u32.keys_to_tuple(old) is None


def test_u32_plugin_decodes_dumped_keys():
    """With register(), pyroute2 decodes a dumped u32 selector's keys at the right offset."""
    keys = [(12, 0xFFFFFFFF, 0x0A000001), (20, 0xFFFF0000, 0x1F900000)]
    sel = u32.pack_sel(keys, 0, 20, 0xFF)
    payload = struct.pack("HH", 4 + len(sel), u32.TCA_U32_SEL) + sel
    m = u32.options.u32_sel(bytearray(payload))
    m.decode()
    assert (m["hoff"], m["hmask"], m["keys"]) == (20, 0xFF, keys)


# ------------------------------------------- the receive side's structures (issue 17)

C_PROBE_RX = r"""
#include <stdio.h>
#include <stddef.h>
#include <linux/pkt_sched.h>
#include <linux/pkt_cls.h>
#include <linux/rtnetlink.h>
#include <linux/if_link.h>
#include <linux/if.h>
#include <linux/if_ether.h>
#include <linux/tc_act/tc_mirred.h>
#define P(x) printf(#x " %ld\n", (long)(x))
int main(void) {
  P(sizeof(struct tc_mirred)); P(offsetof(struct tc_mirred, eaction));
  P(offsetof(struct tc_mirred, ifindex)); P(offsetof(struct tc_mirred, action));
  P(sizeof(struct ifinfomsg)); P(offsetof(struct ifinfomsg, ifi_index));
  P(offsetof(struct ifinfomsg, ifi_flags)); P(offsetof(struct ifinfomsg, ifi_change));
  P(TCA_MIRRED_PARMS); P(TCA_EGRESS_REDIR); P(TC_ACT_STOLEN); P(TCA_ACT_KIND);
  P(TCA_ACT_OPTIONS); P(TCA_U32_ACT); P(ETH_P_ALL);
  P((long)(unsigned)TC_H_CLSACT); P((long)(unsigned)TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS));
  P((long)(unsigned)TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS));
  P(RTM_NEWLINK); P(RTM_DELLINK); P(RTM_GETLINK); P(IFLA_IFNAME); P(IFLA_TXQLEN);
  P(IFLA_LINKINFO); P(IFLA_IFALIAS); P(IFLA_INFO_KIND); P(IFF_UP);
  return 0;
}
"""


def test_receive_side_structures_match_uapi(tmp_path):
    from flowpacer.kernel.tc import link, mirred
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (build-essential)"
    (tmp_path / "rx.c").write_text(C_PROBE_RX)
    subprocess.run([cc, "-Wall", "-o", str(tmp_path / "rx"), str(tmp_path / "rx.c")], check=True)
    out = subprocess.run([str(tmp_path / "rx")], capture_output=True, text=True, check=True).stdout
    got = {ln.rsplit(" ", 1)[0]: int(ln.rsplit(" ", 1)[1]) for ln in out.splitlines()}
    assert got["sizeof(struct tc_mirred)"] == mirred.TC_MIRRED.size
    assert got["offsetof(struct tc_mirred, action)"] == 8           # tc_gen: index, capab, action
    assert got["offsetof(struct tc_mirred, eaction)"] == 20
    assert got["offsetof(struct tc_mirred, ifindex)"] == 24
    assert got["sizeof(struct ifinfomsg)"] == link.IFINFOMSG.size
    assert (got["offsetof(struct ifinfomsg, ifi_index)"], got["offsetof(struct ifinfomsg, ifi_flags)"],
            got["offsetof(struct ifinfomsg, ifi_change)"]) == (4, 8, 12)
    pairs = {"TCA_MIRRED_PARMS": mirred.TCA_MIRRED_PARMS, "TCA_EGRESS_REDIR": mirred.TCA_EGRESS_REDIR,
             "TC_ACT_STOLEN": mirred.TC_ACT_STOLEN, "TCA_ACT_KIND": mirred.TCA_ACT_KIND,
             "TCA_ACT_OPTIONS": mirred.TCA_ACT_OPTIONS, "TCA_U32_ACT": mirred.TCA_U32_ACT,
             "ETH_P_ALL": mirred.ETH_P_ALL,
             "(long)(unsigned)TC_H_CLSACT": mirred.TC_H_CLSACT,
             "(long)(unsigned)TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)": mirred.INGRESS_PARENT,
             "(long)(unsigned)TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)": mirred.EGRESS_PARENT,
             "RTM_NEWLINK": link.RTM_NEWLINK, "RTM_DELLINK": link.RTM_DELLINK,
             "RTM_GETLINK": link.RTM_GETLINK, "IFLA_IFNAME": link.IFLA_IFNAME,
             "IFLA_TXQLEN": link.IFLA_TXQLEN, "IFLA_LINKINFO": link.IFLA_LINKINFO,
             "IFLA_IFALIAS": link.IFLA_IFALIAS, "IFLA_INFO_KIND": link.IFLA_INFO_KIND,
             "IFF_UP": link.IFF_UP}
    for name, ours in pairs.items():
        assert got[name] == ours, name
    # what we pack reads back as the same redirect
    opts = nl.parse_attrs(mirred.redirect_all_options(7))
    assert mirred.redirect_target(nl.parse_attrs(opts[nl.TCA_OPTIONS]), nl.parse_attrs) == 7


_v4 = st.builds(ipaddress.IPv4Address, st.integers(0, 2**32 - 1))
_v6 = st.builds(ipaddress.IPv6Address, st.integers(0, 2**128 - 1))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.tuples(_v4, _v4), st.tuples(_v6, _v6),
                 st.tuples(st.just(ipaddress.IPv4Address(0)), _v4),
                 st.tuples(st.just(ipaddress.IPv6Address(0)), _v6)),
       st.integers(0, 65535), st.integers(0, 65535), st.sampled_from([6, 17]),
       st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_flow_leaf_from_prebuilt_pieces_is_the_same_bytes(addrs, lport, rport, proto, classid,
                                                          table):
    """The daemon's per-flow filter (u32.flow_leaf_options) is byte for byte what leaf_options
    makes of flow_keys, both families, TCP and UDP, a wildcard local address too."""
    la, ra = addrs
    want = u32.leaf_options(classid, u32.flow_keys(la, lport, ra, rport, proto), table)
    assert u32.flow_leaf_options(classid, table, la, lport, ra, rport, proto) == want
