"""First-byte shaping (issue 16): a target flow's class is decided in the kernel at the end of
its handshake, before its first data packet, instead of after a round trip through user space.

The cgroup ``sock_ops`` program is ``flowpacer/sources/bpf/firstbyte.c`` (its header comment explains
the callbacks, the rule masks and the pool protocol). This module owns it:

* ``compile_rules(ruleset)`` (pure; ``handshake.py``, the engine's side: from what each ``Match``
  field declares the kernel can decide; not exe patterns, process globs or rules with
  aggregate rates), and the bit masks the program reads;
* ``FirstByte``: compiles and attaches the program (a bpf_link on the cgroup v2 root: it is
  detached when the daemon's fd closes, also on a crash; nothing is pinned), owns its maps and
  the rings of ready classes per kernel-decided rule, and turns the program's records into
  claim events. It holds neither the reconciler nor the backend: each round of the firstbyte
  stage (app.py) is ``poll`` (claims), ``report`` (what the rings need; the drain, the sweep of
  the sockets' priorities), the reconciler's ``on_claims`` (the engine plans the pool ops, the
  backend applies them with the flows' ops in one batch) and ``granted`` (the class ids made,
  written into the rings). Only ``on_claims`` holds the reconciler's lock.

Needs: cgroup v2 mounted, bpf_link for cgroups (5.7), bpf_get_netns_cookie in sock_ops (5.15),
the current-task helpers in cgroup sock_addr programs (the bind/connect hooks that learn a
socket's owner) and bpf_sk_storage (Debian 12's 6.1 and 13's 6.12 have all: docs/firstbyte.md
has the measured table).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from flowpacer.sources import cgroupbpf
from flowpacer import model
from flowpacer.sources.cgroupbpf import (cgroup2_root, link_create)  # noqa: F401  (cgroup2_root: tests use it)
from flowpacer.errors import TracerUnavailable
from flowpacer.policy.handshake import Compiled, compile_rules
from flowpacer.model import FlowKey, RuleSet

log = logging.getLogger(__name__)

BPF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bpf")
BPF_SRC = os.path.join(BPF_DIR, "firstbyte.c")

# firstbyte.h
COMM_LEN = 16
MAX_RULES = 64
POOL_SLOTS = 64
FB_DIR_OUTBOUND, FB_DIR_INBOUND = 1, 2
FB_F_ATTRIBUTED, FB_F_CLOSED = 0x01, 0x02
COUNTERS = ("claimed", "pool_empty", "undecided", "unattributed", "setsockopt_failed", "lost",
            "no_match", "stopgap", "missed", "lifted", "guarded")
PLACED_SLOTS = 16384       # fb_placed's slots (FB_PLACED_SLOTS): a guarded claim's class id's
GUARD_FORGET_S = 120.0     # a guarded claim never placed (its route is unmanaged) is forgotten:
#                            its socket keeps TCP pacing at its rule's rate (until a reload)
# struct fb_event: ts_ns classid rule pid uid family lport rport direction flags
#                  laddr[16] raddr[16] comm[16]
EVENT = struct.Struct("<QIIIIHHHBB16s16s16s")
assert EVENT.size == 80

# the counters status and metrics show: the fields of model.FirstByteCounters
VIEW_COUNTERS = model.FirstByteCounters.NAMES

POOL_TARGET = 48           # ready classes per rule (< POOL_SLOTS): 24 ms of claims at 2 000 flows/s
# FLOWPACER_FIRST_BYTE_POOL=n: n ready classes per rule instead (0: none, every kernel-decided
# flow is paced by the stopgap until its class is in; tests and benchmarks)
POOL_ENV = "FLOWPACER_FIRST_BYTE_POOL"
# FLOWPACER_NO_STOPGAP=1: no stopgap (a flow finding its pool empty leaves unpaced until its
# class is in, as before issue 26: benchmarks' and tests' "before" figures)
NO_STOPGAP_ENV = "FLOWPACER_NO_STOPGAP"
MAX_PACING = 0xFFFFFFFE    # SO_MAX_PACING_RATE is a u32 of bytes/s; ~0U means "no limit"
GRACE_S = 0.005            # a sock_ops run that saw the old rules has finished by then
# the sockets' priorities are swept (a sock_diag dump of every socket: tens of ms at thousands
# of sockets, during which the pools are not refilled) only for ids whose close report has not
# come for SWEEP_S, and at most every SWEEP_S; normally the close report frees an id
SWEEP_S = 10.0

# bpf(2)
_BPF_CGROUP_SOCK_OPS = 3
# cgroup sock_addr programs: (function, attach type); BPF_CGROUP_INET{4,6}_{BIND,CONNECT}
SOCK_ADDR_PROGS = (("fb_bind4", 8), ("fb_bind6", 9), ("fb_connect4", 10), ("fb_connect6", 11))
SO_NETNS_COOKIE = 71


class FirstByteUnavailable(TracerUnavailable):
    """The kernel or the host cannot run first-byte shaping (one line why)."""


def _last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


# ---------------------------------------------------------------- helpers

def open_cgroup2_root() -> Tuple[int, str]:
    return cgroupbpf.open_cgroup2_root(FirstByteUnavailable)


def netns_cookie() -> int:
    return cgroupbpf.netns_cookie(FirstByteUnavailable)


def listeners() -> Dict[int, model.ProcessInfo]:
    """local port -> owner of the TCP listening sockets of this namespace (for listeners older
    than the program, whose listen() it did not see)."""
    from flowpacer.sources.sockdiag import (NETLINK_SOCK_DIAG, PORTS, REQ, SOCK_DIAG_BY_FAMILY,
                                            TAIL, TAIL_OFF, TCP_LISTEN, read_process,
                                            socket_owners)
    from flowpacer.kernel.tc.nl import RtnlSocket
    by_inode: Dict[int, int] = {}
    with RtnlSocket(NETLINK_SOCK_DIAG) as nls:
        for fam in (socket.AF_INET, socket.AF_INET6):
            req = REQ.pack(fam, socket.IPPROTO_TCP, 0, 1 << TCP_LISTEN)
            for _mtype, body in nls.dump(SOCK_DIAG_BY_FAMILY, req):
                if body[1] == TCP_LISTEN:
                    ino = TAIL.unpack_from(body, TAIL_OFF)[4]
                    if ino:
                        by_inode[ino] = PORTS.unpack_from(body, 4)[0]
    out: Dict[int, model.ProcessInfo] = {}
    for ino, pid in socket_owners(set(by_inode)).items():
        info = read_process(pid)
        if info is not None:
            out[by_inode[ino]] = info
    return out


# sock_diag: a socket's SO_PRIORITY is INET_DIAG_CLASS_ID (when no net_cls classid is set, which
# cgroup v2 never sets), sent when INET_DIAG_TCLASS is asked for
_INET_DIAG_TCLASS, _INET_DIAG_CLASS_ID = 6, 17
_DIAG_MSG_LEN = 72                     # struct inet_diag_msg
# every TCP state whose socket is a full one (not TIME_WAIT 6, not NEW_SYN_RECV 12)
_FULL_STATES = ((1 << 12) - 1) & ~(1 << 6) & ~(1 << 0)
_NLA = struct.Struct("=HH")


def socket_priorities() -> Set[int]:
    """The distinct non-zero SO_PRIORITY values of this namespace's TCP sockets (one sock_diag
    dump per family; IPv4-mapped sockets are in the AF_INET6 one)."""
    from flowpacer.sources.sockdiag import NETLINK_SOCK_DIAG, REQ, SOCK_DIAG_BY_FAMILY
    from flowpacer.kernel.tc.nl import RtnlSocket
    out: Set[int] = set()
    with RtnlSocket(NETLINK_SOCK_DIAG) as nls:
        for fam in (socket.AF_INET, socket.AF_INET6):
            req = REQ.pack(fam, socket.IPPROTO_TCP, 1 << (_INET_DIAG_TCLASS - 1), _FULL_STATES)
            for _mtype, body in nls.dump(SOCK_DIAG_BY_FAMILY, req):
                off = _DIAG_MSG_LEN
                while off + 4 <= len(body):
                    ln, typ = _NLA.unpack_from(body, off)
                    if ln < 4:
                        break
                    if typ & 0x3FFF == _INET_DIAG_CLASS_ID and ln >= 8:
                        prio = struct.unpack_from("=I", body, off + 4)[0]
                        if prio:
                            out.add(prio)
                    off += (ln + 3) & ~3
    return out


def _set_bytes(obj, name: str, raw: bytes) -> None:
    """Copy ``raw`` into the array member ``name`` of a ctypes struct (char arrays included)."""
    ctypes.memmove(ctypes.addressof(obj) + getattr(type(obj), name).offset, raw, len(raw))


@dataclass
class _Pool:
    """One kernel rule's ring of ready classes (the program's side of the pool)."""
    rule: model.Rule
    fill: int = 0                                            # next ticket to write
    slots: Dict[int, int] = field(default_factory=dict)      # ticket -> class id (not yet taken)


# ------------------------------------------------------------------ owner

class FirstByte:
    """The sock_ops program, its maps and the pools of ready classes."""

    def __init__(self, ring_pages: int = 64, pool_target: int = POOL_TARGET):
        if not 0 <= pool_target < POOL_SLOTS:
            raise ValueError(f"pool_target must be 0..{POOL_SLOTS - 1}, not {pool_target!r}")
        self.ring_pages = ring_pages
        self.pool_target = pool_target
        self.netns_cookie = 0
        self._bpf = None
        self._fn = None
        self._link_fds: List[int] = []
        self.owner_hooks = 0
        self._raw: List[bytes] = []
        self._pools: Dict[int, _Pool] = {}
        self._new_listeners = False
        self._closed: List[int] = []                             # class ids of closed sockets
        self._compiled: Optional[Compiled] = None
        self._rules_seen: Optional[tuple] = None
        self._live = False                   # claims on (config.live written)
        self._epoch = -1                     # the backend pool bookkeeping the rings' ids are of
        # what the last grant said: its bookkeeping, the rules to follow, the pool ids held by
        # open sockets and awaiting a close, and how long the oldest has waited
        self._grant_epoch = -1
        self._grant_rules: Optional[RuleSet] = None
        self._ids = (0, 0)
        self._oldest_wait_s = 0.0
        self._counts = {"claims": 0, "bound": 0, "released": 0, "rebound": 0, "bad_records": 0,
                        "stale": 0, "closed": 0, "sweeps": 0, "freed_by_sweep": 0,
                        "refilled": 0, "returned": 0, "placed": 0}
        # guarded claims (several interfaces, issue 29): config.guard as written, when it was
        # last on, and the claims awaiting their placement: key -> (class id, ts_ns, seen at)
        self._guard = False
        self._guard_until = 0.0
        self._guarded: Dict[FlowKey, Tuple[int, int, float]] = {}
        self._rule_claims: Dict[str, int] = {}
        # the stopgap (issue 26): per kernel index, the rules up to it and its generation
        self._stop_gens: Dict[int, Tuple[tuple, int]] = {}
        self._next_gen = 1
        self._swept_at = 0.0
        self._poll_lock = threading.Lock()
        self._lock = threading.RLock()
        self.summary = "not started"
        self.current_helpers = False

    # -------------------------------------------------------------- start-up
    def start(self) -> None:
        with self._lock:
            if self._bpf is not None:
                return
            self.netns_cookie = netns_cookie()
            try:
                import bcc
            except Exception as e:
                raise FirstByteUnavailable(f"bcc is not importable: {e}") from None
            t0 = time.monotonic()
            try:
                b = bcc.BPF(src_file=BPF_SRC.encode(),
                            cflags=[f"-I{BPF_DIR}", f"-DFB_RING_PAGES={self.ring_pages}"])
            except Exception as e:
                raise FirstByteUnavailable(f"first-byte programs not compiled: {_last_line(e)}") \
                    from None
            try:
                fn, self.current_helpers = self._load_sockops(b)
                owners = self._load_owner_progs(b)
            except FirstByteUnavailable:
                b.cleanup()
                raise
            root = "cgroup2"
            links: List[int] = []
            try:
                cg, root = open_cgroup2_root()
                try:
                    links.append(link_create(fn.fd, cg, _BPF_CGROUP_SOCK_OPS))
                    for name, prog, attach in owners:
                        try:
                            links.append(link_create(prog.fd, cg, attach))
                        except OSError as e:
                            log.warning("first byte: %s not attached (%s): flows of rules naming "
                                        "a process or user get their class after the handshake "
                                        "where it would have told the owner", name,
                                        e.strerror or e)
                finally:
                    os.close(cg)
            except FirstByteUnavailable:
                for fd in links:
                    os.close(fd)
                b.cleanup()
                raise
            except OSError as e:
                for fd in links:
                    os.close(fd)
                b.cleanup()
                raise FirstByteUnavailable(f"cannot attach sock_ops to {root}: "
                                           f"{e.strerror or e}") from None
            self._link_fds = links
            self.owner_hooks = len(links) - 1
            self._bpf, self._fn = b, fn
            b[b"fb_events"].open_ring_buffer(self._on_event)
            self._write_config(0)
            n = self._seed_listeners()
            log.info("first-byte sock_ops and %d owner hooks attached to %s (bpf_links), %d "
                     "listeners seeded, compiled in %.2f s (sock_ops %s the current task)",
                     self.owner_hooks, root, n, time.monotonic() - t0,
                     "may ask for" if self.current_helpers else "may not ask for")

    @staticmethod
    def _load_sockops(b):
        """The sock_ops program: the variant that asks for the current task where the kernel
        lets sock_ops do so (6.18), else the one that does not (6.1, 6.12). Both are in the one
        compiled object: the refusal costs a verifier run, not a second compile."""
        import bcc
        try:
            return b.load_func(b"fb_sockops_cur", bcc.BPF.SOCK_OPS), True
        except Exception:
            pass
        try:
            return b.load_func(b"fb_sockops", bcc.BPF.SOCK_OPS), False
        except Exception as e:
            raise FirstByteUnavailable(f"sock_ops program refused: {_last_line(e)}") from None

    @staticmethod
    def _load_owner_progs(b):
        """The bind/connect programs (cgroup sock_addr, which may ask for the current task on
        every kernel measured: 6.1, 6.12, 6.18); (name, fn, attach type) of those loaded."""
        import bcc
        out = []
        for name, attach in SOCK_ADDR_PROGS:
            try:
                out.append((name, b.load_func(name.encode(), bcc.BPF.CGROUP_SOCK_ADDR,
                                              attach_type=attach), attach))
            except Exception as e:
                log.warning("first byte: %s refused (%s): its owners stay unknown", name,
                            _last_line(e))
        return out

    def _seed_listeners(self) -> int:
        try:
            found = listeners()
        except OSError as e:
            log.warning("first byte: listening sockets not read (%s): their flows get a class "
                        "after the handshake until they listen again", e)
            return 0
        t = self._bpf[b"fb_listeners"]
        for port, p in found.items():
            leaf = t.Leaf()
            leaf.pid, leaf.uid = p.pid, max(p.uid, 0)
            raw = p.comm.encode("utf-8", "replace")[:COMM_LEN - 1]
            _set_bytes(leaf, "comm", raw)
            t[t.Key(port)] = leaf
        return len(found)

    # ------------------------------------------------------------ kernel maps
    def _write_config(self, live: int, c: Optional[Compiled] = None) -> None:
        t = self._bpf[b"fb_config"]
        leaf = t.Leaf()
        leaf.netns_cookie = self.netns_cookie
        leaf.live = live
        if c is not None:
            leaf.kernel, leaf.inbound, leaf.outbound = c.kernel_mask, c.inbound, c.outbound
            leaf.any_comm, leaf.any_uid, leaf.any_remote = c.any_comm, c.any_uid, c.any_remote
        leaf.guard = int(self._guard)
        t[ctypes.c_int(0)] = leaf

    def _write_ports(self, name: bytes, masks: List[int]) -> None:
        t = self._bpf[name]
        keys = (t.Key * 65536)(*range(65536))
        vals = (t.Leaf * 65536)(*masks)
        try:
            t.items_update_batch(keys, vals)
        except Exception:       # no batch ops for arrays on this kernel: one by one
            for p in range(65536):
                t[keys[p]] = vals[p]

    def _write_rules(self, c: Compiled) -> None:
        b = self._bpf
        self._write_ports(b"fb_lport", c.lport)
        self._write_ports(b"fb_rport", c.rport)
        t = b[b"fb_comms"]
        t.clear()
        for comm, mask in c.comms.items():
            k = t.Key()
            _set_bytes(k, "comm", comm)
            t[k] = t.Leaf(mask)
        t = b[b"fb_uids"]
        t.clear()
        for uid, mask in c.uids.items():
            t[t.Key(uid)] = t.Leaf(mask)
        t = b[b"fb_remote"]
        for k in list(t.keys()):
            del t[k]
        for (fam, addr, plen), mask in c.remote.items():
            k = t.Key()
            k.prefixlen, k.family = 32 + plen, fam
            _set_bytes(k, "addr", addr)
            t[k] = t.Leaf(mask)

    def _stopgaps(self, ruleset: RuleSet, c: Compiled) -> List[Tuple[int, int]]:
        """fb_rate's rows: (rate, generation) per rule index. The rate is the kernel rule's
        class's (its ceiling when it has one: what the class may send), 0 for the others; the
        generation changes when the rule or one before it changed (a reload), so the program
        lifts the limit of the sockets it gave under the old rules, whose flows the engine may
        now give another rule or rate. A rebuild with the same rules keeps them."""
        rows = []
        rules = ruleset.rules
        off = bool(os.environ.get("FLOWPACER_NO_STOPGAP"))
        for i in range(MAX_RULES):
            prefix = rules[:i + 1] if i < len(rules) else None
            old = self._stop_gens.get(i)
            if old is not None and old[0] == prefix:
                gen = old[1]
            else:
                gen = self._next_gen
                self._next_gen += 1
                self._stop_gens[i] = (prefix, gen)
            rule = c.kernel.get(i)
            rate = 0
            if rule is not None and rule.rate_bps and not off:
                rate = min(max(rule.ceil_bps or 0, rule.rate_bps), MAX_PACING)
            rows.append((rate, gen))
        return rows

    def _write_stopgaps(self, rows: List[Tuple[int, int]]) -> None:
        t = self._bpf[b"fb_rate"]
        for i, (rate, gen) in enumerate(rows):
            leaf = t.Leaf()
            leaf.rate, leaf.gen = rate, gen
            t[ctypes.c_int(i)] = leaf

    def _take(self, rule: int) -> int:
        return self._bpf[b"fb_take"][ctypes.c_int(rule)].value

    def _set_take(self, rule: int, ticket: int) -> None:
        self._bpf[b"fb_take"][ctypes.c_int(rule)] = ctypes.c_uint64(ticket)

    def _set_slot(self, index: int, classid: int) -> None:
        self._bpf[b"fb_pool"][ctypes.c_int(index)] = ctypes.c_uint32(classid)

    def _set_fill(self, rule: int, ticket: int) -> None:
        self._bpf[b"fb_fill"][ctypes.c_int(rule)] = ctypes.c_uint64(ticket)

    def _put(self, rule: int, pool: _Pool, classids) -> None:
        """Write slots, then advance fill (the program reads fill first, then the slot)."""
        for cid in classids:
            self._set_slot(rule * POOL_SLOTS + pool.fill % POOL_SLOTS, cid)
            pool.slots[pool.fill] = cid
            pool.fill += 1
        self._set_fill(rule, pool.fill)

    # ----------------------------------------------------------------- pools
    def _drain(self) -> List[int]:
        """Switch claims off; the class ids of every pool ticket not taken (already taken ones
        are claims whose events are on their way)."""
        self._write_config(0)
        self._live = False
        time.sleep(GRACE_S)     # a run that read the old config ends within microseconds
        free = []
        for r, pool in self._pools.items():
            take = self._take(r)
            free += [cid for t, cid in pool.slots.items() if t >= take]
        return free

    def _remake(self, ruleset: RuleSet) -> None:
        """New rings for ``ruleset``'s kernel rules (claims are off: drained before). The
        classes come with the next grant."""
        old_fill = {r: p.fill for r, p in self._pools.items()}
        self._pools = {}
        c = compile_rules(ruleset)
        self._compiled = c
        self._write_rules(c)
        self._write_stopgaps(self._stopgaps(ruleset, c))
        for r, rule in sorted(c.kernel.items()):
            # tickets only grow (no ABA for the program's compare-and-swap); the old ones not
            # taken were drained, so take jumps to fill (claims are off: we may write it)
            fill = max(self._take(r), old_fill.get(r, 0))
            self._set_take(r, fill)
            self._pools[r] = _Pool(rule, fill=fill)
        self._rules_seen = ruleset.rules
        names = {r.name for r in c.kernel.values()}
        self._rule_claims = {n: k for n, k in self._rule_claims.items() if n in names}
        self.summary = c.summary()

    def _ready(self) -> Tuple[Tuple[model.Rule, int], ...]:
        """Each kernel rule with the classes ready in its ring (taken slots forgotten)."""
        out = []
        for r, pool in sorted(self._pools.items()):
            take = self._take(r)
            for t in [t for t in pool.slots if t < take]:
                del pool.slots[t]
            out.append((pool.rule, pool.fill - take))
        return tuple(out)

    # ---------------------------------------------------------------- events
    def _on_event(self, _ctx, data, size) -> None:
        try:
            self._raw.append(ctypes.string_at(data, size))
        except Exception:
            self._counts["bad_records"] += 1

    def _ring_poll(self, timeout_ms: int) -> None:
        self._bpf.ring_buffer_poll(max(0, int(timeout_ms)))

    def poll(self, timeout_ms: int) -> List[model.ClaimEvent]:
        """The program's claims since the last poll (closes and new listeners are kept for
        the next ``report``)."""
        with self._poll_lock:
            if self._bpf is None:
                return []
            self._ring_poll(timeout_ms)
            raw, self._raw = self._raw, []
        out = []
        for rec in raw:
            if len(rec) != EVENT.size:
                self._counts["bad_records"] += 1
                continue
            r = EVENT.unpack(rec)
            if r[9] & FB_F_CLOSED:          # a claiming socket is closed
                self._closed.append(r[1])
                continue
            if r[1] == 0:                   # classid 0: a new listener (no current helpers)
                self._new_listeners = True
                continue
            out.append(self._to_claim(r))
        self._counts["claims"] += len(out)
        if out and (self._guard or time.monotonic() < self._guard_until):
            now = time.monotonic()
            with self._lock:
                for c in out:
                    self._guarded[c.key] = (c.classid, c.ts_ns, now)
        return out

    def _to_claim(self, r) -> model.ClaimEvent:
        (ts, classid, rule, _pid, _uid, family, lport, rport, _direction, _flags,
         laddr, raddr, _comm) = r
        if family == 4:
            la, ra = ipaddress.IPv4Address(laddr[:4]), ipaddress.IPv4Address(raddr[:4])
        else:
            la, ra = ipaddress.IPv6Address(laddr), ipaddress.IPv6Address(raddr)
        pool = self._pools.get(rule)
        return model.ClaimEvent(FlowKey(la, lport, ra, rport), classid,
                                pool.rule.name if pool is not None else "", ts)

    # ----------------------------------------------------------------- round
    # A round of the firstbyte stage (app.py): ``report`` (outside the reconciler's lock: the
    # sweep's sock_diag dump, the drain's sleep, map reads and writes), the reconciler's
    # ``on_claims`` (under it: one apply), ``granted`` (outside it: the new ids into the rings).
    #
    # A claim is a hint, not a flow event: the flow itself is opened and closed by the tracer
    # (or sock_diag) as before, so OPEN and CLOSE keep their one ordered source; the flow's ADD
    # then takes the claimed class. A flow that got its class before its claim was seen is
    # given the claimed one instead (the socket sends into that).
    def report(self, claims: List[model.ClaimEvent]) -> model.PoolReport:
        """What the reconciler needs this round. When the last grant named another pool
        bookkeeping (a rebuild, a fall-back, the start) or other rules (a reload), the rings
        are drained and made anew first."""
        with self._lock:
            if self._bpf is None:
                return model.PoolReport(self._epoch)
            if self._new_listeners:
                self._new_listeners = False
                self._seed_listeners()
            closed, self._closed = tuple(self._closed), []
            prios = None
            returned: Tuple[int, ...] = ()
            replan = False
            now = time.monotonic()
            if self._grant_epoch != self._epoch and self._grant_rules is not None:
                # before any pool id is handed out on a new bookkeeping, the ids still-open
                # sockets carry are held back; claims are off first, so that no socket takes
                # an old pool's id after the sweep read the sockets. The old classes went with
                # the old bookkeeping: nothing is returned, the old claims and closes are void.
                self._counts["returned"] += len(self._drain())
                prios = self._priorities()
                self._remake(self._grant_rules)
                self._epoch = self._grant_epoch
                claims, closed, replan = [], (), True
            elif self._grant_rules is not None and self._grant_rules.rules != self._rules_seen:
                free = self._drain()
                self._counts["returned"] += len(free)
                self._remake(self._grant_rules)
                returned, replan = tuple(free), True
            elif self._oldest_wait_s >= SWEEP_S and now - self._swept_at >= SWEEP_S:
                prios = self._priorities()  # ids whose close report has not come: a sweep
            if prios is not None:
                self._swept_at = now
                self._counts["sweeps"] += 1
            return model.PoolReport(self._epoch, self._ready(), self.pool_target, tuple(claims),
                                    closed, returned,
                                    frozenset(prios) if prios is not None else None, replan,
                                    guarded=self._guarded_keys(closed, now))

    def _guarded_keys(self, closed: Tuple[int, ...], now: float) -> Tuple[FlowKey, ...]:
        """The guarded claims still awaiting their placement: those whose socket closed (its
        class id reported closed) or that waited ``GUARD_FORGET_S`` are forgotten first."""
        g = self._guarded
        if not g:
            return ()
        gone = set(closed)
        for k in [k for k, (cid, _ts, seen) in g.items()
                  if cid in gone or now - seen > GUARD_FORGET_S]:
            del g[k]
        return tuple(g)

    def granted(self, grant: model.PoolGrant) -> bool:
        """The reconciler's answer: the new classes into the rings, claims on again after a
        drain. True when another round is due at once (the pools must be made anew)."""
        with self._lock:
            if self._bpf is None:
                return False
            self._grant_rules = grant.rules
            if not grant.applied:
                return False
            self._grant_epoch = grant.epoch
            self._ids = (grant.ids_held, grant.ids_awaiting)
            self._oldest_wait_s = grant.oldest_wait_s
            self._place(grant.placed)
            if grant.guard != self._guard:
                self._set_guard(grant.guard)
            if grant.epoch != self._epoch:
                self._counts["stale"] += grant.stale
                return True
            for name in ("stale", "bound", "released", "rebound", "closed", "freed_by_sweep"):
                self._counts[name] += getattr(grant, name)
            for n, k in grant.bound_by_rule.items():
                self._rule_claims[n] = self._rule_claims.get(n, 0) + k
            made = 0
            for r, pool in sorted(self._pools.items()):
                ids = grant.made.get(pool.rule.name, ())
                if ids:
                    self._put(r, pool, ids)
                    made += len(ids)
            if not self._live and self._compiled is not None:
                self._write_config(self._compiled.live, self._compiled)
                self._live = True
                log.info("%s; %d pool classes ready", self.summary, grant.ready_classes)
            else:
                self._counts["refilled"] += made
            return grant.rules is not None and grant.rules.rules != self._rules_seen

    def _set_guard(self, on: bool) -> None:
        """config.guard on (several interfaces) or off; claims seen up to a few seconds after
        it went off may still be guarded ones (their events were on their way)."""
        self._guard = on
        if not on:
            self._guard_until = time.monotonic() + 5.0
        self._write_config(self._compiled.live if self._live and self._compiled else 0,
                           self._compiled if self._live else None)
        log.info("first byte: claims %s guarded by the stopgap until their class is on the "
                 "interface they leave by", "are" if on else "are no longer")

    def _place(self, keys) -> None:
        """Guarded claims whose class is on the interface they leave by: their claim's ts_ns
        into fb_placed, so that the socket's next ACK lifts its stopgap."""
        for k in keys:
            got = self._guarded.pop(k, None)
            if got is None:
                continue
            cid, ts, _seen = got
            self._set_placed(cid % PLACED_SLOTS, ts)
            self._counts["placed"] += 1

    def _set_placed(self, slot: int, ts_ns: int) -> None:
        self._bpf[b"fb_placed"][ctypes.c_int(slot)] = ctypes.c_uint64(ts_ns)

    def _priorities(self) -> Optional[Set[int]]:
        try:
            return socket_priorities()
        except OSError as e:
            log.warning("first byte: sockets' priorities not read (%s): awaited pool ids stay "
                        "taken", e)
            return None

    # ------------------------------------------------------------------ stats
    def _counters(self) -> Optional[List[int]]:
        t = self._bpf[b"fb_counters"]
        out = []
        for i in range(len(COUNTERS)):
            try:
                out.append(sum(t[ctypes.c_int(i)]))
            except Exception:
                out.append(None)
        return out

    def stats(self) -> Dict[str, int]:
        out = dict(self._counts)
        b = self._bpf
        if b is not None:
            for name, v in zip(COUNTERS, self._counters()):
                if v is not None:
                    out[name] = v
            out["pool_ready"] = sum(p.fill - self._take(r) for r, p in self._pools.items())
        return out

    def view(self) -> model.FirstByteView:
        """Pools and counters for status and metrics (one typed view)."""
        with self._lock:
            st = self.stats()
            pools = []
            for r, p in sorted(self._pools.items()):
                try:
                    ready = p.fill - self._take(r)
                except Exception:
                    ready = 0
                pools.append(model.FirstBytePool(p.rule.name, ready,
                                                 self._rule_claims.get(p.rule.name, 0)))
            held, waiting = self._ids if self._grant_epoch == self._epoch else (0, 0)
        st["exhausted"] = st.get("pool_empty", 0)
        counters = model.FirstByteCounters(**{k: int(st.get(k, 0)) for k in VIEW_COUNTERS})
        return model.FirstByteView(tuple(pools), counters, held, waiting)

    # ------------------------------------------------------------------ close
    def close(self) -> Optional[model.PoolReport]:
        """Detach. Returns the last report (``closing``: the reconciler deletes every ready
        class, ``on_claims``); None when it was not started."""
        with self._poll_lock, self._lock:
            b = self._bpf
            if b is None:
                return None
            try:
                log.info("first byte: %s", ", ".join(f"{k} {v}" for k, v in self.stats().items()))
            except Exception as e:
                log.debug("first byte stats: %s", e)
            free = self._drain()
            self._counts["returned"] += len(free)
            for fd in self._link_fds:
                os.close(fd)
            self._link_fds = []
            self._bpf = None
            self._pools = {}
            b.cleanup()
            self.summary = "stopped"
            log.info("first-byte sock_ops detached")
            return model.PoolReport(self._epoch, (), self.pool_target, returned=tuple(free),
                                    closing=True)
