"""A model-based netlink fuzzer for the psp qdisc module (run inside the test VM, as root).

Random psp qdisc and class requests (create, change, replace, delete; random attribute types,
flags, sizes, nesting and edge values; random parents, class ids, netlink flags and rate
estimators) go to the module on a veth while UDP and TCP traffic flows through it (classified
by u32 filters made and deleted along the way, and by ``skb->priority``). A Python model of the
documented semantics (``flowpacer/kernel/kmod/README.md``, the kernel's strict attribute parsing and
the generic tc layer) predicts each request's outcome:

* every request must be refused with the predicted errno, or accepted when predicted valid;
* after every accepted request the qdisc and its classes must dump back exactly as the model
  says (options, class set, flags), and every so often the statistics must add up (qdisc
  queue = sum of the class queues, active classes and the backlogged rate sum as flagged).

A mismatch is a finding: it is recorded (with the request in hex) and the model is re-synced
from the kernel so the run goes on. The caller checks the kernel log and that the module still
unloads afterwards.

    python tests/guest/pspfuzz.py [--iterations 20000] [--seconds 600] [--seed N]
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import random
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import psplib  # noqa: E402
from harness.pacing import Testbed, wait_for  # noqa: E402
from harness.psplib import (NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, QDISC, RTM_DELQDISC,  # noqa: E402
                    RTM_DELTCLASS, RTM_NEWQDISC, RTM_NEWTCLASS, TC_H_ROOT, PspNl, h)
from flowpacer.kernel.tc import nl as N  # noqa: E402
from flowpacer.kernel.tc import psp as enc  # noqa: E402
from harness.testbed import in_netns  # noqa: E402

MAX = enc.PSP_RATE_MAX
LIMIT_MAX = enc.PSP_LIMIT_MAX
NESTED, BYTEORDER = 0x8000, 0x4000
TYPE_MASK = 0x3FFF
VETH_RATE = 10_000 * 1_000_000 // 8      # what a veth reports (10000 Mb/s), bytes/s
UDP_PORT, TCP_PORT = 7301, 7302

# attribute policy of each object (uapi/pkt_sch_psp.h and sch_psp.c)
QDISC_POLICY = {1: "pad", 2: "u64", 3: "u32", 4: "u32", 5: "u32", 6: "reject", 7: "reject",
                8: "reject", 9: "u64", 10: "reject"}
CLASS_POLICY = {1: "pad", 2: "reject", 3: "reject", 4: "reject", 5: "reject", 6: "u64",
                7: "u64", 8: "u32", 9: "reject", 10: "flag"}
U64_ATTRS = (2, 6, 7, 9)
GROUP = enc.TCA_PSP_CLASS_GROUP          # NLA_FLAG: no payload
LEN = {"u32": 4, "u64": 8, "flag": 0}

EDGE64 = [0, 1, 2, 7, 100, 1000, 125_000, 1_250_000, 12_500_000, 125_000_000, 10**9, 10**9 + 1,
          2**32 - 1, 2**32,
          MAX - 1, MAX, MAX + 1, 2**63, 2**64 - 1]
EDGE32 = [0, 1, 2, 3, 16, 24, 1000, 1023, 1024, 1025, 0xFFFF, 0x10000, LIMIT_MAX - 1, LIMIT_MAX,
          LIMIT_MAX + 1, 2**31, 2**32 - 1]


# --------------------------------------------------------------------------- attributes

@dataclasses.dataclass
class Attr:
    type: int                    # with flag bits
    payload: bytes
    declared: Optional[int] = None   # nla_len to write instead of the real one (malformed)

    def encode(self) -> bytes:
        n = 4 + len(self.payload)
        ln = self.declared if self.declared is not None else n
        return struct.pack("=HH", ln & 0xFFFF, self.type) + self.payload + b"\0" * ((4 - n % 4) % 4)


def strict_parse(payload: bytes, policy: Dict[int, str]) -> Tuple[int, Dict[int, int]]:
    """The kernel's nla_parse_nested (NL_VALIDATE_STRICT) on a psp policy: (0, {type: value})
    or (EINVAL, {})."""
    tb: Dict[int, int] = {}
    off, rem = 0, len(payload)
    while rem >= 4:
        ln, typ = struct.unpack_from("=HH", payload, off)
        if ln < 4 or ln > rem:
            break
        t = typ & TYPE_MASK
        kind = policy.get(t)
        if t == 0 or kind is None:          # UNSPEC, beyond maxtype: "Unknown attribute type"
            return errno.EINVAL, {}
        if kind in ("pad", "reject"):       # "Unsupported attribute", NLA_REJECT
            return errno.EINVAL, {}
        if typ & NESTED:                    # "NLA_F_NESTED not expected"
            return errno.EINVAL, {}
        if kind == "flag" and ln > 4:       # NLA_FLAG with a payload: "Attribute failed
            return errno.ERANGE, {}         # policy validation", ERANGE (6.1, 6.12)
        if ln - 4 != LEN[kind]:             # "invalid attribute length"
            return errno.EINVAL, {}
        tb[t] = int.from_bytes(payload[off + 4:off + ln], "little") if ln > 4 else 1
        step = (ln + 3) & ~3
        off += step
        rem -= step
    if rem > 0:                             # "bytes leftover after parsing attributes"
        return errno.EINVAL, {}
    return 0, tb


def estimator_ok(raw: Optional[bytes]) -> bool:
    if raw is None:
        return True
    if len(raw) != 2:
        return False
    interval, ewma = struct.unpack("=bB", raw)
    return -2 <= interval <= 3 and 1 <= ewma <= 30


# --------------------------------------------------------------------------- model

@dataclasses.dataclass
class Cls:
    rate: int
    ceil: Optional[int]              # None for groups (no ceil, no limit in their dumps)
    limit: Optional[int]
    group: bool = False
    parent: int = 0                  # its group's minor, 0: the qdisc


@dataclasses.dataclass
class Model:
    q: Optional[dict] = None                 # link, defcls, overhead, limit, catchup
    classes: Dict[int, Cls] = dataclasses.field(default_factory=dict)
    # u32 filters by prio: (class minor, bound). A filter is bound to its class (and keeps it
    # from being deleted) only if the class existed when the filter was made: tc's reverse
    # binding on class creation (tc_bind_tclass) only walks filters of a parent class, and psp
    # classes hang from the qdisc itself. An unbound filter still reaches its class by classid.
    filters: Dict[int, Tuple[int, bool]] = dataclasses.field(default_factory=dict)

    def view(self):
        if self.q is None:
            return None
        return ((self.q["link"], self.q["defcls"], self.q["overhead"], self.q["limit"],
                 self.q["catchup"]),
                {m: (c.rate, c.ceil, c.limit, c.rate == 0 and not c.group,
                     m == self.q["defcls"], c.group, c.parent)
                 for m, c in self.classes.items()})

    def members(self, minor: int) -> List[int]:
        return [m for m, c in self.classes.items() if c.parent == minor]


def kernel_view(sock: PspNl, dev: str):
    q = sock.root(dev)
    if q is None:
        return None
    cls = {}
    for m, c in sock.classes(dev).items():
        fl = c.xstats["flags"] if c.xstats else -1
        cls[m] = (c.rate, c.ceil, c.limit, bool(fl & enc.PSP_CLASS_F_UNPACED),
                  bool(fl & enc.PSP_CLASS_F_DEFAULT), bool(fl & enc.PSP_CLASS_F_GROUP),
                  _parent_minor(c.parent))
    return (q.link_rate, q.defcls, q.overhead, q.limit, q.catchup_ns), cls


def _parent_minor(parent: int) -> int:
    return 0 if parent in (TC_H_ROOT, QDISC) else parent & 0xFFFF


def model_from_kernel(sock: PspNl, dev: str, filters: Dict[int, Tuple[int, bool]]) -> Model:
    q = sock.root(dev)
    m = Model(filters=dict(filters))
    if q is None:
        m.filters = {}
        return m
    m.q = dict(link=q.link_rate, defcls=q.defcls, overhead=q.overhead, limit=q.limit,
               catchup=q.catchup_ns)
    m.classes = {}
    for mi, c in sock.classes(dev).items():
        if c.xstats and c.xstats["flags"] & enc.PSP_CLASS_F_GROUP:
            m.classes[mi] = Cls(c.rate, None, None, True, _parent_minor(c.parent))
        else:
            m.classes[mi] = Cls(c.rate or 0, c.ceil or 0, c.limit, False,
                                _parent_minor(c.parent))
    return m


def check_qopt(tb: Dict[int, int]) -> int:
    """psp_parse_qopt's semantic checks, in its order."""
    if 2 in tb:
        if tb[2] == 0:
            return errno.EINVAL
        if tb[2] > MAX:
            return errno.ERANGE
    if 3 in tb:
        d = tb[3]
        if (d >> 16) and (d >> 16) != psplib.MAJOR:
            return errno.EINVAL
        if d & 0xFFFF == 0:
            return errno.EINVAL
    if 4 in tb and tb[4] > 1024:
        return errno.EINVAL
    if 5 in tb and not 1 <= tb[5] <= LIMIT_MAX:
        return errno.EINVAL
    if 9 in tb and tb[9] > enc.PSP_CATCHUP_MAX_NS:
        return errno.ERANGE
    return 0


