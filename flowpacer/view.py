"""The daemon's one typed view and its JSON form.

``build`` copies what status, ``top``, ``rules edit`` and metrics need into a ``DaemonView``
(under the reconciler's lock, without touching the kernel); ``to_json`` is the control socket's
status answer, the only place that answer is written. The kernel's class counters are read by
the caller after the lock is released and merged in here.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

from .model import (ClassStats, DaemonView, FirstByteView, FlowView, GroupKind, Side, StatsKey,
                    endpoint)


def build(rec, sup, stages: Iterable, *, rules_path: str, flow_source: str,
          tracer_stats: Optional[dict], first_byte: Optional[FirstByteView] = None) -> DaemonView:
    """Called with ``rec.lock`` held."""
    b = sup.backend
    rx = sup.rx
    flows = []
    table = rec.table.flows
    for side, be in ((Side.SEND, b), (Side.RECEIVE, rx)):
        for key, handle, shape in (be.flows_snapshot() if be else ()):
            f = table.get(key)
            if f is None:
                flows.append(FlowView(key, handle, shape.rule, shape.rate_bps, shape.ceil_bps,
                                      groups=shape.groups, side=side))
            else:
                flows.append(FlowView(key, handle, shape.rule, shape.rate_bps, shape.ceil_bps,
                                      f.proc.pid, f.proc.comm, f.proc.uid, f.direction, f.source,
                                      shape.groups, side))
    c = rec.counters
    return DaemonView(
        backend=b.name if b else None,
        backend_reason=sup.reason,
        interface=b.interface if b else None,
        backend_health=sup.health,
        backend_problem=sup.problem,
        link_rate_bps=b.link_rate_bps if b else 0,
        rules_path=rules_path,
        rule_names=tuple(r.name for r in rec.rules.rules) if rec.rules else (),
        flow_source=flow_source,
        tracer=tracer_stats,
        live_flows=len(rec.table),
        flows=tuple(flows),
        stages=tuple(s.view() for s in stages),
        counters={"applies": c.applies, "op_errors": c.op_errors,
                  "reloads_ok": c.reloads_ok, "reloads_failed": c.reloads_failed,
                  "backend_rebuild_failures": sup.rebuild_failures,
                  "shape_latency_us": _pcts(c.shape_latency_ns),
                  "apply_latency_us": _pcts(c.apply_latency_ns),
                  "reconcile_added": rec.table.reconcile_added,
                  "reconcile_removed": rec.table.reconcile_removed,
                  "apply_hist": c.apply_hist.cumulative()},
        events=dict(rec.table.events),
        groups=_groups(b),
        receive_interface=rx.interface if rx is not None else None,
        receive_health=sup.rx_health,
        receive_problem=sup.rx_problem,
        first_byte=first_byte,
    )


def _groups(b) -> tuple:
    return b.group_views() if b is not None and b.capabilities.groups else ()


def client_of(group_id: str) -> str:
    """The client part of a client group's id ("dl/192.0.2.7/32" -> "192.0.2.7/32")."""
    return group_id.split("/", 1)[1] if "/" in group_id else group_id


def _flow_groups(f: FlowView) -> dict:
    """The status fields of a flow's groups (issue 15; empty for rules without aggregates)."""
    out = {"groups": [{"kind": g.kind.value, "id": g.id, "rate_bit": g.rate_bps * 8,
                       "ceil_bit": g.ceil_bps * 8} for g in f.groups],
           "client": "", "client_rate_bit": 0, "total_rate_bit": 0}
    for g in f.groups:
        if g.kind is GroupKind.CLIENT:
            out["client"], out["client_rate_bit"] = client_of(g.id), g.rate_bps * 8
        else:
            out["total_rate_bit"] = g.rate_bps * 8
    return out


def _groups_json(v: DaemonView, stats: Dict[StatsKey, ClassStats]) -> list:
    out = []
    for g in v.groups:
        st = stats.get(g.stats_key(v.interface or ""))
        out.append({"kind": g.kind.value if g.kind else "", "id": g.id,
                    "classid": g.handle,
                    "rate_bit": g.rate_bps * 8, "ceil_bit": g.ceil_bps * 8,
                    "bytes": st.bytes if st else 0, "packets": st.packets if st else 0,
                    "drops": st.drops if st else 0})
    out.sort(key=lambda x: (x["kind"] != "rule", x["id"]))
    return out


def to_json(v: DaemonView, stats: Dict[StatsKey, ClassStats]) -> dict:
    """The status answer: every flow with its class's counters (``stats``: by ``StatsKey``,
    the supervisor's ``class_stats``)."""
    flows = []
    for f in v.flows:
        st = stats.get(f.stats_key(v.interface or ""))
        flows.append({
            "rule": f.rule, "side": f.side.value, "pid": f.pid, "process": f.process,
            "uid": f.uid,
            "direction": f.direction.value if f.direction else "",
            "source": f.source.value if f.source else "",
            "local": endpoint(f.key.local_addr, f.key.local_port),
            "remote": endpoint(f.key.remote_addr, f.key.remote_port),
            "family": f.key.family,
            "protocol": f.key.protocol.value,
            "classid": f.handle,
            "rate_bit": f.rate_bps * 8, "ceil_bit": f.ceil_bps * 8,
            "bytes": st.bytes if st else 0, "packets": st.packets if st else 0,
            "drops": st.drops if st else 0,
            **_flow_groups(f),
        })
    flows.sort(key=lambda x: (x["rule"], x["family"], x["local"], x["remote"], x["side"]))
    counters = {k: val for k, val in v.counters.items() if k != "apply_hist"}
    counters["events"] = {f"{s}_{k}": n for (s, k), n in v.events.items()}
    return {
        "backend": v.backend,
        "backend_reason": v.backend_reason,
        "interface": v.interface,
        "backend_state": v.backend_health.value,
        "backend_problem": v.backend_problem,
        "link_rate_bit": v.link_rate_bps * 8,
        "rules": v.rules_path,
        "flow_source": v.flow_source,
        "tracer": v.tracer,
        "live_flows": v.live_flows,
        "shaped_flows": len(v.flows),
        "healthy": all(s.state.value in ("running", "disabled") for s in v.stages),
        "stages": [{"name": s.name, "state": s.state.value, "failures": s.failures,
                    "last_error": s.last_error, "detail": s.detail} for s in v.stages],
        "counters": counters,
        "flows": flows,
        "groups": _groups_json(v, stats),
        "receive": None if v.receive_interface is None and not v.receive_problem else {
            "interface": v.receive_interface, "state": v.receive_health.value,
            "problem": v.receive_problem},
        "first_byte": _first_byte_json(v.first_byte),
    }


def _first_byte_json(fb: Optional[FirstByteView]) -> Optional[dict]:
    if fb is None:
        return None
    return {"pools": [{"rule": p.rule, "ready": p.ready, "claims": p.claims} for p in fb.pools],
            "counters": dict(fb.counters), "ids_held": fb.ids_held,
            "ids_awaiting": fb.ids_awaiting}


def _pcts(samples_ns) -> dict:
    s = sorted(samples_ns)
    if not s:
        return {"n": 0}
    pick = lambda p: round(s[min(len(s) - 1, int(p / 100 * (len(s) - 1) + 0.5))] / 1000, 1)
    return {"n": len(s), "p50": pick(50), "p90": pick(90), "p99": pick(99),
            "max": round(s[-1] / 1000, 1)}


