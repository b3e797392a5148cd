"""The psp module inside the test VM: loading it, and talking to it over rtnetlink.

iproute2's tc does not know psp's options, so qdiscs and classes are made with raw rtnetlink
requests (``flowpacer.kernel.tc.nl`` transport, ``flowpacer.kernel.tc.psp`` encodings); filters, which are
generic, are made with ``tc``. Every refusal comes back with the kernel's extack text.

The module file is ``$FLOWPACER_PSP_KO`` (``tests/test_vm.py`` builds it on the host against the
guest's kernel before the boot) or else ``flowpacer/kernel/kmod/sch_psp.ko``; a missing file or one built
for another kernel fails the test that needs it, with the command that builds it.

    ensure_loaded()
    with PspNl(ns) as nl:                                  # a socket in namespace ns
        nl.add_qdisc(dev, link_rate_bps=mbit(10))
        nl.add_class(dev, 0x10, rate_bps=mbit(2), ceil_bps=mbit(4))
        nl.classes(dev)[0x10].rate                          # dumped back
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import struct
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from flowpacer.kernel.tc import nl
from flowpacer.kernel.tc import psp as enc
from harness.testbed import in_netns

REPO = Path(__file__).resolve().parents[1]

MODULE = "sch_psp"
MAJOR = 0xF1F0
QDISC = MAJOR << 16
RMEM_MAX = Path("/proc/sys/net/core/rmem_max")
STOCK_RMEM_MAX = 212992          # Debian's (and the kernel's) default
BIG_RMEM_MAX = 4 << 20           # the project's host machines


@contextlib.contextmanager
def rmem_max(value: int):
    """net.core.rmem_max at ``value`` inside the block, the old value back after it.

    The daemon's netlink socket (flowpacer/kernel/tc/nl.py) asks for a 4 MiB receive buffer; with
    SO_RCVBUFFORCE it gets it whatever rmem_max says, so the stock value must work too
    (``test_daemon_starts_with_stock_rmem_max``); the daemon tests run with the host's value."""
    old = RMEM_MAX.read_text().strip()
    RMEM_MAX.write_text(f"{value}\n")
    try:
        yield
    finally:
        RMEM_MAX.write_text(old + "\n")


KO_ENV = "FLOWPACER_PSP_KO"
BUILD_HINT = "make -C flowpacer/kernel/kmod KVER=$(uname -r) (tests/test_vm.py does it before the boot)"

NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE = nl.NLM_F_CREATE, nl.NLM_F_EXCL, nl.NLM_F_REPLACE
RTM_NEWQDISC, RTM_DELQDISC, RTM_GETQDISC = nl.RTM_NEWQDISC, nl.RTM_DELQDISC, nl.RTM_GETQDISC
RTM_NEWTCLASS, RTM_DELTCLASS, RTM_GETTCLASS = nl.RTM_NEWTCLASS, nl.RTM_DELTCLASS, nl.RTM_GETTCLASS
TC_H_ROOT = nl.TC_H_ROOT


class PspError(Exception):
    """The module cannot be used: not built, built for another kernel, does not load."""
    __test__ = False


def h(minor: int, major: int = MAJOR) -> int:
    return ((major & 0xFFFF) << 16) | (minor & 0xFFFF)


# ------------------------------------------------------------------------ module

def module_path() -> Path:
    return Path(os.environ.get(KO_ENV) or REPO / "flowpacer" / "kernel" / "kmod" / "sch_psp.ko")


def loaded() -> bool:
    return os.path.isdir(f"/sys/module/{MODULE}")


