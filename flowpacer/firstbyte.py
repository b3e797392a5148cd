"""First-byte shaping (issue 16): a target flow's class is decided in the kernel at the end of
its handshake, before its first data packet, instead of after a round trip through user space.

The cgroup ``sock_ops`` program is ``flowpacer/bpf/firstbyte.c`` (its header comment explains
the callbacks, the rule masks and the pool protocol). This module owns it:

* ``compile_rules(ruleset)`` (pure; ``handshake.py``, the engine's side: from what each ``Match``
  field declares the kernel can decide; not exe patterns, process globs or rules with
  aggregate rates), and the bit masks the program reads;
* ``FirstByte``: compiles and attaches the program (a bpf_link on the cgroup v2 root: it is
  detached when the daemon's fd closes, also on a crash; nothing is pinned), keeps a pool of
  ready classes per kernel-decided rule in the backend (``backend/pool.py``), and turns the
  program's claims into flow OPEN events. ``step()`` is the one entry point of the stage: it
  binds the claims to the backend, hands the events to the reconciler (which installs the flow's
  own u32 filter on the claimed class), gives back claims no rule wants, and refills the pools.

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

from . import cgroupbpf, model
from .cgroupbpf import cgroup2_root, link_create  # noqa: F401  (cgroup2_root: tests use it)
from .errors import TracerUnavailable
from .handshake import Compiled, compile_rules
from .model import Direction, FlowKey, OpKind, RuleSet

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
            "no_match")
# struct fb_event: ts_ns classid rule pid uid family lport rport direction flags
#                  laddr[16] raddr[16] comm[16]
EVENT = struct.Struct("<QIIIIHHHBB16s16s16s")
assert EVENT.size == 80

# the counters status and metrics show (model.FirstByteView.counters), a fixed set: claims (by
# the program), refilled (classes made to top pools up), returned (ready classes taken back
# unclaimed at a reload or stop), released (claims no flow took), exhausted (a rule matched and
# its pool was empty), and why a flow was left to user space or lost
VIEW_COUNTERS = ("claimed", "bound", "refilled", "returned", "released", "exhausted",
                 "undecided", "unattributed", "no_match", "setsockopt_failed", "lost", "stale",
                 "rebound", "closed", "sweeps", "freed_by_sweep", "bad_records")

POOL_TARGET = 48           # ready classes per rule (< POOL_SLOTS): 24 ms of claims at 2 000 flows/s
CLAIM_WAIT_S = 5.0         # a claim whose flow the daemon has not seen by then is given back
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
    from .sockdiag import (NETLINK_SOCK_DIAG, PORTS, REQ, SOCK_DIAG_BY_FAMILY, TAIL, TAIL_OFF,
                           TCP_LISTEN, read_process, socket_owners)
    from .tc.nl import RtnlSocket
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
    from .sockdiag import NETLINK_SOCK_DIAG, REQ, SOCK_DIAG_BY_FAMILY
    from .tc.nl import RtnlSocket
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


@dataclass(frozen=True)
class Claim:
    event: model.FlowEvent
    classid: int
    rule: int


@dataclass
class _Pool:
    rule: model.Rule
    shape: model.Shape
    fill: int = 0                                            # next ticket to write
    slots: Dict[int, int] = field(default_factory=dict)      # ticket -> class id (not yet taken)


# ------------------------------------------------------------------ owner

class FirstByte:
    """The sock_ops program, its maps and the pools of ready classes."""

    def __init__(self, ring_pages: int = 64, pool_target: int = POOL_TARGET):
        if not 1 <= pool_target < POOL_SLOTS:
            raise ValueError(f"pool_target must be 1..{POOL_SLOTS - 1}, not {pool_target!r}")
        self.ring_pages = ring_pages
        self.pool_target = pool_target
        self.netns_cookie = 0
        self._bpf = None
        self._fn = None
        self._link_fds: List[int] = []
        self.owner_hooks = 0
        self._raw: List[bytes] = []
        self._pools: Dict[int, _Pool] = {}
        self._pending: Dict[FlowKey, tuple] = {}     # claims not bound yet: (since, class id)
        self._new_listeners = False
        self._closed: List[int] = []                             # class ids of closed sockets
        self._compiled: Optional[Compiled] = None
        self._rules_seen: Optional[tuple] = None
        self._backend = None
        self._epoch = -1
        self._counts = {"claims": 0, "bound": 0, "released": 0, "rebound": 0, "bad_records": 0,
                        "stale": 0, "closed": 0, "sweeps": 0, "freed_by_sweep": 0,
                        "refilled": 0, "returned": 0}
        self._rule_claims: Dict[str, int] = {}
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

    def _take(self, rule: int) -> int:
        return self._bpf[b"fb_take"][ctypes.c_int(rule)].value

    def _put(self, rule: int, pool: _Pool, classids: List[int]) -> None:
        """Write slots, then advance fill (the program reads fill first, then the slot)."""
        t = self._bpf[b"fb_pool"]
        for cid in classids:
            t[ctypes.c_int(rule * POOL_SLOTS + pool.fill % POOL_SLOTS)] = ctypes.c_uint32(cid)
            pool.slots[pool.fill] = cid
            pool.fill += 1
        self._bpf[b"fb_fill"][ctypes.c_int(rule)] = ctypes.c_uint64(pool.fill)

    # ----------------------------------------------------------------- pools
    def _drain(self) -> List[int]:
        """Switch claims off; the class ids of every pool ticket not taken (already taken ones
        are claims whose events are on their way)."""
        self._write_config(0)
        time.sleep(GRACE_S)     # a run that read the old config ends within microseconds
        free = []
        for r, pool in self._pools.items():
            take = self._take(r)
            free += [cid for t, cid in pool.slots.items() if t >= take]
        return free

    def _replan(self, backend, ruleset: RuleSet) -> None:
        same_backend = backend is self._backend and backend.pool_epoch == self._epoch
        free = self._drain() if self._bpf is not None else []
        self._counts["returned"] += len(free)
        if not same_backend:
            free = []           # those classes went with the old backend's qdisc
        old_fill = {r: p.fill for r, p in self._pools.items()}
        self._pools = {}
        c = compile_rules(ruleset)
        self._compiled = c
        self._write_rules(c)
        spare = list(free)
        from .engine import shape_of
        for r, rule in sorted(c.kernel.items()):
            shape = shape_of(rule)
            # tickets only grow (no ABA for the program's compare-and-swap); the old ones not
            # taken were drained above, so take jumps to fill (claims are off: we may write it)
            fill = max(self._take(r), old_fill.get(r, 0))
            self._bpf[b"fb_take"][ctypes.c_int(r)] = ctypes.c_uint64(fill)
            pool = _Pool(rule, shape, fill=fill)
            self._pools[r] = pool
            reuse, spare = spare[:self.pool_target], spare[self.pool_target:]
            got = backend.pool_change(reuse, shape) if reuse else []
            got += backend.pool_create(shape, self.pool_target - len(got))
            self._put(r, pool, got)
        if spare:
            backend.pool_delete(spare)
        self._backend, self._epoch = backend, backend.pool_epoch
        self._rules_seen = ruleset.rules
        names = {r.name for r in c.kernel.values()}
        self._rule_claims = {n: k for n, k in self._rule_claims.items() if n in names}
        self._write_config(c.live, c)
        self.summary = c.summary()
        log.info("%s; %d pool classes ready", self.summary, backend.pool_classes())

    def refill(self, backend) -> int:
        """Top every pool up to its target; how many classes were made."""
        made = 0
        for r, pool in self._pools.items():
            take = self._take(r)
            for t in [t for t in pool.slots if t < take]:
                del pool.slots[t]
            need = self.pool_target - (pool.fill - take)
            if need > 0:
                got = backend.pool_create(pool.shape, need)
                self._put(r, pool, got)
                made += len(got)
        self._counts["refilled"] += made
        return made

    # ---------------------------------------------------------------- events
    def _on_event(self, _ctx, data, size) -> None:
        try:
            self._raw.append(ctypes.string_at(data, size))
        except Exception:
            self._counts["bad_records"] += 1

    def poll(self, timeout_ms: int) -> List[Claim]:
        with self._poll_lock:
            b = self._bpf
            if b is None:
                return []
            b.ring_buffer_poll(max(0, int(timeout_ms)))
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
        return out

    def _to_claim(self, r) -> Claim:
        (ts, classid, rule, pid, uid, family, lport, rport, direction, flags,
         laddr, raddr, comm) = r
        if family == 4:
            la, ra = ipaddress.IPv4Address(laddr[:4]), ipaddress.IPv4Address(raddr[:4])
        else:
            la, ra = ipaddress.IPv6Address(laddr), ipaddress.IPv6Address(raddr)
        key = FlowKey(la, lport, ra, rport)
        if flags & FB_F_ATTRIBUTED:
            name = comm.split(b"\0", 1)[0].decode("utf-8", "replace")
            try:
                exe = os.readlink(f"/proc/{pid}/exe") if pid else ""
            except OSError:
                exe = ""
            proc = model.ProcessInfo(pid=pid, comm=name, exe=exe, uid=uid)
        else:
            proc = model.ProcessInfo(pid=0)
        d = Direction.INBOUND if direction == FB_DIR_INBOUND else Direction.OUTBOUND
        flow = model.Flow(key, d, proc, model.FlowSource.TRACER, 0, ts)
        return Claim(model.FlowEvent(model.EventKind.OPEN, flow), classid, rule)

    # ------------------------------------------------------------------ step
    def step(self, rec, backend, claims: List[Claim]) -> None:
        """One round, under the reconciler's lock: claims bound to their flows in the backend,
        unused claims given back, pools refilled (remade after a reload or a backend rebuild).

        A claim is a hint, not a flow event: the flow itself is opened and closed by the tracer
        (or sock_diag) as before, so OPEN and CLOSE keep their one ordered source; the flow's
        ADD then takes the claimed class. A flow that got its class before its claim was seen
        is given the claimed one instead (the socket sends into that)."""
        prios = None
        if backend is not None and self._bpf is not None and backend is self._backend \
                and backend.pool_epoch == self._epoch and backend.pool_ids_waiting(SWEEP_S) \
                and time.monotonic() - self._swept_at >= SWEEP_S:
            prios = self._priorities()      # the periodic sweep's dump, outside the lock
        with self._lock, rec.lock:
            if self._bpf is None:
                return
            if self._new_listeners:
                self._new_listeners = False
                self._seed_listeners()
            if backend is None:
                return
            now = time.monotonic()
            fresh = backend is not self._backend or backend.pool_epoch != self._epoch
            closed, self._closed = self._closed, []
            if fresh:
                # before any pool id is handed out on a new bookkeeping (rebuild, fall-back,
                # start), the ids still-open sockets carry are held back; claims are off first,
                # so that no socket takes an old pool's id after the sweep read the sockets
                self._write_config(0)
                time.sleep(GRACE_S)
                prios = self._priorities()
            if prios is not None:
                self._swept_at = now
                self._counts["freed_by_sweep"] += backend.pool_sockets_hold(prios)
                self._counts["sweeps"] += 1
            marked = False
            for c in claims:
                key = c.event.flow.key
                if fresh or not backend.pool_claimed(key, c.classid):
                    self._counts["stale"] += 1
                    log.debug("stale claim of %x by %s", c.classid, key)
                    continue
                self._counts["bound"] += 1
                pool = self._pools.get(c.rule)
                if pool is not None:
                    n = pool.rule.name
                    self._rule_claims[n] = self._rule_claims.get(n, 0) + 1
                self._pending[key] = (now, c.classid)
                log.debug("claim of %x by %s", c.classid, key)
                cur = backend.classid_of(key)
                if cur is not None and cur != c.classid:
                    log.debug("%s had class %x before its claim of %x: rebound", key, cur,
                              c.classid)
                    backend.apply([model.Op(OpKind.REMOVE, key)])
                    self._counts["rebound"] += 1
                if key in rec.table.flows:
                    rec.table.dirty.add(key)
                    marked = True
            if marked:
                rec.apply_dirty()
            gone = set()
            if closed and not fresh:
                gone = set(closed)
                self._counts["closed"] += len(closed)
            pend = backend.pool_pending()
            flows = rec.table.flows
            for key, (since, cid) in list(self._pending.items()):
                f = flows.get(key)
                # a flow sock_diag found before its accept() has no owner yet: the rules
                # cannot be judged on it, the tracer's OPEN will tell
                planned = f is not None and f.proc.pid != 0
                if key not in pend:
                    del self._pending[key]              # the flow's ADD took it
                elif planned or cid in gone or now - since > CLAIM_WAIT_S:
                    # planned and not shaped (no rule wants it, the apply failed), or its flow
                    # never showed up: the class goes, its id waits for the flow's end
                    log.debug("claim of %x by %s given back (%s)", cid, key,
                              "planned" if planned else
                              "closed" if cid in gone else "timed out")
                    backend.pool_release(key)
                    del self._pending[key]
                    self._counts["released"] += 1
            for cid in gone:
                backend.pool_socket_closed(cid)
            if fresh or rec.rules.rules != self._rules_seen:
                self._pending.clear()
                self._replan(backend, rec.rules)
            else:
                self.refill(backend)

    def _priorities(self) -> Optional[Set[int]]:
        try:
            return socket_priorities()
        except OSError as e:
            log.warning("first byte: sockets' priorities not read (%s): awaited pool ids stay "
                        "taken", e)
            return None

    # ------------------------------------------------------------------ stats
    def stats(self) -> Dict[str, int]:
        out = dict(self._counts)
        b = self._bpf
        if b is not None:
            t = b[b"fb_counters"]
            for i, name in enumerate(COUNTERS):
                try:
                    out[name] = sum(t[ctypes.c_int(i)])
                except Exception:
                    pass
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
            b = self._backend
            fresh = b is None or b.pool_epoch != self._epoch
            held = 0 if fresh else b.pool_ids_held()
            waiting = 0 if fresh else b.pool_ids_waiting()
        st["exhausted"] = st.get("pool_empty", 0)
        return model.FirstByteView(tuple(pools), {k: int(st.get(k, 0)) for k in VIEW_COUNTERS},
                                   held, waiting)

    # ------------------------------------------------------------------ close
    def close(self, backend=None) -> None:
        """Detach; the unclaimed pool classes go when the backend is still ours."""
        with self._poll_lock, self._lock:
            b = self._bpf
            if b is None:
                return
            try:
                log.info("first byte: %s", ", ".join(f"{k} {v}" for k, v in self.stats().items()))
            except Exception as e:
                log.debug("first byte stats: %s", e)
            free = self._drain()
            for fd in self._link_fds:
                os.close(fd)
            self._link_fds = []
            if backend is not None and backend is self._backend \
                    and backend.pool_epoch == self._epoch and free:
                try:
                    backend.pool_delete(free)
                except Exception as e:
                    log.warning("first byte: pool classes not deleted (%s); the next start's "
                                "adoption removes them", e)
            self._bpf = None
            self._pools = {}
            b.cleanup()
            self.summary = "stopped"
            log.info("first-byte sock_ops detached")
