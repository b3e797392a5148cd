"""What the control socket answers to "why": ``explain`` for live flows and ``status --all``'s
unshaped flows (issue 28). The rule walk is the engine's own (``engine.explain``) and the
first-byte verdict the handshake compiler's (``handshake.first_byte``): no second matcher here.
Read under the daemon's lock; the kernel's counters come from the status answer, after it."""
from __future__ import annotations

from typing import Callable

from flowpacer.errors import FlowpacerError
from flowpacer.model import FlowKey, Protocol, endpoint
from flowpacer.policy import engine, handshake
from flowpacer.surfaces import view as views

MAX_EXPLAIN = 32        # flows in one explain answer (the rest are counted)
_FILTER_KEYS = ("local_addr", "local_port", "remote_addr", "remote_port", "protocol")


def flow_filter(req: dict) -> Callable[[FlowKey], bool]:
    """An explain request's addresses, ports and protocol -> a test of a flow's key (addresses
    as on the wire: an IPv4-mapped one is its IPv4 address). FlowpacerError for a bad one."""
    want = {k: req[k] for k in _FILTER_KEYS if req.get(k) not in (None, "")}
    if not want:
        raise FlowpacerError("explain: give at least one of " + ", ".join(_FILTER_KEYS))
    try:
        addrs = {k: FlowKey.wire_address(str(want[k])) for k in ("local_addr", "remote_addr")
                 if k in want}
        ports = {}
        for k in ("local_port", "remote_port"):
            if k in want:
                v = want[k]
                if isinstance(v, bool) or not isinstance(v, (int, str)) or \
                        not str(v).isdigit() or not 0 < int(v) < 65536:
                    raise ValueError(f"{k} {v!r} is not a port")
                ports[k] = int(v)
        proto = Protocol(str(want["protocol"])) if "protocol" in want else None
    except ValueError as e:
        raise FlowpacerError(f"explain: {e}") from None

    def test(key: FlowKey) -> bool:
        return (addrs.get("local_addr", key.local_addr) == key.local_addr
                and addrs.get("remote_addr", key.remote_addr) == key.remote_addr
                and ports.get("local_port", key.local_port) == key.local_port
                and ports.get("remote_port", key.remote_port) == key.remote_port
                and (proto in (None, Protocol.ANY) or proto is key.protocol))
    return test


def _classed(supervisor, key: FlowKey) -> bool:
    """Whether ``key`` has a send class on one of the interfaces (issue 29)."""
    return any(p.backend is not None and p.backend.shape_of(key) is not None
               for p in supervisor.ports())


def _why(supervisor, key: FlowKey, e, ok: bool, health: str) -> str:
    unmanaged = supervisor.unmanaged
    if key in unmanaged:
        name = unmanaged[key]
        return (f"it leaves by {name}, an interface flowpacer does not shape" if name
                else "it has no route (no interface to shape it on)")
    return views.why_unshaped(e, ok, health)


def unshaped(lock, reconciler, supervisor) -> list:
    """Each live flow without a send class and why (the engine's walk, ``engine.explain``)."""
    with lock:
        rs = reconciler.rules
        ok, health = supervisor.usable, supervisor.health.value
        out = []
        for key, flow in sorted(reconciler.table.flows.items()):
            if _classed(supervisor, key):
                continue
            why = _why(supervisor, key, engine.explain(rs.rules, flow), ok, health)
            out.append(views.unshaped_json(flow, why))
        return out

def live(req: dict, lock, reconciler, supervisor, status: Callable[[], dict]) -> dict:
    """The control socket's explain answer (``status``: the daemon's status answer): the live flows with the addresses and ports
    asked (``local_addr``, ``local_port``, ``remote_addr``, ``remote_port``, ``protocol``:
    any of them, at least one), at most ``MAX_EXPLAIN``, each with the rule it gets and
    why, whether the kernel shapes it from the first byte, its classes and counters."""
    wanted = flow_filter(req)
    with lock:
        rs = reconciler.rules
        found = [f for k, f in sorted(reconciler.table.flows.items()) if wanted(k)]
        classed = {f.key for f in found if _classed(supervisor, f.key)}
        ok, health = supervisor.usable, supervisor.health.value
        whys = {f.key: _why(supervisor, f.key, engine.explain(rs.rules, f), ok, health)
                for f in found[:MAX_EXPLAIN] if f.key not in classed}
    shown = found[:MAX_EXPLAIN]
    compiled = handshake.compile_rules(rs) if shown else None
    classes: dict = {}
    if shown:
        for c in status()["flows"]:
            classes.setdefault((c["local"], c["remote"], c["protocol"]), []).append(c)
    out = []
    for f in shown:
        e = engine.explain(rs.rules, f)
        mine = classes.get((endpoint(f.key.local_addr, f.key.local_port),
                            endpoint(f.key.remote_addr, f.key.remote_port),
                            f.key.protocol.value), [])
        why = whys.get(f.key, "")
        out.append(views.explain_json(e, handshake.first_byte(rs, f, compiled), mine, why))
    return {"flows": out, "matched": len(found)}
