"""What the kernel holds and what went over the wire, read from the test's own namespaces.

- ``kernel_objects(tb)``: (flow classes, flow filters) under flowpacer's qdisc, via ``tc``;
  ``daemon_objects(tb, d)`` the same with the spare classes daemon ``d`` records not counted
  (htb keeps closed flows' classes as spares, issue 26); after a stop nothing may be left;
- ``NlProbe(tb)``: the same and the live target flows over netlink sockets made in the server
  namespace (no ``tc``/``ss`` processes: under TCG those cost more than the daemon measured);
- ``qdisc_kind``, ``established``: the root qdisc's kind, the established TCP connections.

Packet captures with kernel timestamps (AF_PACKET, GSO segments counted) are in
``harness/pacing.py`` (``Capture``), which runs in the VM.
"""
from __future__ import annotations

import socket
from typing import Container, FrozenSet, List, Set, Tuple

from harness.testbed import in_netns

BASE_CLASSES = ("f1f0:1", "f1f0:2")   # flowpacer's link class and default class


def tc_show(tb, what: str, stats: bool = False, dev: str = "") -> str:
    """``tc [-s] {qdisc|class|filter} show dev <server_if>`` in the server namespace (``dev``:
    another device there, e.g. flowpacer's receive-side ifb)."""
    return tb.run(tb.server_ns, ["tc", *(["-s"] if stats else []), what, "show", "dev",
                                 dev or tb.server_if]).stdout


POOL_FIRST_MINOR = 0xC000   # first-byte pool classes (flowpacer/kernel/backend/pool.py)


class _AnySpare:
    """``spares=ANY_SPARE``: every flow-range class without a filter may be a spare."""

    def __contains__(self, handle) -> bool:
        return True


# For a check judged from the kernel alone, while no daemon can be asked which classes are its
# spares (a daemon starting: its control socket opens after adoption and the first pass). A
# check with it must be followed by one with the daemon's own list.
ANY_SPARE = _AnySpare()


def daemon_spares(d, interface: str = "") -> FrozenSet[str]:
    """The spare classes (issue 26: a closed flow's class kept without a filter for the next new
    flow, htb) that the running daemon ``d`` records on ``interface`` (default: its first
    interface), by name ("f1f0:1a"), from its status."""
    st = d.call({"cmd": "status", "spares": True})
    if "interfaces" not in st:
        raise AssertionError(f"status without interfaces: {st}")
    for i in st["interfaces"]:
        if not interface or i["name"] == interface:
            ids = i.get("spare_classids")
            if ids is None or len(ids) != i.get("spare_classes"):
                raise AssertionError(f"status: spare classes not listed: {i}")
            return frozenset(ids)
    return frozenset()


def kernel_objects(tb, dev: str = "", spares: Container[str] = ()) -> Tuple[int, int]:
    """(flow classes, flow filters) of flowpacer's qdisc on the server interface (``dev``: on
    another device, e.g. the receive side's ifb). A ready class of a first-byte pool (its id in
    the pool range, no filter pointing at it) is no flow's; nor is a spare class: one named in
    ``spares`` (``daemon_spares(d)``, what the daemon records) with no filter pointing at it.
    Any other class without a filter counts: left behind. ``spares`` is a daemon's record,
    read before the kernel is: a flow that closes in between shows as one more class."""
    cls = tc_show(tb, "class", dev=dev).splitlines()
    flt = tc_show(tb, "filter", dev=dev).splitlines()
    targets = {ln.split("flowid", 1)[1].split()[0] for ln in flt if "flowid" in ln}

    def flow_class(handle: str) -> bool:
        if handle in BASE_CLASSES:
            return False
        if handle in targets:
            return True
        minor = int(handle.split(":")[1] or "0", 16)
        return minor < POOL_FIRST_MINOR and handle not in spares
    flow_classes = [c for c in cls if c.startswith("class ") and flow_class(c.split()[2])]
    return len(flow_classes), sum("flowid" in line for line in flt)


def daemon_objects(tb, d, dev: str = "") -> Tuple[int, int]:
    """``kernel_objects`` with the spare classes daemon ``d`` records there not counted."""
    return kernel_objects(tb, dev, daemon_spares(d, dev or tb.server_if))


