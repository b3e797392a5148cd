"""The daemon's one typed view and its JSON form.

``build`` copies what status, ``top``, ``rules edit`` and metrics need into a ``DaemonView``
(under the reconciler's lock, without touching the kernel); ``to_json`` is the control socket's
status answer, the only place that answer is written. The kernel's class counters are read by
the caller after the lock is released and merged in here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

from flowpacer.model import (ClassStats, DaemonCounters, DaemonView, EventCounts, FirstByteView,
                             FlowKey, FlowSourceStatus, FlowView, GroupKind, Histogram,
                             InterfaceView,
                             Percentiles, ReloadResult, Side, StatsKey, TracerStats, endpoint)


UNMANAGED_SHOWN = 100       # flows listed under unmanaged_interface (all are counted)
_COUNTS = tuple(f.name for f in dataclasses.fields(DaemonCounters) if f.type == "int")


def build(rec, sup, stages: Iterable, *, rules_path: str, flow_source: FlowSourceStatus,
          tracer_stats: Optional[TracerStats],
          first_byte: Optional[FirstByteView] = None) -> DaemonView:
    """Called with ``rec.lock`` held."""
    b = sup.backend
    rx = sup.rx
    flows = []
    groups = []
    table = rec.table.flows
    ifaces = []
    for port in sup.ports():
        pb = port.backend
        ifname = pb.interface if pb is not None else (port.interface_override or "")
        sides = ((Side.SEND, pb), (Side.RECEIVE, port.rx))
        n = 0
        for side, be in sides:
            for key, handle, shape in (be.flows_snapshot() if be else ()):
                n += side is Side.SEND
                f = table.get(key)
                if f is None:
                    flows.append(FlowView(key, handle, shape.rule, shape.rate_bps,
                                          shape.ceil_bps, groups=shape.groups, side=side,
                                          interface=ifname))
                else:
                    flows.append(FlowView(key, handle, shape.rule, shape.rate_bps,
                                          shape.ceil_bps, f.proc.pid, f.proc.comm, f.proc.uid,
                                          f.direction, f.source, shape.groups, side, ifname))
        mine = tuple(dataclasses.replace(g, interface=ifname) for g in _groups(pb))
        groups.extend(mine)
        ifaces.append(InterfaceView(ifname, pb.name if pb is not None else "", port.health,
                                    port.problem, pb.link_rate_bps if pb is not None else 0, n,
                                    spares=pb.spare_count() if pb is not None else 0,
                                    ready_classes=(rec.rules.ready_classes if pb is not None
                                                   and pb.capabilities.spares else 0),
                                    link_rate_source=(pb.link_rate_source
                                                      if pb is not None else ""),
                                    groups=len(mine),
                                    rebuild_failures=port.rebuild_failures,
                                    class_id_limit=(pb.capabilities.class_ids
                                                    if pb is not None else 0),
                                    receive_interface=port.rx.interface if port.rx else "",
                                    receive_health=port.rx_health,
                                    receive_problem=port.rx_problem,
                                    fallback=port.fallback,
                                    wanted=(port.kind_of(port._rules).value
                                            if port._rules is not None else "")))
    c = rec.counters
    if first_byte is not None and ifaces:
        first_byte = dataclasses.replace(
            first_byte, interface=ifaces[0].name, elsewhere=c.first_byte_elsewhere,
            note=(f"pools on {ifaces[0].name} only: a flow that leaves by "
                  f"{', '.join(i.name for i in ifaces[1:])} gets its class there after the "
                  "handshake, paced by TCP at its rule's rate until then (guarded)"
                  if len(ifaces) > 1 else ""))
    return DaemonView(
        backend=b.name if b else None,
        backend_reason=sup.reason,
        backend_fell_back=sup.fell_back,
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
        counters=DaemonCounters(
            # the reconciler's whole-number counters by their names (a new one is copied here)
            **{n: getattr(c, n) for n in _COUNTS if hasattr(c, n)},
            # every interface's (issue 29: status' interfaces[] has each one's)
            backend_rebuild_failures=sum(p.rebuild_failures for p in sup.ports()),
            shape_latency=_pcts(c.shape_latency_ns), apply_latency=_pcts(c.apply_latency_ns),
            reconcile_added=rec.table.reconcile_added,
            reconcile_removed=rec.table.reconcile_removed,
            apply_hist=Histogram(*_hist(c.apply_hist.cumulative()))),
        events=EventCounts(**{f"{src}_{kind}": n for (src, kind), n in rec.table.events.items()}),
        groups=tuple(groups),
        receive_interface=rx.interface if rx is not None else None,
        receive_health=sup.rx_health,
        receive_problem=sup.rx_problem,
        first_byte=first_byte,
        backend_wanted=(sup.kind_of(sup._rules).value if sup._rules is not None else ""),
        backend_fallback=sup.fallback,
        interfaces=tuple(ifaces),
        unmanaged=tuple(sorted(sup.unmanaged.items())),
        routed=sup.routed,
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
                    "interface": g.interface or v.interface or "",
                    "classid": g.handle,
                    "rate_bit": g.rate_bps * 8, "ceil_bit": g.ceil_bps * 8,
                    "bytes": st.bytes if st else 0, "packets": st.packets if st else 0,
                    "drops": st.drops if st else 0})
    out.sort(key=lambda x: (x["interface"], x["kind"] != "rule", x["id"]))
    return out


def to_json(v: DaemonView, stats: Dict[StatsKey, ClassStats]) -> dict:
    """The status answer: every flow with its class's counters (``stats``: by ``StatsKey``,
    the supervisor's ``class_stats``)."""
    flows = []
    for f in v.flows:
        st = stats.get(f.stats_key(v.interface or ""))
        flows.append({
            "rule": f.rule, "side": f.side.value, "pid": f.pid, "process": f.process,
            "interface": f.interface or v.interface,
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
    return {
        "backend": v.backend,
        "backend_reason": v.backend_reason,
        "interface": v.interface,
        "backend_state": v.backend_health.value,
        "backend_problem": v.backend_problem,
        "backend_wanted": v.backend_wanted,
        "backend_fallback": v.backend_fallback,
        "link_rate_bit": v.link_rate_bps * 8,
        "link_rate_source": v.interfaces[0].link_rate_source if v.interfaces else "",
        "rules": v.rules_path,
        "flow_source": v.flow_source.text,
        "tracer": _tracer_json(v.tracer),
        "live_flows": v.live_flows,
        "shaped_flows": len(v.flows),
        "healthy": v.healthy,
        "stages": [{"name": s.name, "state": s.state.value, "failures": s.failures,
                    "last_error": s.last_error, "detail": s.detail} for s in v.stages],
        "counters": _counters_json(v.counters, v.events),
        "flows": flows,
        "groups": _groups_json(v, stats),
        "receive": _receive_json(v.receive_interface, v.receive_health, v.receive_problem),
        "first_byte": _first_byte_json(v.first_byte),
        # issue 29: every shaped interface, and the flows a rule shapes that leave by another
        "interfaces": [{"name": i.name, "backend": i.backend, "state": i.health.value,
                        "problem": i.problem, "link_rate_bit": i.link_rate_bps * 8,
                        "link_rate_source": i.link_rate_source,
                        "flows": i.flows, "spare_classes": i.spares,
                        "ready_classes": i.ready_classes, "groups": i.groups,
                        "rebuild_failures": i.rebuild_failures,
                        "receive": _receive_json(i.receive_interface, i.receive_health,
                                                 i.receive_problem)}
                       for i in v.interfaces],
        "routed": v.routed,
        "unmanaged_interface": {
            "count": len(v.unmanaged),
            "flows": [{"local": endpoint(k.local_addr, k.local_port),
                       "remote": endpoint(k.remote_addr, k.remote_port),
                       "protocol": k.protocol.value, "interface": name}
                      for k, name in v.unmanaged[:UNMANAGED_SHOWN]]},
    }


def _receive_json(ifb: Optional[str], health, problem: str) -> Optional[dict]:
    """A receive side's status (issue 17), None when there is none and none is wanted."""
    if not ifb and not problem:
        return None
    return {"interface": ifb or None, "state": health.value, "problem": problem}


def _first_byte_json(fb: Optional[FirstByteView]) -> Optional[dict]:
    if fb is None:
        return None
    return {"pools": [{"rule": p.rule, "ready": p.ready, "claims": p.claims} for p in fb.pools],
            "counters": dict(fb.counters.items()), "ids_held": fb.ids_held,
            "ids_awaiting": fb.ids_awaiting, "interface": fb.interface,
            "elsewhere": fb.elsewhere, "note": fb.note}


def _pcts(samples_ns) -> Percentiles:
    s = sorted(samples_ns)
    if not s:
        return Percentiles()
    pick = lambda p: round(s[min(len(s) - 1, int(p / 100 * (len(s) - 1) + 0.5))] / 1000, 1)
    return Percentiles(len(s), pick(50), pick(90), pick(99), round(s[-1] / 1000, 1))


def _hist(cumulative) -> tuple:
    buckets, total = cumulative
    return tuple((str(b), int(n)) for b, n in buckets), float(total)


def _pcts_json(p: Percentiles) -> dict:
    if not p.n:
        return {"n": 0}
    return {"n": p.n, "p50": p.p50_us, "p90": p.p90_us, "p99": p.p99_us, "max": p.max_us}


def _counters_json(c: DaemonCounters, events: EventCounts) -> dict:
    """Every counter under its own name, latencies as NAME_us (the histogram is for metrics)."""
    out = {}
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if isinstance(value, Percentiles):
            out[f"{f.name}_us"] = _pcts_json(value)
        elif isinstance(value, int):
            out[f.name] = value
    out["events"] = {f"{src}_{kind}": n for src, kind, n in events.items()}
    return out


def _tracer_json(t: Optional[TracerStats]) -> Optional[dict]:
    """``Tracer.stats()``'s own names, as the status answer always gave them."""
    if t is None:
        return None
    return {"hooks": t.hooks, "events": {"open": t.opens, "close": t.closes},
            **{name: getattr(t, name) for name in TracerStats.COUNTS},
            "udp": {name: getattr(t.udp, name) for name in t.udp.__slots__},
            "programs": {p.tracepoint: {k: getattr(p, k) for k in
                                        ("run_time_ns", "run_cnt", "recursion_misses")
                                        if getattr(p, k) is not None} for p in t.programs}}


def parse_reload(answer: dict) -> ReloadResult:
    """``reload_json``'s answer back as a ``ReloadResult``; ValueError for another shape."""
    try:
        errors = answer.get("errors") or []
        if not isinstance(errors, list):
            raise ValueError("errors is not a list")
        return ReloadResult(answer["ok"] is True, tuple(_str(e) for e in errors),
                            rules_changed=bool(answer.get("rules_changed")),
                            switched_backend=bool(answer.get("switched_backend")),
                            added=_int(answer.get("added", 0)),
                            changed=_int(answer.get("changed", 0)),
                            removed=_int(answer.get("removed", 0)))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable reload answer ({type(e).__name__}: {e})") from None


def reload_json(r: ReloadResult) -> dict:
    """The control socket's reload answer."""
    if not r.ok:
        return {"ok": False, "errors": list(r.errors)}
    return {"ok": True, "rules_changed": r.rules_changed, "switched_backend": r.switched_backend,
            "added": r.added, "changed": r.changed, "removed": r.removed,
            "errors": list(r.errors)}


def status_json(v: DaemonView, stats: Dict[StatsKey, ClassStats], *,
                unshaped: Optional[list] = None,
                spare_classids: Optional[Dict[str, list]] = None) -> dict:
    """The control socket's status answer: ``to_json`` and, when asked for, ``unshaped``
    (every live flow without a send class and why: ``explain.unshaped``, ``status --all``) and
    each interface's ``spare_classids`` (``spare_classids``: the spare classes' handles by
    interface name, read under the lock; an interface without an entry gets none)."""
    out = to_json(v, stats)
    if unshaped is not None:
        out["unshaped"] = unshaped
    if spare_classids is not None:
        for i in out["interfaces"]:
            i["spare_classids"] = spare_classids.get(i["name"], [])
    return out




# ------------------------------------------------------------ reading the status answer
# ``flowpacer status`` and ``top`` read the answer ``to_json`` wrote through ``parse_status``
# alone: typed objects, every field checked; an answer of another shape is one ValueError.

@dataclass(frozen=True, slots=True)
class StatusFlow:
    """One flow of a status answer (its class on one side)."""
    key: FlowKey
    rule: str
    side: Side
    pid: int
    process: str                         # from the kernel: escape it to show it
    direction: str                       # "inbound", "outbound", "" (adopted)
    source: str                          # "tracer", "reconcile", ""
    classid: str
    rate_bit: int
    ceil_bit: int
    bytes: int
    packets: int
    drops: int
    client: str = ""                     # its client group (issue 15), "" without client_rate
    client_rate_bit: int = 0
    total_rate_bit: int = 0              # its rule's total_rate, 0 without one
    interface: str = ""                  # the interface it is shaped on (issue 29)


@dataclass(frozen=True, slots=True)
class StatusStage:
    name: str
    state: str
    failures: int
    last_error: str


@dataclass(frozen=True, slots=True)
class StatusFirstByte:
    """First-byte shaping's pools and counters (issue 16) as status shows them."""
    ready: Tuple[Tuple[str, int], ...]   # (rule, ready classes)
    counters: Tuple[Tuple[str, int], ...]
    note: str = ""                       # several interfaces: where the pools are (29)

    def count(self, name: str) -> int:
        return dict(self.counters).get(name, 0)


@dataclass(frozen=True, slots=True)
class StatusAnswer:
    """The control socket's status answer, typed (``parse_status``)."""
    backend: str
    backend_reason: str
    interface: str
    backend_state: str
    backend_problem: str
    rebuild_failures: int
    link_rate_bit: int
    flow_source: str
    live_flows: int
    shaped_flows: int
    flows: Tuple[StatusFlow, ...]
    stages: Tuple[StatusStage, ...] = ()
    receive: Optional[Tuple[str, str, str]] = None    # (ifb, state, problem), issue 17
    first_byte: Optional[StatusFirstByte] = None
    interfaces: Tuple[Tuple[str, str, str], ...] = ()   # (name, backend, state), issue 29
    # (interface, ifb, state, problem) of each interface's receive side (issue 29)
    receives: Tuple[Tuple[str, str, str, str], ...] = ()
    unmanaged: int = 0                   # flows a rule shapes leaving by an unmanaged interface
    link_rate_source: str = ""           # "rules", "speed", a bond and its members (issue 29)
    # (interface, spare classes, ready_classes) where either is set (issue 26)
    spares: Tuple[Tuple[str, int, int], ...] = ()


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"not a number: {value!r}")
    return int(value or 0)


def _str(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        raise ValueError(f"not text: {value!r}")
    return str(value)


def _flow(f: dict) -> StatusFlow:
    if not isinstance(f, dict):
        raise ValueError("a flow is not an object")
    rate = _int(f.get("rate_bit", 0))
    return StatusFlow(
        key=FlowKey.parse(f["local"], f["remote"], _str(f.get("protocol")) or "tcp"),
        rule=_str(f.get("rule")), side=Side(f.get("side") or "send"), pid=_int(f.get("pid", 0)),
        process=_str(f.get("process")), direction=_str(f.get("direction")),
        source=_str(f.get("source")), classid=_str(f.get("classid")), rate_bit=rate,
        ceil_bit=_int(f.get("ceil_bit") or rate), bytes=_int(f.get("bytes", 0)),
        packets=_int(f.get("packets", 0)), drops=_int(f.get("drops", 0)),
        client=_str(f.get("client")), client_rate_bit=_int(f.get("client_rate_bit") or 0),
        total_rate_bit=_int(f.get("total_rate_bit") or 0),
        interface=_str(f.get("interface")))


def parse_status(st: dict) -> StatusAnswer:
    """The status answer (``to_json``'s dict, as the control socket returned it) as typed
    objects; ValueError when it is not one (a daemon of another version, a broken answer)."""
    try:
        if not isinstance(st, dict):
            raise ValueError("not an object")
        flows = tuple(_flow(f) for f in st.get("flows") or ())
        stages = tuple(StatusStage(_str(s["name"]), _str(s["state"]), _int(s.get("failures", 0)),
                                   _str(s.get("last_error")))
                       for s in st.get("stages") or ())
        rx = st.get("receive")
        fb = st.get("first_byte")
        counters = st.get("counters") or {}
        return StatusAnswer(
            backend=_str(st.get("backend")), backend_reason=_str(st.get("backend_reason")),
            interface=_str(st.get("interface")),
            backend_state=_str(st.get("backend_state")) or "ok",
            backend_problem=_str(st.get("backend_problem")),
            rebuild_failures=_int(counters.get("backend_rebuild_failures", 0)),
            link_rate_bit=_int(st.get("link_rate_bit") or 0),
            link_rate_source=_str(st.get("link_rate_source")),
            flow_source=_str(st.get("flow_source")),
            live_flows=_int(st.get("live_flows", 0)),
            shaped_flows=_int(st.get("shaped_flows", len(flows))),
            flows=flows, stages=stages,
            receive=None if not rx else (_str(rx.get("interface")), _str(rx.get("state")),
                                         _str(rx.get("problem"))),
            interfaces=tuple((_str(i["name"]), _str(i.get("backend")), _str(i.get("state")))
                             for i in st.get("interfaces") or ()),
            receives=tuple((_str(i["name"]), _str(i["receive"].get("interface")),
                            _str(i["receive"].get("state")), _str(i["receive"].get("problem")))
                           for i in st.get("interfaces") or () if i.get("receive")),
            unmanaged=_int((st.get("unmanaged_interface") or {}).get("count", 0)),
            spares=tuple((_str(i["name"]), _int(i.get("spare_classes", 0)),
                          _int(i.get("ready_classes", 0)))
                         for i in st.get("interfaces") or ()
                         if i.get("spare_classes") or i.get("ready_classes")),
            first_byte=None if not fb else StatusFirstByte(
                tuple((_str(p["rule"]), _int(p["ready"])) for p in fb.get("pools") or ()),
                tuple((_str(k), _int(n)) for k, n in (fb.get("counters") or {}).items()),
                _str(fb.get("note"))))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable status answer ({type(e).__name__}: {e})") from None


# ------------------------------------------------------- explain and unshaped flows (issue 28)
# ``flowpacer explain`` and ``status --all``: the engine's own walk (``engine.explain``) and the
# first-byte program's (``handshake.first_byte``), written out here for both the daemon's
# answer (a live flow) and the command's offline one (a described flow), read back by
# ``parse_explain``.

def why_unshaped(expl, sends_ok: bool, health: str = "ok") -> str:
    """Why a live flow has no send class, from its ``engine.Explanation``; ``sends_ok``:
    whether the send backend can take classes now (``health`` says what it is otherwise)."""
    f = expl.flow
    if f.proc.pid == 0 and not f.proc.comm:
        return "its owner is not known yet (sock_diag found it before the tracer or /proc did)"
    r = expl.rule
    if r is None:
        return "no rule matches it"
    if not r.sends:
        return f"rule {r.name!r} matches and is receive-only: what the flow is sent is not shaped"
    if not sends_ok:
        return (f"rule {r.name!r} matches but the backend is {health}: no class until it is "
                "rebuilt")
    return (f"rule {r.name!r} matches but the flow has no class yet (it gets one at the next "
            "pass, or adding it failed: see the log)")


def _flow_json(flow) -> dict:
    k, p = flow.key, flow.proc
    return {"local": endpoint(k.local_addr, k.local_port),
            "remote": endpoint(k.remote_addr, k.remote_port), "protocol": k.protocol.value,
            "direction": flow.direction.value, "pid": p.pid, "process": p.comm, "exe": p.exe,
            "uid": p.uid, "source": flow.source.value}


def unshaped_json(flow, reason: str) -> dict:
    """One live flow without a send class, for ``status --all``."""
    return {**_flow_json(flow), "reason": reason}


def explain_json(expl, first_byte: Tuple[bool, str], classes=(), unshaped: str = "") -> dict:
    """One flow's explanation: ``expl`` (``engine.explain``), the first-byte verdict
    (``handshake.first_byte``), for a live flow its classes (status flow entries) and, when it
    has no send class, why."""
    r = expl.rule
    return {
        **_flow_json(expl.flow),
        "unknown": sorted(expl.unknown),
        "rule": r.name if r else None, "rule_line": r.line if r else 0,
        "sends": bool(r and r.sends), "receives": bool(r and r.receive_rate_bps is not None),
        "rate_bit": r.rate_bps * 8 if r and r.rate_bps else 0,
        "passed": [{"rule": p.name, "line": p.line, "fails": list(fails),
                    "undecided": expl.undecided(fails)} for p, fails in expl.passed],
        "first_byte": {"yes": first_byte[0], "why": first_byte[1]},
        "classes": list(classes),
        "unshaped": unshaped,
    }


@dataclass(frozen=True, slots=True)
class ExplainedRule:
    rule: str
    line: int
    fails: Tuple[str, ...]
    undecided: bool            # fails only on fields a described flow did not give


@dataclass(frozen=True, slots=True)
class Explained:
    """One flow of an explain answer, typed (``parse_explain``)."""
    local: str
    remote: str
    protocol: str
    direction: str
    pid: int
    process: str
    exe: str
    uid: int
    unknown: Tuple[str, ...]
    rule: Optional[str]
    rule_line: int
    sends: bool
    receives: bool
    rate_bit: int
    passed: Tuple[ExplainedRule, ...]
    first_byte: bool
    first_byte_why: str
    classes: Tuple[StatusFlow, ...]
    unshaped: str


def _explained(e: dict) -> Explained:
    if not isinstance(e, dict):
        raise ValueError("an explained flow is not an object")
    fb = e.get("first_byte") or {}
    rule = e.get("rule")
    return Explained(
        local=_str(e.get("local")), remote=_str(e.get("remote")),
        protocol=_str(e.get("protocol")), direction=_str(e.get("direction")),
        pid=_int(e.get("pid", 0)), process=_str(e.get("process")), exe=_str(e.get("exe")),
        uid=_int(e.get("uid", -1)), unknown=tuple(_str(u) for u in e.get("unknown") or ()),
        rule=None if rule is None else _str(rule), rule_line=_int(e.get("rule_line", 0)),
        sends=e.get("sends") is True, receives=e.get("receives") is True,
        rate_bit=_int(e.get("rate_bit", 0)),
        passed=tuple(ExplainedRule(_str(p["rule"]), _int(p.get("line", 0)),
                                   tuple(_str(x) for x in p.get("fails") or ()),
                                   p.get("undecided") is True) for p in e.get("passed") or ()),
        first_byte=fb.get("yes") is True, first_byte_why=_str(fb.get("why")),
        classes=tuple(_flow(c) for c in e.get("classes") or ()),
        unshaped=_str(e.get("unshaped")))


def parse_explain(answer: dict) -> Tuple[Explained, ...]:
    """The explain answer (``{"flows": [explain_json ...]}``) as typed objects; ValueError
    for another shape."""
    try:
        if not isinstance(answer, dict) or not isinstance(answer.get("flows"), list):
            raise ValueError("no flows in the answer")
        return tuple(_explained(e) for e in answer["flows"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable explain answer ({type(e).__name__}: {e})") from None


def parse_unshaped(st: dict) -> Tuple[Tuple[FlowKey, int, str, str, str], ...]:
    """``status --all``'s unshaped flows: (key, pid, process, direction, reason)."""
    try:
        out = []
        for u in st.get("unshaped") or ():
            if not isinstance(u, dict):
                raise ValueError("an unshaped flow is not an object")
            out.append((FlowKey.parse(u["local"], u["remote"], _str(u.get("protocol")) or "tcp"),
                        _int(u.get("pid", 0)), _str(u.get("process")), _str(u.get("direction")),
                        _str(u.get("reason"))))
        return tuple(out)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable status answer ({type(e).__name__}: {e})") from None
