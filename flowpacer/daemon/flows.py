"""The live flow table: tracer events and sock_diag snapshots merged into one set of flows.

The tracer is first and exact about who opened a flow; a snapshot is late but complete. A
snapshot adds flows the tracer never reported (daemon started after them, lost events) and
removes flows it no longer lists, but only those first seen before the snapshot began, so a
flow the tracer reported a moment ago is not dropped by an older view of the kernel.
Every change marks the flow's key dirty; the daemon plans only for dirty keys.

UDP flows (issue 17) also end by idleness: the tracer reports a flow IDLE with its last
datagram's time; ``idle_since`` keeps it until a datagram re-opens the flow, and the reconciler
asks the engine which of them passed their rule's ``idle_timeout`` (``expire``). A snapshot
removes a tracer's UDP flow only when no socket of its local port is left (an unconnected
socket's peers are not in sock_diag's list, the socket is). A connected UDP socket that idled
out is still listed by sock_diag: its key stays in ``expired`` so that a snapshot does not open
it again; only the tracer does (its next datagram), or the socket's end forgets it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterable, Optional, Set

from flowpacer.model import EventKind, Flow, FlowEvent, FlowKey, FlowSource, Protocol
from flowpacer.sources.sockdiag import Snapshot

# keys changed between two snapshots the table keeps for the next one (``_touch``); beyond it
# the next snapshot is taken in by a look at every flow
TOUCHED_MAX = 1 << 20


class FlowTable:
    def __init__(self) -> None:
        self.flows: Dict[FlowKey, Flow] = {}
        self.dirty: Set[FlowKey] = set()
        self.idle_since: Dict[FlowKey, int] = {}      # UDP flows the tracer reported idle
        self.expired: Set[FlowKey] = set()            # ended by idleness, socket maybe still open
        self.events = {("tracer", "open"): 0, ("tracer", "close"): 0,
                       ("reconcile", "open"): 0, ("reconcile", "close"): 0,
                       ("idle", "close"): 0}
        self.snapshots = 0
        # flows whose socket's mark or bound device a snapshot found changed (their route must be
        # looked up again: ``Reconciler.reconcile`` takes them)
        self.rerouted: Set[FlowKey] = set()
        self.reconcile_added = 0
        self.reconcile_removed = 0
        # what a snapshot that says what changed since the one before it (``Snapshot.delta_from``:
        # sock_diag's) needs to be taken in without a look at every flow (issue 26: two passes
        # over 10 000 flows a second): the last snapshot's token, the keys whose entry the
        # tracer or idleness changed since, and the flows left in the table that it did not list
        self._snap_token: Optional[object] = None
        self._touched: Set[FlowKey] = set()
        self._unlisted: Set[FlowKey] = set()

    def __len__(self) -> int:
        return len(self.flows)

    def on_event(self, ev: FlowEvent) -> None:
        key = ev.flow.key
        if ev.kind is EventKind.IDLE:
            if key in self.flows:
                self.idle_since[key] = ev.flow.seen_ns
            return
        self.events[("tracer", ev.kind.value)] += 1
        self.idle_since.pop(key, None)
        self.expired.discard(key)
        self._touch(key)        # (a CLOSE of no flow too: it may end the key's expiry)
        if ev.kind is EventKind.OPEN:
            self.flows[key] = ev.flow
        elif self.flows.pop(key, None) is None:
            return
        self.dirty.add(key)

    def _touch(self, key: FlowKey) -> None:
        touched = self._touched
        touched.add(key)
        if len(touched) > TOUCHED_MAX:      # no snapshot for long: the next one looks at all
            touched.clear()
            self._snap_token = None

    def expire(self, keys: Iterable[FlowKey]) -> None:
        """UDP flows that were idle for their rule's timeout (``engine.idle_expired``)."""
        for key in keys:
            self.idle_since.pop(key, None)
            if self.flows.pop(key, None) is not None:
                self.dirty.add(key)
                self._touch(key)
                self.expired.add(key)
                self.events[("idle", "close")] += 1

    def on_snapshot(self, snap: Snapshot, started_ns: int) -> None:
        """Take in a snapshot: its flows the table lacks or knows differently, and the table's
        flows it does not list (first seen before ``started_ns``) removed. A snapshot that
        carries its changes since the one this table took last (``delta_from`` is that one's
        ``token``) is taken in by looking only at what changed on either side since: its new or
        changed flows and its gone keys, the keys the table changed since, and the table's flows
        the last one did not list. The result is the same as a look at every flow."""
        self.snapshots += 1
        self.expired.intersection_update(snap.keys())     # the others' sockets are gone
        incremental = snap.delta_from is not None and snap.delta_from is self._snap_token
        self._snap_token = snap.token
        touched, self._touched = self._touched, set()
        take = self._take
        if incremental:
            for key in snap.changed:
                take(key, snap[key])
            # the table's changed keys, and gone ones still listed (by another socket of the
            # tuple); one also in ``changed`` is taken again: a no-op
            for key in (*touched, *snap.gone):
                flow = snap.get(key)
                if flow is not None:
                    take(key, flow)
            maybe_gone: Iterable[FlowKey] = self._unlisted.union(touched, snap.gone)
        else:
            for key, flow in snap.items():
                take(key, flow)
            maybe_gone = self.flows.keys()
        udp_ports = snap.udp_ports          # local ports of open (unconnected) UDP sockets
        flows = self.flows
        unlisted = set()
        for key in [k for k in maybe_gone if k not in snap]:
            f = flows.get(key)
            if f is None:
                continue
            if f.seen_ns < started_ns and not (key.protocol is Protocol.UDP
                                               and f.source is FlowSource.TRACER
                                               and key.local_port in udp_ports):
                del flows[key]
                self.idle_since.pop(key, None)
                self.dirty.add(key)
                self.reconcile_removed += 1
                self.events[("reconcile", "close")] += 1
            else:
                unlisted.add(key)
        self._unlisted = unlisted

    def _take(self, key: FlowKey, flow: Flow) -> None:
        """One flow of a snapshot: added if the table lacks it, its owner or route facts
        taken where they changed."""
        cur = self.flows.get(key)
        if cur is None:
            if key in self.expired:     # a connected UDP socket that idled out
                return
            self.flows[key] = flow
            self.dirty.add(key)
            self.reconcile_added += 1
            self.events[("reconcile", "open")] += 1
        elif cur.source is FlowSource.RECONCILE and flow.proc.pid and cur.proc != flow.proc:
            self.flows[key] = replace(flow, seen_ns=cur.seen_ns)
            self.dirty.add(key)
            if (cur.mark, cur.bound_if) != (flow.mark, flow.bound_if):
                self.rerouted.add(key)
        elif (cur.mark, cur.bound_if) != (flow.mark, flow.bound_if):
            # its socket's mark or bound device is new (or the tracer did not know it):
            # its route is looked up again (issue 29)
            self.flows[key] = replace(cur, mark=flow.mark, bound_if=flow.bound_if)
            self.dirty.add(key)
            self.rerouted.add(key)

    def take_dirty(self) -> Set[FlowKey]:
        d, self.dirty = self.dirty, set()
        return d

    def mark_all(self, keys: Iterable[FlowKey] = ()) -> None:
        self.dirty.update(self.flows)
        self.dirty.update(keys)