# --------------------------------------------------------------------------- requests

@dataclasses.dataclass
class Req:
    op: str
    mtype: int
    flags: int
    handle: int
    parent: int
    kind: Optional[str]
    options: Optional[bytes]          # TCA_OPTIONS payload (None: no TCA_OPTIONS)
    nested: bool = True
    estimator: Optional[bytes] = None
    malformed: bool = False

    def body(self, ifindex: int) -> bytes:
        out = N.tcmsg(ifindex, self.handle, self.parent)
        if self.kind is not None:
            out += N.nla_str(N.TCA_KIND, self.kind)
        if self.options is not None:
            out += N.nla(N.TCA_OPTIONS | (NESTED if self.nested else 0), self.options)
        if self.estimator is not None:
            out += N.nla(N.TCA_RATE, self.estimator)
        return out

    def describe(self) -> str:
        return (f"{self.op} type={self.mtype} flags={self.flags:#x} handle={self.handle:#x} "
                f"parent={self.parent:#x} kind={self.kind} nested={self.nested} "
                f"options={self.options.hex() if self.options is not None else None} "
                f"estimator={self.estimator.hex() if self.estimator is not None else None}")


class Gen:
    """Random requests, mostly near the valid space, with edge values and malformed encodings."""

    def __init__(self, rng: random.Random):
        self.r = rng

    def v64(self) -> int:
        r = self.r.random()
        if r < 0.55:
            return self.r.choice(EDGE64)
        if r < 0.85:
            return self.r.randint(1, 50_000_000)       # rates the traffic can feel
        return self.r.getrandbits(self.r.choice((16, 32, 41, 64)))

    def v32(self) -> int:
        r = self.r.random()
        if r < 0.6:
            return self.r.choice(EDGE32)
        if r < 0.85:
            return self.r.randint(1, 3000)
        return self.r.getrandbits(32)

    def minor(self, model: Model) -> int:
        r = self.r.random()
        if model.classes and r < 0.6:
            return self.r.choice(list(model.classes))
        if r < 0.9:
            return self.r.randint(0x10, 0x30)
        return self.r.choice([0, 1, 2, 0xFFFF, self.r.getrandbits(16)])

    def attrs(self, allowed: List[int], other: List[int], model: Model) -> Tuple[bytes, bool]:
        """TCA_OPTIONS payload: (bytes, malformed?)."""
        r = self.r
        out: List[Attr] = []
        malformed = r.random() < 0.25
        if r.random() < 0.5:                  # plausible values, in the valid space
            out = self.plausible(allowed, model)
            n_random = r.choice((0, 0, 1))
        else:
            n_random = r.choice((0, 1, 1, 2, 2, 3, 4, 6))
        for _ in range(n_random):
            t = r.choice(allowed) if r.random() < 0.85 else r.choice(other)
            if t == GROUP:
                out.append(Attr(t, b"" if r.random() < 0.8 else os.urandom(4)))
                continue
            size = 8 if t in U64_ATTRS else 4
            if t == 3 and r.random() < 0.5:                 # a default class: real minors
                val = r.choice([self.minor(model), h(self.minor(model)),
                                h(self.minor(model), 0x1234)])
            else:
                val = self.v64() if size == 8 else self.v32()
            out.append(Attr(t, (val & ((1 << (8 * size)) - 1)).to_bytes(size, "little")))
        if malformed:
            for _ in range(r.randint(1, 2)):
                kind = r.randrange(7)
                if kind == 0:      # random type, any flags, random size
                    t = r.choice([0, 1, 10, 11, 0x3FFF, r.getrandbits(16), r.choice(allowed)])
                    out.insert(r.randrange(len(out) + 1),
                               Attr(t, os.urandom(r.choice((0, 1, 2, 3, 4, 5, 7, 8, 12, 16)))))
                elif kind == 1 and out:   # wrong size for a known type
                    a = r.choice(out)
                    a.payload = a.payload[:r.choice((0, 1, 2, 3, 4, 5, 7))] if r.random() < 0.5 \
                        else a.payload + os.urandom(r.choice((1, 4, 8)))
                elif kind == 2 and out:   # a flag on an attribute
                    r.choice(out).type |= r.choice((NESTED, BYTEORDER, NESTED | BYTEORDER))
                elif kind == 3:           # nesting: a known attribute holding attributes
                    inner = b"".join(Attr(r.choice(allowed), struct.pack("=Q", self.v64())).encode()
                                     for _ in range(r.randint(0, 2)))
                    out.append(Attr(r.choice(allowed) | (NESTED if r.random() < 0.7 else 0), inner))
                elif kind == 4 and out:   # a lying nla_len
                    a = r.choice(out)
                    a.declared = r.choice((0, 1, 3, 5, 4 + len(a.payload) + r.choice((1, 4, 100))))
                elif kind == 5:           # trailing bytes
                    out.append(Attr(0, b""))
                    tail = os.urandom(r.choice((1, 2, 3, 4, 6)))
                    return b"".join(a.encode() for a in out[:-1]) + tail, True
                else:                     # pad attribute
                    out.insert(0, Attr(1, os.urandom(r.choice((0, 4, 8)))))
        return b"".join(a.encode() for a in out), malformed

    def plausible(self, allowed: List[int], model: Model) -> List[Attr]:
        r = self.r
        out = []
        if 6 in allowed:                      # class: rate, maybe a ceil above it, a limit
            rate = r.choice((r.randint(1000, 5_000_000), r.randint(1, 1000), MAX))
            if r.random() < 0.8:
                out.append(Attr(6, struct.pack("=Q", rate)))
            if r.random() < 0.25:             # a group (then a ceil or limit is refused)
                out.append(Attr(GROUP, b""))
                if r.random() < 0.7:
                    r.shuffle(out)
                    return out
            if r.random() < 0.4:
                out.append(Attr(7, struct.pack("=Q", min(MAX, rate * r.choice((1, 2, 3, 10))))))
            if r.random() < 0.3:
                out.append(Attr(8, struct.pack("=I", r.choice((1, 2, 50, 1000, LIMIT_MAX)))))
        else:                                 # qdisc: link rate, default class, overhead, limit
            if r.random() < 0.6:
                out.append(Attr(2, struct.pack("=Q", r.choice((r.randint(10_000, 200_000_000),
                                                               1, MAX)))))
            if r.random() < 0.3 and model.classes:
                out.append(Attr(3, struct.pack("=I", r.choice(list(model.classes)))))
            if r.random() < 0.3:
                out.append(Attr(4, struct.pack("=I", r.choice((0, 24, 1024)))))
            if r.random() < 0.3:
                out.append(Attr(5, struct.pack("=I", r.choice((1, 10, 1000, LIMIT_MAX)))))
            if r.random() < 0.3:
                out.append(Attr(9, struct.pack("=Q", r.choice((0, 1, 10_000_000,
                                                               enc.PSP_CATCHUP_MAX_NS)))))
        r.shuffle(out)
        return out

    def estimator(self) -> Optional[bytes]:
        r = self.r.random()
        if r < 0.8:
            return None
        if r < 0.9:
            return struct.pack("=bB", self.r.randint(-2, 3), self.r.randint(1, 30))
        return os.urandom(self.r.choice((0, 1, 2, 2, 2, 3, 4)))

    def request(self, model: Model) -> Req:
        r = self.r
        if model.q is None:
            op = "qdisc-create"
        else:
            op = r.choices(["qdisc-change", "qdisc-replace", "qdisc-delete", "class-add",
                            "class-change", "class-delete"],
                           weights=[12, 5, 2, 40, 25, 16])[0]
        if op.startswith("qdisc"):
            if op == "qdisc-delete":
                return Req(op, RTM_DELQDISC, 0, 0, TC_H_ROOT, None, None)
            payload, bad = self.attrs([2, 3, 4, 5, 9], [1, 6, 7, 8], model)
            flags = {"qdisc-create": NLM_F_CREATE | NLM_F_EXCL, "qdisc-change": 0,
                     "qdisc-replace": NLM_F_CREATE | NLM_F_REPLACE}[op]
            opts = payload if r.random() < 0.93 else None
            return Req(op, RTM_NEWQDISC, flags, QDISC, TC_H_ROOT, "psp", opts,
                       nested=r.random() < 0.95, estimator=self.estimator(), malformed=bad)
        mtype = RTM_DELTCLASS if op == "class-delete" else RTM_NEWTCLASS
        flags = {"class-add": r.choice([NLM_F_CREATE | NLM_F_EXCL, NLM_F_CREATE]),
                 "class-change": r.choice([0, 0, NLM_F_CREATE]), "class-delete": 0}[op]
        mi = self.minor(model)
        handle = r.choices([h(mi), mi, h(mi, 0x1234), 0], weights=[85, 6, 5, 4])[0]
        groups = [m for m, c in model.classes.items() if c.group]
        parent = r.choices([QDISC, TC_H_ROOT, 0, h(self.minor(model)), h(0, 0x1234),
                            h(r.choice(groups)) if groups else QDISC],
                           weights=[50, 10, 8, 6, 4, 22])[0]
        if mtype == RTM_DELTCLASS:
            return Req(op, mtype, flags, handle, parent, None, None)
        payload, bad = self.attrs([6, 7, 8, GROUP], [1, 2, 3, 4, 5, 9], model)
        tops = [g for g in groups if not model.classes[g].parent]
        subs = [g for g in groups if model.classes[g].parent]
        if op == "class-add" and tops and r.random() < 0.25:
            rate = Attr(6, struct.pack("=Q", r.randint(1000, 5_000_000))).encode()
            free = [mi for mi in range(0x10, 0x31) if mi not in model.classes]
            handle = h(r.choice(free)) if free else handle      # a new class, not a change
            if subs and r.random() < 0.5:
                # a class in a client group under a rule group: the two-level case
                parent, payload, bad = h(r.choice(subs)), rate, False
            else:
                # a client group under a rule group, or a class in a rule group
                parent = h(r.choice(tops))
                payload, bad = rate + (Attr(GROUP, b"").encode() if r.random() < 0.6 else b""), \
                    False
        opts = payload if r.random() < 0.95 else None
        return Req(op, mtype, flags, handle, parent, "psp", opts, nested=r.random() < 0.95,
                   estimator=self.estimator(), malformed=bad)


