"""The mirred action and the clsact qdisc: how an interface's ingress reaches flowpacer's ifb.

Kernel facts (net/sched/act_mirred.c, sch_ingress.c, include/uapi/linux/tc_act/tc_mirred.h):

- ``clsact`` is a qdisc with handle ``ffff:`` at parent ``ffff:fff1`` (TC_H_CLSACT); its ingress
  hook takes filters at parent ``ffff:fff2`` (TC_H_MIN_INGRESS). An old-style ``ingress`` qdisc
  has the same handle and accepts filters at the same parent, so either one serves.
- A filter's actions are nested in the classifier's own attribute (TCA_U32_ACT for u32): one
  nested attribute per action, numbered from 1 (the order they run), each holding TCA_ACT_KIND
  and TCA_ACT_OPTIONS.
- mirred's options carry ``struct tc_mirred``: ``tc_gen`` (index, capab, action, refcnt,
  bindcnt), then ``eaction`` (TCA_EGRESS_REDIR: hand the packet to the target's egress, i.e. its
  qdisc) and the target's ifindex. ``action`` TC_ACT_STOLEN: the packet is the target's now.
- Redirecting from ingress to an ifb's egress: mirred pushes the MAC header back; at the ifb's
  qdisc the network header offset is still known, so u32 keys (relative to it) work as on any
  egress; the ifb then re-injects the packet into the original interface's receive path, marked
  so that its ingress hook does not redirect it again.
"""
from __future__ import annotations

import struct

from flowpacer.kernel.tc import u32
from flowpacer.kernel.tc.nl import TCA_KIND, TCA_OPTIONS, nla, nla_nested, nla_str

TC_H_CLSACT = 0xFFFFFFF1          # parent of the clsact qdisc (== TC_H_INGRESS)
CLSACT_HANDLE = 0xFFFF0000
INGRESS_PARENT = 0xFFFFFFF2       # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)
EGRESS_PARENT = 0xFFFFFFF3        # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)
ETH_P_ALL = 0x0003

# enum TCA_ACT_* (linux/pkt_cls.h)
TCA_ACT_KIND = 1
TCA_ACT_OPTIONS = 2
# linux/tc_act/tc_mirred.h
TCA_MIRRED_PARMS = 2
TCA_EGRESS_REDIR = 1
TC_ACT_STOLEN = 4
TCA_U32_ACT = 7

# struct tc_mirred { tc_gen: __u32 index, __u32 capab, int action, int refcnt, int bindcnt;
#                    int eaction; __u32 ifindex; }
TC_MIRRED = struct.Struct("=IIiiiiI")


def clsact_options() -> bytes:
    return nla_str(TCA_KIND, "clsact")


def mirred_redirect(ifindex: int) -> bytes:
    """The options of one mirred action: redirect to ``ifindex``'s egress."""
    parms = TC_MIRRED.pack(0, 0, TC_ACT_STOLEN, 0, 0, TCA_EGRESS_REDIR, ifindex)
    return nla_str(TCA_ACT_KIND, "mirred") + nla_nested(TCA_ACT_OPTIONS,
                                                        nla(TCA_MIRRED_PARMS, parms))


def redirect_all_options(ifindex: int) -> bytes:
    """A u32 filter that matches every packet (one key with mask 0) and redirects it to
    ``ifindex`` (the filter's protocol decides which packets reach it: ETH_P_ALL for all)."""
    return nla_str(TCA_KIND, "u32") + nla_nested(
        TCA_OPTIONS,
        nla(u32.TCA_U32_SEL, u32.pack_sel([(0, 0, 0)], u32.TC_U32_TERMINAL)),
        nla_nested(TCA_U32_ACT, nla_nested(1, mirred_redirect(ifindex))))


def redirect_target(options: dict, parse_attrs) -> int:
    """The ifindex a dumped redirect filter (its parsed TCA_OPTIONS) sends to; 0 when it is not
    one of ours (no single mirred egress redirect)."""
    raw = options.get(TCA_U32_ACT)
    if not raw:
        return 0
    acts = parse_attrs(raw)
    if len(acts) != 1:
        return 0
    act = parse_attrs(next(iter(acts.values())))
    if act.get(TCA_ACT_KIND, b"").rstrip(b"\0") != b"mirred" or TCA_ACT_OPTIONS not in act:
        return 0
    parms = parse_attrs(act[TCA_ACT_OPTIONS]).get(TCA_MIRRED_PARMS)
    if not parms or len(parms) < TC_MIRRED.size:
        return 0
    *_gen, eaction, ifindex = TC_MIRRED.unpack_from(parms)
    return ifindex if eaction == TCA_EGRESS_REDIR else 0
