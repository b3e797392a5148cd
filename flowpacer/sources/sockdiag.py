"""Flow source over netlink sock_diag: the established TCP sockets of this network namespace,
and its connected UDP sockets (issue 17; sock_diag lists a connected UDP socket as ESTABLISHED,
an unconnected one as CLOSE: those give only their local ports, ``Snapshot.udp_ports``, so that
the flows the tracer found for their peers stay while their socket is open).

Used at start-up (flows that existed before the daemon) and periodically as the reconcile pass
that heals anything the tracer missed. Each flow carries what its socket's route depends on
besides its tuple (issue 29): its mark and the device it is bound to (``Flow.mark``,
``Flow.bound_if``). Each socket is attributed to the process holding it by
its inode (``/proc/PID/fd`` -> ``socket:[INODE]``); the /proc walk runs only when a socket
appears whose inode is not known yet, so a quiet scan costs one netlink dump.

The dump is read with the project's own small netlink reader (``tc/nl.py``) and a struct
parser: pyroute2's DiagSocket decodes each socket into a dict of dicts (~40 us and several KB
of garbage per socket), which at 10 000 flows and one scan a second would keep a core 40 %
busy. Flows whose socket did not change are reused from the previous scan.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
import struct
from typing import Dict, Iterable, List, Optional, Set, Tuple

from flowpacer.kernel.tc.nl import RtnlSocket

from flowpacer.model import Direction, Flow, FlowKey, FlowSource, ProcessInfo, Protocol

log = logging.getLogger(__name__)

TCP_ESTABLISHED = 1
# states in which the socket may still send data (after close() too: FIN_WAIT1 until the peer
# has acked what was queued): a flow leaves the snapshot only when it has nothing left to send,
# as the tracer's CLOSE (at FIN_WAIT2) -- otherwise a reconcile pass deletes the class of a flow
# whose application closed while its reply was still being paced out, and its tail goes unshaped
# (CLOSE_WAIT, the peer's half closed and ours not, stays out as before: such a flow is over
# for the reconcile pass until the application closes or writes)
SENDING_STATES = (1, 4, 9, 11)   # ESTABLISHED, FIN_WAIT1, LAST_ACK, CLOSING
TCP_LISTEN = 10
TCP_CLOSE = 7          # an unconnected UDP socket
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
# struct inet_diag_req_v2: family, protocol, ext, pad, states, struct inet_diag_sockid (48 bytes)
REQ = struct.Struct("=BBBxI48x")
# struct inet_diag_msg: family, state, timer, retrans, sockid{be16 sport, be16 dport,
# be32 src[4], be32 dst[4], if, cookie[2]}, expires, rqueue, wqueue, uid, inode
MSG = struct.Struct("=BBBB")
PORTS = struct.Struct(">HH")
TAIL = struct.Struct("=IIIII")
SRC_OFF, DST_OFF, IF_OFF, COOKIE_OFF, TAIL_OFF = 8, 24, 40, 44, 52
COOKIE = struct.Struct("=Q")      # cookie[2]: low then high 32 bits (sock_gen_cookie, as BPF's)
MSG_SIZE = 72                     # struct inet_diag_msg; its attributes (rtattr) follow
RTA = struct.Struct("=HH")
U32 = struct.Struct("=I")
INET_DIAG_MARK = 15               # the socket's mark, sent to a requester with CAP_NET_ADMIN


def mark_of(body: bytes) -> int:
    """The INET_DIAG_MARK attribute of one inet_diag_msg (0 when it has none: the requester
    lacks CAP_NET_ADMIN in the socket's namespace). The kernel puts it among the first few."""
    at, end = MSG_SIZE, len(body)
    while at + 4 <= end:
        n, kind = RTA.unpack_from(body, at)
        if n < 4:
            break
        if kind == INET_DIAG_MARK and n >= 8:
            return U32.unpack_from(body, at + 4)[0]
        at += (n + 3) & ~3
    return 0


def read_process(pid: int) -> Optional[ProcessInfo]:
    """comm, exe and uid of a process from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            comm = f.read().rstrip(b"\n").decode(errors="replace")
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    return ProcessInfo(pid=pid, comm=comm, exe=exe, uid=uid)


def socket_owners(wanted: Set[int]) -> Dict[int, int]:
    """inode -> pid for the wanted socket inodes (the first process found holding each)."""
    found: Dict[int, int] = {}
    if not wanted:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        fddir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fddir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fddir}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                ino = int(target[8:-1])
                if ino in wanted and ino not in found:
                    found[ino] = pid
                    if len(found) == len(wanted):
                        return found
    return found


class Snapshot(dict):
    """FlowKey -> Flow, the local ports of this namespace's unconnected UDP sockets, and the
    socket cookie of each connected UDP socket's flow (the tracer follows its sends by it).

    A scan's snapshot also says what changed since the scan before it (``delta_from``: that
    one's ``token``): the keys whose flow is new or differs (``changed``) and the keys of the
    sockets no longer listed as they were (``gone``: one whose facts changed is listed again),
    so that the flow table need not look at every flow (issue 26). Every other flow of it is the
    very object the scan before it gave for that key. One without ``delta_from`` (None) is
    looked at whole."""
    udp_ports: frozenset = frozenset()
    udp_cookies: Dict[FlowKey, int] = {}
    token: Optional[object] = None
    delta_from: Optional[object] = None
    changed: List[FlowKey] = []
    gone: List[FlowKey] = []


class SockDiagSource:
    def __init__(self) -> None:
        self._owners: Dict[int, ProcessInfo] = {}     # socket inode -> owner
        self._prev: Dict[bytes, Flow] = {}               # raw socket identity -> flow
        self._token: Optional[object] = None             # the last snapshot's token
        self.scans = 0
        self.proc_walks = 0

    def _dump(self, state_mask: int, proto: int = socket.IPPROTO_TCP) -> Iterable[bytes]:
        with RtnlSocket(NETLINK_SOCK_DIAG) as nls:
            for fam in (socket.AF_INET, socket.AF_INET6):
                req = REQ.pack(fam, proto, 0, state_mask)
                for _mtype, body in nls.dump(SOCK_DIAG_BY_FAMILY, req):
                    yield body

    def snapshot(self) -> Snapshot:
        """Every established TCP flow and connected UDP socket of this namespace, attributed
        where the owner is found."""
        self.scans += 1
        now = time.monotonic_ns()
        listeners: Set[Tuple[object, int]] = set()
        wildcard_ports: Set[int] = set()
        tcp: List[bytes] = []
        mask = (1 << TCP_LISTEN)
        for st in SENDING_STATES:
            mask |= 1 << st
        for body in self._dump(mask):
            family, state = body[0], body[1]
            if state == TCP_LISTEN:
                port = PORTS.unpack_from(body, 4)[0]
                addr = FlowKey.wire_address(_addr(family, body, SRC_OFF))
                if addr.is_unspecified:
                    wildcard_ports.add(port)
                listeners.add((addr, port))
            elif state in SENDING_STATES:
                tcp.append(body)
        udp_ports = set()
        udp: List[bytes] = []
        for body in self._dump((1 << TCP_ESTABLISHED) | (1 << TCP_CLOSE), socket.IPPROTO_UDP):
            if body[1] == TCP_ESTABLISHED:
                udp.append(body)     # a connected UDP socket
            else:
                udp_ports.add(PORTS.unpack_from(body, 4)[0])
        tail = TAIL.unpack_from
        inodes = {tail(b, TAIL_OFF)[4] for b in tcp}
        inodes.update(tail(b, TAIL_OFF)[4] for b in udp)
        inodes.discard(0)
        owners = self._owners
        unknown = inodes - owners.keys()
        found = 0
        if unknown:
            self.proc_walks += 1
            # a process' facts are read once a scan, however many new sockets it holds (a burst
            # of 10 000 accepted connections is one server's: 3 reads of /proc a process, not
            # 30 000), and its sockets share the one ProcessInfo
            procs: Dict[int, Optional[ProcessInfo]] = {}
            for ino, pid in socket_owners(unknown).items():
                if pid in procs:
                    info = procs[pid]
                else:
                    info = procs[pid] = read_process(pid)
                if info is not None:
                    owners[ino] = info
                    found += 1
        for ino in [i for i in owners if i not in inodes]:
            del owners[ino]
        flows = Snapshot()
        flows.udp_ports = frozenset(udp_ports)
        cookies: Dict[FlowKey, int] = {}
        flows.udp_cookies = cookies
        prev = self._prev
        cur: Dict[bytes, Flow] = {}
        changed = []
        for is_udp, bodies in ((False, tcp), (True, udp)):
            tag = b"U" if is_udp else b"T"
            for b in bodies:
                # the socket as the kernel lists it, less what changes while it is idle (timer,
                # retransmits, expiry and queues): the sockid (ports, addresses, bound device,
                # cookie), the uid, inode and attributes (its mark, read only for a socket not
                # met before or changed)
                ident = tag + b[4:TAIL_OFF] + b[TAIL_OFF + 12:]
                f = prev.get(ident)
                if f is None or found:      # new, or its owner may be found now
                    owner = owners.get(tail(b, TAIL_OFF)[4])
                    if f is None or (owner is not None and f.proc is not owner):
                        f = self._flow(b, is_udp, owner, listeners, wildcard_ports, now)
                        changed.append(f.key)
                    elif f.key in flows:    # two sockets of one tuple: the table looks at it
                        changed.append(f.key)
                elif f.key in flows:
                    changed.append(f.key)
                cur[ident] = f
                flows[f.key] = f
                if is_udp:
                    cookies[f.key] = COOKIE.unpack_from(b, COOKIE_OFF)[0]
        flows.changed = changed
        flows.gone = [prev[i].key for i in prev.keys() - cur.keys()]
        flows.delta_from, flows.token = self._token, object()
        self._token = flows.token
        self._prev = cur
        return flows


    @staticmethod
    def _flow(b: bytes, udp: bool, owner: Optional[ProcessInfo], listeners, wildcard_ports,
              now: int) -> Flow:
        """The flow of one listed socket (``b``: its inet_diag_msg and attributes)."""
        family = b[0]
        sport, dport = PORTS.unpack_from(b, 4)
        key = FlowKey.wire(_addr(family, b, SRC_OFF), sport, _addr(family, b, DST_OFF), dport,
                           Protocol.UDP if udp else Protocol.TCP)
        inbound = not udp and ((key.local_addr, sport) in listeners or sport in wildcard_ports)
        proc = owner or ProcessInfo(pid=0, uid=TAIL.unpack_from(b, TAIL_OFF)[3])
        return Flow(key, Direction.INBOUND if inbound else Direction.OUTBOUND, proc,
                    FlowSource.RECONCILE, 0, now, mark=mark_of(b),
                    bound_if=U32.unpack_from(b, IF_OFF)[0])


def _addr(family: int, body: bytes, off: int):
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(body[off:off + 4])
    return ipaddress.IPv6Address(body[off:off + 16])