def predict(req: Req, m: Model) -> Tuple[int, Optional[Model]]:
    """(expected errno, the model after it; None when unchanged)."""
    if req.op == "qdisc-delete":
        return (0, Model()) if m.q else (errno.ENOENT, None)
    if req.estimator is not None and len(req.estimator) > 2:
        return errno.ERANGE, None            # rtm_tca_policy: TCA_RATE (NLA_BINARY) <= 2 bytes
    if req.op.startswith("qdisc"):
        return _predict_qdisc(req, m)
    return _predict_class(req, m)


def _parsed(req: Req, policy) -> Tuple[int, Dict[int, int]]:
    if req.options is None:
        return 0, {}
    if not req.nested:
        return errno.EINVAL, {}              # "NLA_F_NESTED is missing"
    return strict_parse(req.options, policy)


def _predict_qdisc(req: Req, m: Model) -> Tuple[int, Optional[Model]]:
    if req.op == "qdisc-create":             # no psp root: qdisc_create -> psp_init
        err, tb = _parsed(req, QDISC_POLICY)
        err = err or check_qopt(tb)
        if err:
            return err, None
        if not estimator_ok(req.estimator):
            return errno.EINVAL, None        # init succeeded, the estimator failed
        link = tb.get(2, VETH_RATE)
        limit = tb.get(5, 1000)
        defcls = tb[3] & 0xFFFF if 3 in tb else 2
        return 0, Model(q=dict(link=min(link, MAX), defcls=defcls, overhead=tb.get(4, 0),
                               limit=limit, catchup=tb.get(9, enc.PSP_DEFAULT_CATCHUP_NS)),
                        classes={defcls: Cls(0, 0, limit)})
    # change or replace of the existing psp root: qdisc_change -> psp_change (options given)
    err, tb = _parsed(req, QDISC_POLICY)
    err = err or check_qopt(tb)
    if err:
        return err, None
    if 3 in tb and tb[3] & 0xFFFF in m.classes and m.classes[tb[3] & 0xFFFF].group:
        return errno.EINVAL, None            # "the default class cannot be a group"
    if 3 in tb and tb[3] & 0xFFFF not in m.classes:
        return errno.ENOENT, None            # "unknown default class"
    n = Model(q=dict(m.q), classes={k: dataclasses.replace(v) for k, v in m.classes.items()},
              filters=dict(m.filters))
    # qdisc_change ignores a bad estimator (the change cannot be undone)
    if 2 in tb:
        n.q["link"] = tb[2]
    if 4 in tb:
        n.q["overhead"] = tb[4]
    if 5 in tb:
        n.q["limit"] = tb[5]
    if 9 in tb:
        n.q["catchup"] = tb[9]
    if 3 in tb:
        n.q["defcls"] = tb[3] & 0xFFFF
    return 0, n


