"""psp (flowpacer's precise pacing qdisc) options: a pyroute2 tcmsg plugin and fast packers.

Mirrors ``flowpacer/kernel/kmod/uapi/pkt_sch_psp.h``, the one source of truth; tests/test_psp_uapi.py
compiles that header and checks every attribute number, constant and struct layout here against
it, and decodes what this module encodes with C.

The objects (see the header comment of ``flowpacer/kernel/kmod/sch_psp.c``):

* qdisc ``psp``, root, handle ``MAJ:``: ``link_rate`` (bytes/s; default: the device's ethtool
  speed, required when the device reports none), ``default`` (minor of the default class, 2),
  ``overhead`` (bytes added to every wire packet, 0), ``limit`` (packets per class, 1000) and
  ``catchup`` (ns of lag a paced class may make up after a stall, at up to twice its rate;
  0..1 s, default 50 ms).
* The qdisc makes its default class ``MAJ:default`` itself: unpaced, for unmatched traffic, within
  the link rate. Do not ``add-class`` it (EEXIST); only its limit can be changed, with
  ``default_class_options()``; it cannot be deleted.
* classes ``MAJ:MIN`` with parent ``MAJ:`` (or root; there is no link class) or a group:
  ``rate`` (bytes/s, > 0), ``ceil`` (bytes/s, >= rate; default: rate, i.e. no borrowing) and
  ``limit``. ``change-class`` changes the rate in place; a class with filters bound to it cannot be
  deleted (delete the filter first).
* groups ``MAJ:MIN`` (``group=True``; ``group_options()``): a class that holds no packets and caps
  its members (classes, and groups one level down) together at its ``rate``, sharing it in
  proportion to their rates. Parent ``MAJ:`` or a top group (two levels: rule, client). Parents
  are fixed at creation; a group with members cannot be deleted (EBUSY).

pyroute2: after ``register()`` (or ``flowpacer.kernel.tc.register()``)::

    ipr.tc("add", kind="psp", index=idx, handle=0xF1F00000, link_rate=125_000_000)
    ipr.tc("add-class", kind="psp", index=idx, handle=0xF1F00010, parent=0xF1F00000,
           rate=1_250_000, ceil=2_500_000)

and dumps decode TCA_OPTIONS and the psp statistics (TCA_XSTATS, TCA_STATS_APP). The daemon's hot
path uses ``qdisc_options()``/``class_options()``, which return TCA_KIND + TCA_OPTIONS bytes for
``nl.py`` without going through pyroute2.
"""
from __future__ import annotations

import struct
from typing import Optional, Tuple

from pyroute2.netlink import NLA_F_NESTED, nla
from pyroute2.netlink.rtnl import RTM_DELQDISC, RTM_NEWQDISC, TC_H_ROOT
from pyroute2.netlink.rtnl.tcmsg.common import stats2 as _stats2

from flowpacer.kernel.tc.nl import (TCA_KIND, TCA_OPTIONS, nla as _nla, nla_nested, nla_str,
                                    nla_u32, nla_u64)

KIND = "psp"

# enum TCA_PSP_* (uapi/pkt_sch_psp.h)
TCA_PSP_UNSPEC = 0
TCA_PSP_PAD = 1
TCA_PSP_LINK_RATE = 2
TCA_PSP_DEFCLS = 3
TCA_PSP_OVERHEAD = 4
TCA_PSP_LIMIT = 5
TCA_PSP_CLASS_RATE = 6
TCA_PSP_CLASS_CEIL = 7
TCA_PSP_CLASS_LIMIT = 8
TCA_PSP_CATCHUP = 9
TCA_PSP_CLASS_GROUP = 10
TCA_PSP_MAX = 10

PSP_RATE_MAX = 1 << 40          # bytes/s
PSP_OVERHEAD_MAX = 1024         # bytes
PSP_LIMIT_MAX = 1 << 20         # packets
PSP_DEFAULT_LIMIT = 1000
PSP_DEFAULT_DEFCLS = 2
PSP_CATCHUP_MAX_NS = 1_000_000_000
PSP_DEFAULT_CATCHUP_NS = 50_000_000

PSP_CLASS_F_UNPACED = 0x1
PSP_CLASS_F_DEFAULT = 0x2
PSP_CLASS_F_ACTIVE = 0x4
PSP_CLASS_F_GROUP = 0x8
PSP_GROUP_LEVELS = 2

TCA_RATE = 5                    # top-level tcmsg attribute: struct tc_estimator