def qdisc_kind(tb) -> str:
    """The kind of the server interface's root qdisc (``noqueue`` when there is none)."""
    out = tc_show(tb, "qdisc")
    return out.split()[1] if out.strip() else ""


def established(tb, ns: str = "", filt: str = "") -> List[Tuple[str, str]]:
    """(local, peer) of the established TCP connections in ``ns`` (default: the server's),
    with an optional ``ss`` filter expression."""
    out = tb.run(ns or tb.server_ns, ["ss", "-Htn", "state", "established", *([filt] if filt else [])]).stdout
    return [(ln.split()[-2], ln.split()[-1]) for ln in out.splitlines() if ln.strip()]


def live_target_flows(tb, ports=(7000, 7100)) -> Set[str]:
    """Remote ports of the established connections to the server's ``ports``, as the kernel
    lists them."""
    expr = "( " + " or ".join(f"sport = :{p}" for p in ports) + " )"
    return {peer.rsplit(":", 1)[1] for _local, peer in established(tb, filt=expr)}


class NlProbe:
    """``kernel_objects`` and ``live_target_flows`` read in-process over netlink sockets made in
    the server namespace: no ``tc``/``ss`` processes. The same answers as the two functions."""

    def __init__(self, tb, ports=(7000, 7100)):
        from flowpacer.sources.sockdiag import NETLINK_SOCK_DIAG
        from flowpacer.kernel.tc.nl import RtnlSocket
        self.ports = tuple(ports)
        with in_netns(tb.server_ns):
            self.ifindex = socket.if_nametoindex(tb.server_if)
            self.rt = RtnlSocket()
            self.diag = RtnlSocket(NETLINK_SOCK_DIAG)

    def objects(self, spares: Container[str] = ()) -> Tuple[int, int]:
        """As ``kernel_objects`` (``spares``: the same)."""
        from flowpacer.kernel.backend.tc import MAJOR, QDISC_HANDLE
        from flowpacer.errors import NetlinkError
        from flowpacer.kernel.tc import nl, u32
        minors, targets, nflt = [], set(), 0
        try:
            for mtype, body in self.rt.dump(nl.RTM_GETTCLASS, nl.tcmsg(self.ifindex)):
                o = nl.parse_tcmsg(mtype, body)
                if o.ifindex == self.ifindex and o.handle >> 16 == MAJOR and o.handle & 0xFFFF > 2:
                    minors.append(o.handle & 0xFFFF)
            for mtype, body in self.rt.dump(nl.RTM_GETTFILTER,
                                            nl.tcmsg(self.ifindex, 0, QDISC_HANDLE)):
                o = nl.parse_tcmsg(mtype, body)
                if o.kind == "u32" and u32.TCA_U32_CLASSID in o.options:
                    targets.add(int.from_bytes(o.options[u32.TCA_U32_CLASSID][:4], "little") & 0xFFFF)
                    nflt += 1
        except NetlinkError:        # no qdisc of ours: nothing under it
            pass
        # a first-byte pool class (pool range, no filter) is no flow's class, nor a spare
        ncls = sum(1 for m in minors if m in targets
                   or (m < POOL_FIRST_MINOR and f"{MAJOR:x}:{m:x}" not in spares))
        return ncls, nflt

    def live(self) -> Set[str]:
        from flowpacer.sources.sockdiag import PORTS, REQ, SOCK_DIAG_BY_FAMILY, TCP_ESTABLISHED
        out = set()
        for fam in (socket.AF_INET, socket.AF_INET6):
            for _t, body in self.diag.dump(SOCK_DIAG_BY_FAMILY,
                                           REQ.pack(fam, socket.IPPROTO_TCP, 0,
                                                    1 << TCP_ESTABLISHED)):
                sport, dport = PORTS.unpack_from(body, 4)
                if body[1] == TCP_ESTABLISHED and sport in self.ports:
                    out.add(str(dport))
        return out

    def close(self) -> None:
        self.rt.close()
        self.diag.close()

    def __enter__(self) -> "NlProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