def _predict_class(req: Req, m: Model) -> Tuple[int, Optional[Model]]:
    qh = QDISC
    portid, clid = req.parent, req.handle
    qid = clid & 0xFFFF0000
    if portid != TC_H_ROOT:
        qid1 = portid & 0xFFFF0000
        if qid and qid1:
            if qid != qid1:
                return errno.EINVAL, None
        elif qid1:
            qid = qid1
        elif qid == 0:
            qid = qh
        if portid:
            portid = qid | (portid & 0xFFFF)
    elif qid == 0:
        qid = qh
    if qid != qh:
        return errno.ENOENT, None
    if clid == 0:
        if portid == TC_H_ROOT:
            clid = qid
    else:
        clid = qid | (clid & 0xFFFF)
    minor = clid & 0xFFFF
    found = bool(clid) and minor != 0 and minor in m.classes
    if not found:
        if req.mtype != RTM_NEWTCLASS or not req.flags & NLM_F_CREATE:
            return errno.ENOENT, None
    else:
        if req.mtype == RTM_NEWTCLASS and req.flags & NLM_F_EXCL:
            return errno.EEXIST, None
        if req.mtype == RTM_DELTCLASS:
            if minor == m.q["defcls"] or (minor, True) in m.filters.values():
                return errno.EBUSY, None
            if m.members(minor):
                return errno.EBUSY, None     # a group with members
            n = _copy(m)
            del n.classes[minor]
            return 0, n
    # psp_change_class: options, strict parsing, the parent, then the values (sch_psp.c)
    if req.options is None:
        return errno.EINVAL, None            # options missing
    err, tb = _parsed(req, CLASS_POLICY)
    if err:
        return err, None
    pg = 0                                   # the parent group's minor, 0: the qdisc
    if portid not in (TC_H_ROOT, 0, qh):
        pm = portid & 0xFFFF
        if pm not in m.classes:
            return errno.ENOENT, None        # neither the qdisc nor one of its groups
        if not m.classes[pm].group:
            return errno.EINVAL, None        # only groups have members
        pg = pm
    if found and portid != 0 and pg != m.classes[minor].parent:
        return errno.EINVAL, None            # parents are fixed at creation
    if not found and (minor == 0 or clid & 0xFFFF0000 != qh):
        return errno.EINVAL, None
    cl = m.classes.get(minor) if found else None
    group = cl.group if found else GROUP in tb
    if found and not cl.group and GROUP in tb:
        return errno.EINVAL, None            # a class cannot become a group
    if group and (7 in tb or 8 in tb):
        return errno.EINVAL, None            # a group has no ceil and no limit
    limit_only = False
    if found:
        if not cl.group and cl.rate == 0 and (6 in tb or 7 in tb):
            return errno.EINVAL, None        # the unpaced class: only its limit
        rate = cl.rate
        ceil = cl.rate if cl.group else cl.ceil
        if 6 in tb:
            rate = tb[6]
            if cl.group or cl.ceil == cl.rate:
                ceil = rate
        limit = cl.limit
        limit_only = not cl.group and cl.rate == 0
    else:
        if 6 not in tb:
            return errno.EINVAL, None
        rate = ceil = tb[6]
        limit = None if group else m.q["limit"]
    ceil = tb.get(7, ceil)
    limit = tb.get(8, limit)
    if not limit_only:
        if rate == 0:
            return errno.EINVAL, None
        if rate > MAX:
            return errno.ERANGE, None
        if ceil < rate:
            return errno.EINVAL, None
        if ceil > MAX:
            return errno.ERANGE, None
    if not group and not 1 <= limit <= LIMIT_MAX:
        return errno.EINVAL, None
    if not found and group and pg and m.classes[pg].parent:
        return errno.EINVAL, None            # two group levels at most
    if not estimator_ok(req.estimator):
        return errno.EINVAL, None
    n = _copy(m)
    parent = cl.parent if found else pg
    if group:
        n.classes[minor] = Cls(rate, None, None, True, parent)
    elif limit_only:
        n.classes[minor] = Cls(0, 0, limit, False, parent)
    else:
        n.classes[minor] = Cls(rate, ceil, limit, False, parent)
    return 0, n