def _run(argv: List[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def load() -> None:
    """insmod the module file (it must have been built for the running kernel)."""
    ko = module_path()
    if not ko.is_file():
        raise PspError(f"{ko} does not exist: build it with {BUILD_HINT}")
    magic = _run(["modinfo", "-F", "vermagic", str(ko)]).stdout.split()
    rel = os.uname().release
    if not magic or magic[0] != rel:
        raise PspError(f"{ko} is built for {magic[0] if magic else '?'}, this kernel is {rel}: "
                       f"rebuild it with {BUILD_HINT}")
    p = _run(["insmod", str(ko)])
    if p.returncode != 0 or not loaded():
        raise PspError(f"insmod {ko}: exit {p.returncode}: {p.stderr.strip()}")


def ensure_loaded() -> None:
    if not loaded():
        load()


def unload(timeout: float = 15.0) -> None:
    """rmmod, retried while the module is still referenced by qdiscs being freed (RCU)."""
    deadline = time.monotonic() + timeout
    last = ""
    while loaded():
        p = _run(["rmmod", MODULE])
        if p.returncode == 0 and not loaded():
            return
        last = p.stderr.strip()
        if time.monotonic() > deadline:
            raise PspError(f"rmmod {MODULE} failed for {timeout:.0f} s: {last}")
        time.sleep(0.1)


def refcnt() -> int:
    try:
        return int(Path(f"/sys/module/{MODULE}/refcnt").read_text())
    except (OSError, ValueError):
        return -1


def record(text: str) -> None:
    """Print figures and append them to ``$FLOWPACER_VM_OUT/pacing-figures.txt`` (the host
    bridge prints that file after the run)."""
    print(text)
    out = os.environ.get("FLOWPACER_VM_OUT")
    if out:
        with open(Path(out) / "pacing-figures.txt", "a") as f:
            f.write(text.rstrip("\n") + "\n")


# ------------------------------------------------------------------------ netlink

@dataclasses.dataclass
class QdiscInfo:
    kind: str
    handle: int
    link_rate: Optional[int]
    defcls: Optional[int]
    overhead: Optional[int]
    limit: Optional[int]
    xstats: Optional[dict]
    stats: dict
    raw_options: dict
    catchup_ns: Optional[int] = None


@dataclasses.dataclass
class ClassInfo:
    classid: int
    parent: int
    rate: Optional[int]
    ceil: Optional[int]
    limit: Optional[int]
    xstats: Optional[dict]
    stats: dict            # bytes, packets, drops, overlimits, backlog_bytes, qlen, rate_est_bps
    raw_options: dict


def _xstats(obj: nl.TcObject) -> Optional[bytes]:
    raw = obj.attrs.get(nl.TCA_STATS2)
    if raw:
        app = nl.parse_attrs(raw).get(nl.TCA_STATS_APP)
        if app:
            return app
    return obj.attrs.get(nl.TCA_XSTATS)


def _u(opts: dict, attr: int, fmt: str) -> Optional[int]:
    raw = opts.get(attr)
    if raw is None or len(raw) != struct.calcsize(fmt):
        return None
    return struct.unpack("=" + fmt, raw)[0]


class PspNl:
    """An rtnetlink socket opened inside network namespace ``ns`` (None: the caller's)."""

    def __init__(self, ns: Optional[str] = None):
        self.ns = ns
        if ns:
            with in_netns(ns):
                self.sock = nl.RtnlSocket()
                self._ifx: Dict[str, int] = {}
        else:
            self.sock = nl.RtnlSocket()
            self._ifx = {}

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "PspNl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ifindex(self, dev: str) -> int:
        if dev not in self._ifx:
            if self.ns:
                with in_netns(self.ns):
                    import socket
                    self._ifx[dev] = socket.if_nametoindex(dev)
            else:
                import socket
                self._ifx[dev] = socket.if_nametoindex(dev)
        return self._ifx[dev]

    # -- raw -------------------------------------------------------------------
    def send(self, mtype: int, flags: int, body: bytes) -> Tuple[int, Optional[str]]:
        """One request; (0, None) when accepted, else (errno, extack text or None)."""
        err = self.sock.transact([nl.Request(mtype, flags, body, "request")])[0]
        return (0, None) if err is None else (err.errno, err.extack)

    def must(self, mtype: int, flags: int, body: bytes, what: str) -> None:
        err = self.sock.transact([nl.Request(mtype, flags, body, what)])[0]
        if err is not None:
            raise err

    # -- qdisc -----------------------------------------------------------------
    @staticmethod
    def qdisc_opts(link_rate_bps: Optional[int] = None, defcls: Optional[int] = None,
                   overhead: Optional[int] = None, limit: Optional[int] = None,
                   catchup_ns: Optional[int] = None) -> bytes:
        opts = []
        if link_rate_bps is not None:
            opts.append(nl.nla_u64(enc.TCA_PSP_LINK_RATE, link_rate_bps))
        if defcls is not None:
            opts.append(nl.nla_u32(enc.TCA_PSP_DEFCLS, defcls))
        if overhead is not None:
            opts.append(nl.nla_u32(enc.TCA_PSP_OVERHEAD, overhead))
        if limit is not None:
            opts.append(nl.nla_u32(enc.TCA_PSP_LIMIT, limit))
        if catchup_ns is not None:
            opts.append(nl.nla_u64(enc.TCA_PSP_CATCHUP, catchup_ns))
        return nl.nla_str(nl.TCA_KIND, "psp") + nl.nla_nested(nl.TCA_OPTIONS, *opts)

    @staticmethod
    def class_opts(rate_bps: Optional[int] = None, ceil_bps: Optional[int] = None,
                   limit: Optional[int] = None) -> bytes:
        opts = []
        if rate_bps is not None:
            opts.append(nl.nla_u64(enc.TCA_PSP_CLASS_RATE, rate_bps))
        if ceil_bps is not None:
            opts.append(nl.nla_u64(enc.TCA_PSP_CLASS_CEIL, ceil_bps))
        if limit is not None:
            opts.append(nl.nla_u32(enc.TCA_PSP_CLASS_LIMIT, limit))
        return nl.nla_str(nl.TCA_KIND, "psp") + nl.nla_nested(nl.TCA_OPTIONS, *opts)

    def qdisc_req(self, dev: str, flags: int, options: bytes, handle: int = QDISC,
                  parent: int = TC_H_ROOT) -> Tuple[int, Optional[str]]:
        return self.send(RTM_NEWQDISC, flags, nl.tcmsg(self.ifindex(dev), handle, parent) + options)

    def add_qdisc(self, dev: str, **kw) -> None:
        """Create (or replace) the root psp qdisc f1f0:; raises NetlinkError when refused."""
        self.must(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE,
                  nl.tcmsg(self.ifindex(dev), QDISC, TC_H_ROOT) + self.qdisc_opts(**kw),
                  f"add psp qdisc on {dev}")

    def change_qdisc(self, dev: str, **kw) -> None:
        self.must(RTM_NEWQDISC, 0, nl.tcmsg(self.ifindex(dev), QDISC, TC_H_ROOT)
                  + self.qdisc_opts(**kw), f"change psp qdisc on {dev}")

    def del_root(self, dev: str) -> Tuple[int, Optional[str]]:
        return self.send(RTM_DELQDISC, 0, nl.tcmsg(self.ifindex(dev), 0, TC_H_ROOT))

    def class_req(self, dev: str, mtype: int, flags: int, minor_or_handle: int, options: bytes,
                  parent: int = QDISC) -> Tuple[int, Optional[str]]:
        handle = minor_or_handle if minor_or_handle > 0xFFFF else h(minor_or_handle)
        return self.send(mtype, flags, nl.tcmsg(self.ifindex(dev), handle, parent) + options)

    def add_class(self, dev: str, minor: int, rate_bps: int, ceil_bps: Optional[int] = None,
                  limit: Optional[int] = None, parent: int = 0) -> None:
        """``parent``: the minor of its group (0: the qdisc)."""
        self.must(RTM_NEWTCLASS, NLM_F_CREATE | NLM_F_EXCL,
                  nl.tcmsg(self.ifindex(dev), h(minor), h(parent) if parent else QDISC)
                  + self.class_opts(rate_bps, ceil_bps, limit), f"add class {minor:x} on {dev}")

    def add_group(self, dev: str, minor: int, rate_bps: int, parent: int = 0) -> None:
        """A psp group (aggregate cap ``rate_bps``) under group ``parent`` (0: the qdisc)."""
        self.must(RTM_NEWTCLASS, NLM_F_CREATE | NLM_F_EXCL,
                  nl.tcmsg(self.ifindex(dev), h(minor), h(parent) if parent else QDISC)
                  + enc.group_options(rate_bps), f"add group {minor:x} on {dev}")

    def change_class(self, dev: str, minor: int, rate_bps: Optional[int] = None,
                     ceil_bps: Optional[int] = None, limit: Optional[int] = None) -> None:
        self.must(RTM_NEWTCLASS, 0, nl.tcmsg(self.ifindex(dev), h(minor), QDISC)
                  + self.class_opts(rate_bps, ceil_bps, limit), f"change class {minor:x} on {dev}")

    def del_class(self, dev: str, minor: int) -> Tuple[int, Optional[str]]:
        return self.send(RTM_DELTCLASS, 0, nl.tcmsg(self.ifindex(dev), h(minor), QDISC))

    # -- dumps -----------------------------------------------------------------
    def qdiscs(self, dev: str) -> List[QdiscInfo]:
        idx = self.ifindex(dev)
        out = []
        for mtype, body in self.sock.dump(RTM_GETQDISC, nl.tcmsg(idx)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex != idx:
                continue
            o = obj.options
            xs = _xstats(obj)
            out.append(QdiscInfo(
                kind=obj.kind, handle=obj.handle,
                link_rate=_u(o, enc.TCA_PSP_LINK_RATE, "Q"), defcls=_u(o, enc.TCA_PSP_DEFCLS, "I"),
                overhead=_u(o, enc.TCA_PSP_OVERHEAD, "I"), limit=_u(o, enc.TCA_PSP_LIMIT, "I"),
                catchup_ns=_u(o, enc.TCA_PSP_CATCHUP, "Q"),
                xstats=enc.parse_qdisc_xstats(xs) if obj.kind == "psp" and xs else None,
                stats=nl.parse_stats2(obj), raw_options=o))
        return out

    def root(self, dev: str) -> Optional[QdiscInfo]:
        for q in self.qdiscs(dev):
            if q.handle == QDISC and q.kind == "psp":
                return q
        return None

    def classes(self, dev: str) -> Dict[int, ClassInfo]:
        """{minor: ClassInfo} of the psp classes on ``dev``."""
        idx = self.ifindex(dev)
        out = {}
        for mtype, body in self.sock.dump(RTM_GETTCLASS, nl.tcmsg(idx)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex != idx or obj.kind != "psp":
                continue
            o = obj.options
            xs = _xstats(obj)
            out[obj.handle & 0xFFFF] = ClassInfo(
                classid=obj.handle, parent=obj.parent,
                rate=_u(o, enc.TCA_PSP_CLASS_RATE, "Q"), ceil=_u(o, enc.TCA_PSP_CLASS_CEIL, "Q"),
                limit=_u(o, enc.TCA_PSP_CLASS_LIMIT, "I"),
                xstats=enc.parse_class_xstats(xs) if xs else None,
                stats=nl.parse_stats2(obj), raw_options=o)
        return out


def expect_refused(nlsock: PspNl, mtype: int, flags: int, body: bytes, code: int,
                   text: str) -> str:
    """Send a request that must be refused with errno ``code`` and an extack containing
    ``text``; return the extack."""
    err, ext = nlsock.send(mtype, flags, body)
    assert err != 0, f"accepted; expected {errno.errorcode.get(code, code)} ({text!r})"
    assert err == code, (f"errno {errno.errorcode.get(err, err)} ({ext!r}), expected "
                         f"{errno.errorcode.get(code, code)} ({text!r})")
    assert ext is not None and text in ext, f"extack {ext!r} does not say {text!r}"
    return ext
