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
from typing import Dict, Iterable, Set

from flowpacer.model import EventKind, Flow, FlowEvent, FlowKey, FlowSource, Protocol
from flowpacer.sources.sockdiag import Snapshot


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
        if ev.kind is EventKind.OPEN:
            self.flows[key] = ev.flow
        elif self.flows.pop(key, None) is None:
            return
        self.dirty.add(key)

    def expire(self, keys: Iterable[FlowKey]) -> None:
        """UDP flows that were idle for their rule's timeout (``engine.idle_expired``)."""
        for key in keys:
            self.idle_since.pop(key, None)
            if self.flows.pop(key, None) is not None:
                self.dirty.add(key)
                self.expired.add(key)
                self.events[("idle", "close")] += 1

    def on_snapshot(self, snap: Snapshot, started_ns: int) -> None:
        self.snapshots += 1
        self.expired.intersection_update(snap.keys())     # the others' sockets are gone
        for key, flow in snap.items():
            cur = self.flows.get(key)
            if cur is None:
                if key in self.expired:     # a connected UDP socket that idled out
                    continue
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
        udp_ports = snap.udp_ports          # local ports of open (unconnected) UDP sockets
        for key in [k for k, f in self.flows.items() if k not in snap and f.seen_ns < started_ns
                    and not (k.protocol is Protocol.UDP
                             and f.source is FlowSource.TRACER and k.local_port in udp_ports)]:
            del self.flows[key]
            self.idle_since.pop(key, None)
            self.dirty.add(key)
            self.reconcile_removed += 1
            self.events[("reconcile", "close")] += 1

    def take_dirty(self) -> Set[FlowKey]:
        d, self.dirty = self.dirty, set()
        return d

    def mark_all(self, keys: Iterable[FlowKey] = ()) -> None:
        self.dirty.update(self.flows)
        self.dirty.update(keys)