def _copy(m: Model) -> Model:
    return Model(q=dict(m.q) if m.q else None,
                 classes={k: dataclasses.replace(v) for k, v in m.classes.items()},
                 filters=dict(m.filters))


# --------------------------------------------------------------------------- traffic

class Traffic:
    """UDP datagrams (random sizes and skb priorities naming psp classes) and one TCP stream
    (GSO-sized writes) from the sender's namespace to the receiver's, until stopped."""

    def __init__(self, tb: Testbed, rng: random.Random, model_minors):
        self.tb, self.rng, self.minors = tb, rng, model_minors
        self.stop_ev = threading.Event()
        self.pause_ev = threading.Event()
        self.udp_idle = threading.Event()
        self.tcp_idle = threading.Event()
        self.sent = {"udp": 0, "tcp_bytes": 0, "tcp_connects": 0}
        self.errors: List[str] = []
        self.threads = [threading.Thread(target=self._guard, args=(f,), daemon=True)
                        for f in (self._udp, self._tcp_sink, self._tcp)]
        self._listening = threading.Event()

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        if not self._listening.wait(20):
            raise TimeoutError("the TCP sink did not listen within 20 s")
        return self

    def __exit__(self, *exc) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(20)

    def pause(self) -> bool:
        """Stop sending: the UDP sender idles and the TCP stream is reset (so the stack sends
        nothing more from its buffer). True once both have stopped."""
        self.pause_ev.set()
        return self.udp_idle.wait(10) and self.tcp_idle.wait(10)

    def resume(self) -> None:
        self.udp_idle.clear()
        self.tcp_idle.clear()
        self.pause_ev.clear()

    def _guard(self, fn):
        try:
            fn()
        except BaseException as e:  # reported by the fuzzer
            self.errors.append(f"{fn.__name__}: {e!r}")

    def _udp(self):
        with in_netns(self.tb.sender_ns):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        try:
            while not self.stop_ev.wait(0.002):
                if self.pause_ev.is_set():
                    self.udp_idle.set()
                    continue
                minors = self.minors()
                prio = h(self.rng.choice(minors + [0x77])) \
                    if minors and self.rng.random() < 0.7 else 0
                s.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, struct.pack("=I", prio))
                size = self.rng.choice((18, 100, 600, 1400, 1472, 3000))
                try:
                    s.sendto(b"f" * size, (self.tb.receiver_addr, UDP_PORT))
                    self.sent["udp"] += 1
                except (BlockingIOError, OSError):
                    pass
        finally:
            s.close()

    def _tcp_sink(self):
        with in_netns(self.tb.receiver_ns):
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.tb.receiver_addr, TCP_PORT))
        ls.listen(8)
        ls.setblocking(False)
        self._listening.set()
        conns: List[socket.socket] = []
        try:
            while not self.stop_ev.is_set():
                r, _, _ = select.select([ls] + conns, [], [], 0.1)
                for x in r:
                    if x is ls:
                        c, _ = ls.accept()
                        c.setblocking(False)
                        conns.append(c)
                        continue
                    try:
                        if not x.recv(1 << 16):
                            conns.remove(x)
                            x.close()
                    except OSError:
                        conns.remove(x)
                        x.close()
        finally:
            for c in conns:
                c.close()
            ls.close()

    def _tcp(self):
        chunk = b"t" * 65536
        s = None
        try:
            while not self.stop_ev.is_set():
                if self.pause_ev.is_set():
                    if s is not None:         # reset: no more data from its buffer
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                     struct.pack("ii", 1, 0))
                        s.close()
                        s = None
                    self.tcp_idle.set()
                    self.stop_ev.wait(0.01)
                    continue
                if s is None:
                    with in_netns(self.tb.sender_ns):
                        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.settimeout(2)
                    try:
                        s.connect((self.tb.receiver_addr, TCP_PORT))
                    except OSError:
                        s.close()
                        s = None
                        self.stop_ev.wait(0.2)
                        continue
                    s.setblocking(False)
                    self.sent["tcp_connects"] += 1
                _, w, _ = select.select([], [s], [], 0.1)
                if w:
                    try:
                        self.sent["tcp_bytes"] += s.send(chunk)
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        s = None
        finally:
            if s is not None:
                s.close()


