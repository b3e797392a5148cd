"""The flow table takes a sock_diag snapshot that says what changed since the one before it
(``Snapshot.delta_from``, issue 26) by a look at the changes only: the result must be the one a
look at every flow gives. Random worlds of sockets, tracer events and idleness, each step given
to two tables, one with the snapshots' changes and one with the same snapshots whole."""
import ipaddress
import random

import pytest

from flowpacer.daemon.flows import FlowTable
from flowpacer.model import (Direction, EventKind, Flow, FlowEvent, FlowKey, FlowSource,
                             ProcessInfo, Protocol)
from flowpacer.sources.sockdiag import Snapshot

OWNERS = (ProcessInfo(pid=0, uid=7), ProcessInfo(pid=11, comm="a"), ProcessInfo(pid=12, comm="b"))


def _key(i: int, udp: bool) -> FlowKey:
    return FlowKey(ipaddress.IPv4Address("10.0.0.1"), 1000 + i % 7,
                   ipaddress.IPv4Address(f"10.0.1.{i % 5}"), 2000 + i,
                   Protocol.UDP if udp else Protocol.TCP)


class World:
    """Sockets as sock_diag would list them (ident -> facts), and a scanner that gives what
    ``SockDiagSource.snapshot`` gives: the previous scan's Flow object for a socket whose facts
    did not change, its changes and its gone keys since the previous scan."""

    def __init__(self, rnd: random.Random):
        self.rnd = rnd
        self.socks = {}           # ident -> (key, owner, mark, bound_if)
        self.prev = {}            # ident -> Flow
        self.token = None
        self.next_ident = 0

    def scan(self, now: int) -> Snapshot:
        snap = Snapshot()
        snap.udp_ports = frozenset(k.local_port for k, *_ in self.socks.values()
                                   if k.protocol is Protocol.UDP and self.rnd.random() < 0.5)
        cur, changed = {}, []
        for ident, (key, owner, mark, bound_if) in self.socks.items():
            f = self.prev.get(ident)
            if f is None or (f.proc, f.mark, f.bound_if) != (owner, mark, bound_if):
                f = Flow(key, Direction.INBOUND, owner, FlowSource.RECONCILE, 0, now, mark=mark,
                         bound_if=bound_if)
                changed.append(key)
            elif key in snap:
                changed.append(key)
            cur[ident] = f
            snap[key] = f
        snap.changed = changed
        snap.gone = [self.prev[i].key for i in self.prev.keys() - cur.keys()]
        snap.delta_from, snap.token = self.token, object()
        self.token, self.prev = snap.token, cur
        return snap


def _whole(snap: Snapshot) -> Snapshot:
    s = Snapshot(snap)
    s.udp_ports = snap.udp_ports
    return s


def _state(t: FlowTable):
    return (dict(t.flows), set(t.dirty), set(t.rerouted), set(t.expired), dict(t.idle_since),
            dict(t.events), t.reconcile_added, t.reconcile_removed)


def _diff(a: FlowTable, b: FlowTable) -> str:
    out = []
    for name, x, y in zip(("flows", "dirty", "rerouted", "expired", "idle_since", "events",
                           "added", "removed"), _state(a), _state(b)):
        if x == y:
            continue
        if isinstance(x, dict):
            x = {k: v for k, v in x.items() if y.get(k) != v}
            y = {k: v for k, v in y.items() if k not in x or x[k] != v}
        elif isinstance(x, set):
            x, y = x - y, y - x
        out.append(f"{name}: by changes {x}, whole {y}")
    return "; ".join(out)


@pytest.mark.parametrize("seed", range(40))
def test_a_snapshot_taken_by_its_changes_equals_one_taken_whole(seed):
    rnd = random.Random(seed)
    w = World(rnd)
    inc, whole = FlowTable(), FlowTable()
    now = 10
    nkeys = rnd.choice((4, 12, 40))
    skipped = False
    for step in range(60):
        now += 10
        for _ in range(rnd.randrange(6)):
            r = rnd.random()
            if r < 0.25:        # a socket opens (sometimes a second one of a listed tuple)
                w.next_ident += 1
                key = _key(rnd.randrange(nkeys), rnd.random() < 0.3)
                w.socks[w.next_ident] = (key, rnd.choice(OWNERS), rnd.choice((0, 0, 5)), 0)
            elif r < 0.45 and w.socks:      # a socket closes
                del w.socks[rnd.choice(list(w.socks))]
            elif r < 0.55 and w.socks:      # its owner is found, or its mark changes
                i = rnd.choice(list(w.socks))
                key, owner, mark, bif = w.socks[i]
                w.socks[i] = (key, rnd.choice(OWNERS), rnd.choice((0, 5, 9)), rnd.choice((0, 3)))
            else:                           # a tracer event, of a listed socket or not
                keys = [k for k, *_ in w.socks.values()]
                key = (rnd.choice(keys) if keys and rnd.random() < 0.7
                       else _key(rnd.randrange(nkeys), rnd.random() < 0.3))
                kind = rnd.choice((EventKind.OPEN, EventKind.OPEN, EventKind.CLOSE,
                                   EventKind.IDLE))
                ev = FlowEvent(kind, Flow(key, Direction.INBOUND, rnd.choice(OWNERS),
                                          FlowSource.TRACER, 0, now + rnd.choice((-15, 5))))
                for t in (inc, whole):
                    t.on_event(ev)
        if rnd.random() < 0.15:
            expire = [k for k in list(inc.flows) if rnd.random() < 0.2]
            for t in (inc, whole):
                t.expire(expire)
        if rnd.random() < 0.7:
            snap = w.scan(now - 5)
            if rnd.random() < 0.05:
                skipped = True          # a scan the table never took: the next is taken whole
                continue
            started = now - rnd.choice((0, 8, 20))
            inc.on_snapshot(snap, started)
            whole.on_snapshot(_whole(snap), started)
        assert _state(inc) == _state(whole), f"step {step}: {_diff(inc, whole)}"
        if rnd.random() < 0.5:
            for t in (inc, whole):
                t.take_dirty()
                t.rerouted = set()
    assert inc.snapshots == whole.snapshots
    del skipped


def test_a_snapshot_with_its_changes_looks_only_at_them():
    """Two scans of 1 000 listed flows with nothing changed: the second is taken without a look
    at every flow (the table's dict is not walked: a table whose flows are a dict that refuses
    iteration takes it)."""
    w = World(random.Random(1))
    for i in range(1000):
        w.socks[i] = (_key(i, False), OWNERS[1], 0, 0)
    t = FlowTable()
    t.on_snapshot(w.scan(5), 10)
    assert len(t.flows) == 1000

    class NoWalk(dict):
        def __iter__(self):
            raise AssertionError("walked every flow")
        keys = items = values = __iter__

    t.flows = NoWalk(t.flows)
    t.take_dirty()
    t.on_snapshot(w.scan(15), 20)
    assert len(t.flows) == 1000 and not t.dirty
    del w.socks[3]
    t.on_snapshot(w.scan(25), 30)
    assert len(t.flows) == 999 and t.dirty == {_key(3, False)}