# struct tc_psp_xstats / struct tc_psp_class_xstats, field by field
QDISC_XSTATS_FIELDS = (
    ("link_rate", "Q"), ("rate_sum", "Q"), ("paced_pkts", "Q"), ("borrowed_pkts", "Q"),
    ("unpaced_pkts", "Q"), ("late_ns_total", "Q"), ("late_ns_max", "Q"), ("clamps", "Q"),
    ("timer_fires", "Q"), ("timer_late_ns_max", "Q"), ("gso_split", "Q"), ("longest_run", "Q"),
    ("classes", "I"), ("active", "I"),
)
CLASS_XSTATS_FIELDS = (
    ("rate", "Q"), ("ceil", "Q"), ("eff_rate", "Q"), ("rate_est", "Q"), ("borrowed_bytes", "Q"),
    ("borrowed_pkts", "Q"), ("clamps", "Q"), ("late_ns_max", "Q"), ("clock_ns", "q"),
    ("limit", "I"), ("flags", "I"), ("group_sum", "Q"), ("group_held", "Q"), ("members", "I"),
    ("pad", "I"),
)
QDISC_XSTATS = struct.Struct("=" + "".join(f for _, f in QDISC_XSTATS_FIELDS))
CLASS_XSTATS = struct.Struct("=" + "".join(f for _, f in CLASS_XSTATS_FIELDS))

parent = TC_H_ROOT              # pyroute2: default parent of psp qdiscs and classes


# ------------------------------------------------------------------ validation

def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"psp: {name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"psp: {name} {value} is outside {lo}..{hi}")
    return value


def _minor(value) -> int:
    """A default class given as a minor (2), a handle (0xF1F00002) or a string ("f1f0:2")."""
    if isinstance(value, str):
        try:
            value = int(value.rsplit(":", 1)[1], 16) if ":" in value else int(value, 0)
        except ValueError:
            raise ValueError(f"psp: default class {value!r} is not a class id") from None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0xFFFF:
        value &= 0xFFFF                  # a full handle: its minor
    return _int("default class minor", value, 1, 0xFFFF)


# ------------------------------------------------------- pyroute2 plugin interface

def get_parameters(kwarg: dict) -> dict:
    """TCA_OPTIONS of a psp qdisc from ``tc("add"|"change"|"replace", kind="psp", ...)``."""
    attrs = []
    if kwarg.get("link_rate") is not None:
        attrs.append(["TCA_PSP_LINK_RATE", _int("link_rate", kwarg["link_rate"], 1, PSP_RATE_MAX)])
    if kwarg.get("default") is not None:
        attrs.append(["TCA_PSP_DEFCLS", _minor(kwarg["default"])])
    if kwarg.get("overhead") is not None:
        attrs.append(["TCA_PSP_OVERHEAD", _int("overhead", kwarg["overhead"], 0, PSP_OVERHEAD_MAX)])
    if kwarg.get("limit") is not None:
        attrs.append(["TCA_PSP_LIMIT", _int("limit", kwarg["limit"], 1, PSP_LIMIT_MAX)])
    if kwarg.get("catchup") is not None:
        attrs.append(["TCA_PSP_CATCHUP", _int("catchup", kwarg["catchup"], 0, PSP_CATCHUP_MAX_NS)])
    return {"attrs": attrs}


def get_class_parameters(kwarg: dict) -> dict:
    """TCA_OPTIONS of a psp class from ``tc("add-class"|"change-class", kind="psp", ...)``."""
    attrs = []
    rate = kwarg.get("rate")
    ceil = kwarg.get("ceil")
    if rate is not None:
        attrs.append(["TCA_PSP_CLASS_RATE", _int("rate", rate, 1, PSP_RATE_MAX)])
    if ceil is not None:
        _int("ceil", ceil, 1, PSP_RATE_MAX)
        if rate is not None and ceil < rate:
            raise ValueError(f"psp: ceil {ceil} is below rate {rate}")
        attrs.append(["TCA_PSP_CLASS_CEIL", ceil])
    if kwarg.get("limit") is not None:
        attrs.append(["TCA_PSP_CLASS_LIMIT", _int("limit", kwarg["limit"], 1, PSP_LIMIT_MAX)])
    if kwarg.get("group"):
        attrs.append(["TCA_PSP_CLASS_GROUP", None])
    return {"attrs": attrs}


def fix_request(request: dict) -> None:
    # "rate" would otherwise also be sent as the tcmsg attribute TCA_RATE (an estimator)
    request.pop("rate", None)