# --------------------------------------------------------------------------- the run

@dataclasses.dataclass
class Finding:
    iteration: int
    what: str
    request: str

    def __str__(self) -> str:
        return f"#{self.iteration}: {self.what}\n    {self.request}"


class Fuzzer:
    def __init__(self, tb: Testbed, sock: PspNl, seed: int):
        self.tb, self.sock, self.seed = tb, sock, seed
        self.rng = random.Random(seed)
        self.gen = Gen(self.rng)
        self.model = Model()
        self.dev = tb.sender_dev
        self.ifindex = sock.ifindex(self.dev)
        self.findings: List[Finding] = []
        self.counts: Dict[str, int] = {}
        self.errnos: Dict[str, int] = {}
        self.iterations = 0
        self.accepted = 0
        self.malformed = 0
        self.stat_checks = 0
        self.stat_skipped = 0
        self.filter_ops = 0
        self.groups_seen = 0         # accepted requests after which a group / a class in a
        self.grouped_seen = 0        # group / a member of a client group existed
        self.two_levels_seen = 0
        self._next_prio = 10

    def minors(self) -> List[int]:
        return list(self.model.classes)

    def _find(self, what: str, req: str = "") -> None:
        self.findings.append(Finding(self.iterations, what, req))
        self.model = model_from_kernel(self.sock, self.dev, self.model.filters)

    def _filter_op(self) -> None:
        """Add a u32 filter to a (maybe not yet existing) class, or delete one."""
        self.filter_ops += 1
        m = self.model
        if m.filters and (len(m.filters) > 4 or self.rng.random() < 0.4):
            prio = self.rng.choice(list(m.filters))
            r = self.tb.s("tc", "filter", "del", "dev", self.dev, "parent", "f1f0:", "protocol",
                          "ip", "prio", str(prio), check=False)
            if r.returncode != 0:
                self._find(f"deleting filter prio {prio} failed: {r.stderr.strip()}")
                return
            del m.filters[prio]
            return
        minor = self.rng.choice(self.minors() + [self.rng.randint(0x10, 0x30)])
        prio = self._next_prio
        self._next_prio += 1
        port = self.rng.choice((UDP_PORT, TCP_PORT))
        r = self.tb.s("tc", "filter", "add", "dev", self.dev, "parent", "f1f0:", "protocol", "ip",
                      "prio", str(prio), "u32", "match", "ip", "dport", str(port), "0xffff",
                      "flowid", f"f1f0:{minor:x}", check=False)
        if r.returncode != 0:
            self._find(f"adding a filter to f1f0:{minor:x} failed: {r.stderr.strip()}")
            return
        m.filters[prio] = (minor, minor in m.classes)

    def step(self) -> None:
        self.iterations += 1
        if self.model.q is not None and self.rng.random() < 0.03:
            self._filter_op()
            return
        req = self.gen.request(self.model)
        self.counts[req.op] = self.counts.get(req.op, 0) + 1
        self.malformed += req.malformed
        want, after = predict(req, self.model)
        got, ext = self.sock.send(req.mtype, req.flags, req.body(self.ifindex))
        self.errnos[errno.errorcode.get(got, str(got)) if got else "accepted"] = \
            self.errnos.get(errno.errorcode.get(got, str(got)) if got else "accepted", 0) + 1
        if got != want:
            self._find(f"{req.op}: kernel said {errno.errorcode.get(got, got) if got else 'ok'}"
                       f" ({ext}), the model {errno.errorcode.get(want, want) if want else 'ok'}",
                       req.describe())
            return
        if got == 0:
            self.accepted += 1
            self.model = after
            for c in after.classes.values():
                if c.group:
                    self.groups_seen += 1
                if c.parent:
                    self.grouped_seen += 1
                    if self.model.classes.get(c.parent) and self.model.classes[c.parent].parent:
                        self.two_levels_seen += 1
            kv = kernel_view(self.sock, self.dev)
            if kv != self.model.view():
                self._find(f"{req.op} accepted, but the dump differs from the model:\n"
                           f"    kernel {kv}\n    model  {self.model.view()}", req.describe())
        else:
            ours = (req.parent in (QDISC, TC_H_ROOT, 0) or req.parent >> 16 == psplib.MAJOR) \
                and req.handle >> 16 in (0, psplib.MAJOR)
            if ext is None and got not in (errno.ENOENT, errno.EEXIST) and ours \
                    and req.estimator is None and not req.malformed and req.nested:
                # psp's own refusals carry a reason (the generic layer's may not)
                self._find(f"{req.op}: refused ({errno.errorcode.get(got, got)}) without an "
                           "extack message", req.describe())
                return
            if self.rng.random() < 0.25:
                kv = kernel_view(self.sock, self.dev)
                if kv != self.model.view():
                    self._find(f"{req.op} refused ({errno.errorcode.get(got, got)}), but the "
                               f"configuration changed:\n    kernel {kv}\n    model  "
                               f"{self.model.view()}", req.describe())

    def check_stats(self, traffic: Traffic) -> None:
        """Queue and activity figures add up (taken while the traffic pauses: a packet that
        leaves between the qdisc's and the classes' dump would skew them)."""
        if self.model.q is None:
            return
        if not traffic.pause():
            self.stat_skipped += 1
            traffic.resume()
            return
        try:
            snap = {}

            def stable():
                a = self.sock.classes(self.dev)
                q1 = self.sock.root(self.dev)
                b = self.sock.classes(self.dev)
                q2 = self.sock.root(self.dev)
                key = lambda cs: {m: (c.stats["qlen"], c.stats["backlog_bytes"],
                                      c.xstats["flags"]) for m, c in cs.items()}
                qkey = lambda q: (q.stats["qlen"], q.stats["backlog_bytes"], q.xstats["active"],
                                  q.xstats["rate_sum"])
                if key(a) == key(b) and qkey(q1) == qkey(q2):
                    snap.update(q=q1, cls=b)
                    return True
                return False
            try:
                wait_for(stable, 3, "a stable statistics snapshot", interval=0.02)
            except TimeoutError:
                self.stat_skipped += 1
                return
            self.stat_checks += 1
            q, cls = snap["q"], snap["cls"]
            groups = {m: c for m, c in cls.items() if c.xstats["flags"] & enc.PSP_CLASS_F_GROUP}
            plain = {m: c for m, c in cls.items() if m not in groups}
            act = [c for c in plain.values() if c.xstats["flags"] & enc.PSP_CLASS_F_ACTIVE]
            problems = []
            if q.stats["qlen"] != sum(c.stats["qlen"] for c in cls.values()):
                problems.append(f"qdisc qlen {q.stats['qlen']} != sum of class qlen "
                                f"{sum(c.stats['qlen'] for c in cls.values())}")
            if q.stats["backlog_bytes"] != sum(c.stats["backlog_bytes"] for c in cls.values()):
                problems.append(f"qdisc backlog {q.stats['backlog_bytes']} != sum of class "
                                f"backlogs {sum(c.stats['backlog_bytes'] for c in cls.values())}")
            if any((c.stats["qlen"] > 0) != bool(c.xstats["flags"] & enc.PSP_CLASS_F_ACTIVE)
                   for c in plain.values()):
                problems.append("a class's active flag disagrees with its queue")
            if q.xstats["active"] != len(act):
                problems.append(f"qdisc active {q.xstats['active']} != {len(act)} active classes")
            # demands (psp_sched.h, "Groups"): a group's sum is its busy members' demands, its
            # own demand min(rate, sum); the link's rate_sum adds up the top-level demands
            demand = {}

            def dem(m):
                if m not in demand:
                    c = cls[m]
                    if m in groups:
                        kids = [k for k, x in cls.items() if _parent_minor(x.parent) == m]
                        s_ = sum(dem(k) for k in kids)
                        if c.xstats["group_sum"] != s_:
                            problems.append(f"group {m:x}: sum {c.xstats['group_sum']} != {s_}")
                        if bool(c.xstats["flags"] & enc.PSP_CLASS_F_ACTIVE) != (s_ > 0):
                            problems.append(f"group {m:x}: active flag with demand {s_}")
                        if c.xstats["members"] != len(kids):
                            problems.append(f"group {m:x}: {c.xstats['members']} members, "
                                            f"{len(kids)} dumped")
                        demand[m] = min(c.rate, s_)
                    else:
                        active = c.xstats["flags"] & enc.PSP_CLASS_F_ACTIVE
                        demand[m] = c.xstats["rate"] if active else 0
                return demand[m]
            want_sum = sum(dem(m) for m, c in cls.items() if _parent_minor(c.parent) == 0)
            if q.xstats["rate_sum"] != want_sum:
                problems.append(f"rate_sum {q.xstats['rate_sum']} != {want_sum}")
            if q.xstats["classes"] != len(cls):
                problems.append(f"classes {q.xstats['classes']} != {len(cls)} dumped")
            for p in problems:
                self._find("statistics: " + p)
        finally:
            traffic.resume()

    def summary(self, seconds: float, traffic: Optional[Traffic]) -> dict:
        return {"seed": self.seed, "iterations": self.iterations, "seconds": round(seconds, 1),
                "accepted": self.accepted, "malformed_requests": self.malformed,
                "requests_by_op": self.counts, "outcomes": self.errnos,
                "filter_ops": self.filter_ops, "stat_checks": self.stat_checks,
                "groups_seen": self.groups_seen, "grouped_seen": self.grouped_seen,
                "two_levels_seen": self.two_levels_seen,
                "stat_checks_skipped": self.stat_skipped,
                "traffic": dict(traffic.sent) if traffic else {},
                "traffic_errors": traffic.errors if traffic else [],
                "findings": [str(f) for f in self.findings]}


def run(tb: Testbed, iterations: int, seconds: float, seed: int,
        stat_every: int = 150) -> dict:
    """Fuzz the psp qdisc on ``tb``'s sender veth; returns the summary (findings included).
    The qdisc is deleted at the end."""
    with PspNl(tb.sender_ns) as sock:
        fz = Fuzzer(tb, sock, seed)
        t0 = time.monotonic()
        with Traffic(tb, random.Random(seed + 1), fz.minors) as traffic:
            while fz.iterations < iterations and time.monotonic() - t0 < seconds:
                fz.step()
                if fz.iterations % stat_every == 0:
                    fz.check_stats(traffic)
                if len(fz.findings) > 50:
                    break
            fz.check_stats(traffic)
        out = fz.summary(time.monotonic() - t0, traffic)
        if sock.root(tb.sender_dev) is not None:
            assert sock.del_root(tb.sender_dev) == (0, None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    psplib.ensure_loaded()
    with Testbed() as tb:
        out = run(tb, args.iterations, args.seconds, seed)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if out["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
