"""Flow source over netlink sock_diag: the established TCP sockets of this network namespace.

Used at start-up (flows that existed before the daemon) and periodically as the reconcile pass
that heals anything the tracer missed. Each socket is attributed to the process holding it by
its inode (``/proc/PID/fd`` -> ``socket:[INODE]``); the /proc walk runs only when a socket
appears whose inode is not known yet, so a quiet scan costs one netlink dump.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from typing import Dict, Iterable, Optional, Set, Tuple

from pyroute2 import DiagSocket

from .model import Direction, Flow, FlowKey, FlowSource, ProcessInfo

log = logging.getLogger(__name__)

TCP_ESTABLISHED = 1
TCP_LISTEN = 10


def normalize(addr) -> ipaddress._BaseAddress:
    """An address as it is on the wire: IPv4-mapped IPv6 addresses become IPv4."""
    a = ipaddress.ip_address(addr)
    if a.version == 6 and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


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


class SockDiagSource:
    def __init__(self) -> None:
        self._owners: Dict[int, ProcessInfo] = {}     # socket inode -> owner
        self.scans = 0
        self.proc_walks = 0

    def _dump(self, state_mask: int) -> Iterable[dict]:
        with DiagSocket() as ds:
            ds.bind()
            for fam in (socket.AF_INET, socket.AF_INET6):
                for msg in ds.get_sock_stats(family=fam, states=state_mask):
                    yield msg

    def snapshot(self) -> Dict[FlowKey, Flow]:
        """Every established TCP flow of this namespace, attributed where the owner is found."""
        self.scans += 1
        now = time.monotonic_ns()
        listeners: Set[Tuple[str, int]] = set()
        established = []
        for msg in self._dump((1 << TCP_ESTABLISHED) | (1 << TCP_LISTEN)):
            if msg["idiag_state"] == TCP_LISTEN:
                listeners.add((str(normalize(msg["idiag_src"])), msg["idiag_sport"]))
            else:
                established.append(msg)
        inodes = {m["idiag_inode"] for m in established if m["idiag_inode"]}
        unknown = inodes - self._owners.keys()
        if unknown:
            self.proc_walks += 1
            for ino, pid in socket_owners(unknown).items():
                info = read_process(pid)
                if info is not None:
                    self._owners[ino] = info
        for ino in list(self._owners):
            if ino not in inodes:
                del self._owners[ino]
        wildcard_ports = {p for a, p in listeners if a in ("0.0.0.0", "::")}
        flows: Dict[FlowKey, Flow] = {}
        for m in established:
            la, ra = normalize(m["idiag_src"]), normalize(m["idiag_dst"])
            if la.version != ra.version:
                continue
            key = FlowKey(la, m["idiag_sport"], ra, m["idiag_dport"])
            inbound = (str(la), key.local_port) in listeners or key.local_port in wildcard_ports
            proc = self._owners.get(m["idiag_inode"]) or ProcessInfo(pid=0, uid=m["idiag_uid"])
            flows[key] = Flow(key, Direction.INBOUND if inbound else Direction.OUTBOUND, proc,
                              FlowSource.RECONCILE, 0, now)
        return flows