class options(nla):
    """TCA_OPTIONS of psp qdiscs and classes (one attribute space, as in the header).

    The module parses it strictly (nla_parse_nested): the container must carry NLA_F_NESTED,
    which pyroute2 only sets when the class asks for it.
    """
    nla_flags = NLA_F_NESTED
    nla_map = (
        ("TCA_PSP_UNSPEC", "none"),
        ("TCA_PSP_PAD", "hex"),
        ("TCA_PSP_LINK_RATE", "uint64"),
        ("TCA_PSP_DEFCLS", "uint32"),
        ("TCA_PSP_OVERHEAD", "uint32"),
        ("TCA_PSP_LIMIT", "uint32"),
        ("TCA_PSP_CLASS_RATE", "uint64"),
        ("TCA_PSP_CLASS_CEIL", "uint64"),
        ("TCA_PSP_CLASS_LIMIT", "uint32"),
        ("TCA_PSP_CATCHUP", "uint64"),
        ("TCA_PSP_CLASS_GROUP", "flag"),
    )


class qdisc_xstats(nla):
    fields = QDISC_XSTATS_FIELDS


class class_xstats(nla):
    fields = CLASS_XSTATS_FIELDS


def _is_qdisc(msg) -> bool:
    return msg["header"]["type"] in (RTM_NEWQDISC, RTM_DELQDISC)


def stats(msg, *argv, **kwarg):
    """TCA_XSTATS: the qdisc or the class statistics struct."""
    return qdisc_xstats if _is_qdisc(msg) else class_xstats


class qdisc_stats2(_stats2):
    class stats_app(qdisc_xstats):
        pass


class class_stats2(_stats2):
    class stats_app(class_xstats):
        pass


def stats2(msg, *argv, **kwarg):
    """TCA_STATS2, with TCA_STATS_APP decoded as the psp statistics."""
    return qdisc_stats2 if _is_qdisc(msg) else class_stats2


def register() -> None:
    """Plug psp into pyroute2's tcmsg plugin table (idempotent)."""
    import sys
    from pyroute2.netlink.rtnl import tcmsg as _tcmsg
    _tcmsg.plugins[KIND] = sys.modules[__name__]


# --------------------------------------------------------------- fast packers

def qdisc_options(link_rate_bps: Optional[int], default_minor: int = PSP_DEFAULT_DEFCLS,
                  overhead_bytes: int = 0, limit: Optional[int] = None,
                  catchup_ns: Optional[int] = None) -> bytes:
    """TCA_KIND + TCA_OPTIONS for a psp qdisc. ``link_rate_bps`` None: the device's speed;
    ``catchup_ns`` None: the module's catch-up window (PSP_DEFAULT_CATCHUP_NS)."""
    opts = []
    if link_rate_bps is not None:
        opts.append(nla_u64(TCA_PSP_LINK_RATE, _int("link_rate", link_rate_bps, 1, PSP_RATE_MAX)))
    opts.append(nla_u32(TCA_PSP_DEFCLS, _minor(default_minor)))
    if overhead_bytes:
        opts.append(nla_u32(TCA_PSP_OVERHEAD,
                            _int("overhead", overhead_bytes, 0, PSP_OVERHEAD_MAX)))
    if limit is not None:
        opts.append(nla_u32(TCA_PSP_LIMIT, _int("limit", limit, 1, PSP_LIMIT_MAX)))
    if catchup_ns is not None:
        opts.append(nla_u64(TCA_PSP_CATCHUP, _int("catchup", catchup_ns, 0, PSP_CATCHUP_MAX_NS)))
    return nla_str(TCA_KIND, KIND) + nla_nested(TCA_OPTIONS, *opts)


def class_options(rate_bps: int, ceil_bps: Optional[int] = None, limit: Optional[int] = None,
                  estimator: Optional[Tuple[int, int]] = None) -> bytes:
    """TCA_KIND + TCA_OPTIONS (+ TCA_RATE) for a psp class; rates in bytes/s.

    ``ceil_bps`` None or equal to the rate: no borrowing. ``estimator`` (interval, ewma_log) as in
    ``tc ... estimator``: the kernel then also reports TCA_STATS_RATE_EST for the class (interval
    -2..3 means 0.25 s * 2**interval, ewma_log the averaging constant).
    """
    opts = [nla_u64(TCA_PSP_CLASS_RATE, _int("rate", rate_bps, 1, PSP_RATE_MAX))]
    if ceil_bps is not None and ceil_bps != rate_bps:
        _int("ceil", ceil_bps, 1, PSP_RATE_MAX)
        if ceil_bps < rate_bps:
            raise ValueError(f"psp: ceil {ceil_bps} is below rate {rate_bps}")
        opts.append(nla_u64(TCA_PSP_CLASS_CEIL, ceil_bps))
    if limit is not None:
        opts.append(nla_u32(TCA_PSP_CLASS_LIMIT, _int("limit", limit, 1, PSP_LIMIT_MAX)))
    out = nla_str(TCA_KIND, KIND) + nla_nested(TCA_OPTIONS, *opts)
    if estimator is not None:
        interval, ewma_log = estimator
        out += _nla(TCA_RATE, struct.pack("=bB", _int("estimator interval", interval, -2, 3),
                                          _int("estimator ewma_log", ewma_log, 1, 31)))
    return out


def group_options(rate_bps: int) -> bytes:
    """TCA_KIND + TCA_OPTIONS for a psp group (add or change): its cap in bytes/s. The flag is
    sent on changes too (the kernel refuses it only for a class that is not a group)."""
    return nla_str(TCA_KIND, KIND) + nla_nested(
        TCA_OPTIONS, nla_u64(TCA_PSP_CLASS_RATE, _int("group rate", rate_bps, 1, PSP_RATE_MAX)),
        _nla(TCA_PSP_CLASS_GROUP, b""))


def is_group(options: dict) -> bool:
    """Whether a dumped psp class (parsed TCA_OPTIONS) is a group."""
    return TCA_PSP_CLASS_GROUP in options


def default_class_options(limit: Optional[int] = None) -> bytes:
    """TCA_KIND + TCA_OPTIONS to *change* the qdisc-made default class (only its limit)."""
    opts = []
    if limit is not None:
        opts.append(nla_u32(TCA_PSP_CLASS_LIMIT, _int("limit", limit, 1, PSP_LIMIT_MAX)))
    return nla_str(TCA_KIND, KIND) + nla_nested(TCA_OPTIONS, *opts)


# --------------------------------------------------------------------- parsing

def _u(options: dict, attr: int, fmt: str) -> Optional[int]:
    raw = options.get(attr)
    if raw is None or len(raw) < struct.calcsize(fmt):
        return None
    return struct.unpack_from("=" + fmt, raw)[0]


def parse_qdisc_options(options: dict) -> dict:
    """A dumped psp qdisc's parsed TCA_OPTIONS ({attr: payload}) as named values."""
    return dict(link_rate_bps=_u(options, TCA_PSP_LINK_RATE, "Q"),
                default_minor=_u(options, TCA_PSP_DEFCLS, "I"),
                overhead_bytes=_u(options, TCA_PSP_OVERHEAD, "I"),
                limit=_u(options, TCA_PSP_LIMIT, "I"),
                catchup_ns=_u(options, TCA_PSP_CATCHUP, "Q"))


def parse_class_rates(options: dict) -> Tuple[int, int]:
    """(rate_bps, ceil_bps) of a dumped psp class; (0, 0) for the unpaced default class."""
    rate = _u(options, TCA_PSP_CLASS_RATE, "Q") or 0
    ceil = _u(options, TCA_PSP_CLASS_CEIL, "Q") or rate
    return rate, ceil


def parse_class_limit(options: dict) -> Optional[int]:
    return _u(options, TCA_PSP_CLASS_LIMIT, "I")


def parse_qdisc_xstats(raw: bytes) -> dict:
    """struct tc_psp_xstats (TCA_XSTATS or TCA_STATS_APP of the qdisc) as a dict."""
    if len(raw) < QDISC_XSTATS.size:
        raise ValueError(f"psp: qdisc xstats of {len(raw)} bytes, expected {QDISC_XSTATS.size}")
    return dict(zip((n for n, _ in QDISC_XSTATS_FIELDS), QDISC_XSTATS.unpack_from(raw)))


def parse_class_xstats(raw: bytes) -> dict:
    """struct tc_psp_class_xstats (TCA_XSTATS or TCA_STATS_APP of a class) as a dict."""
    if len(raw) < CLASS_XSTATS.size:
        raise ValueError(f"psp: class xstats of {len(raw)} bytes, expected {CLASS_XSTATS.size}")
    return dict(zip((n for n, _ in CLASS_XSTATS_FIELDS), CLASS_XSTATS.unpack_from(raw)))
