"""What the daemon asks of its flow sources, declared once (issue 25: capabilities declared,
not probed with ``getattr``).

``FlowTracer`` is the event source (``tracer.Tracer``: bcc programs on the tracepoints and the
cgroup hooks); ``SnapshotSource`` the polled one (``sockdiag.SockDiagSource``), whose answer is
always a ``Snapshot``, with the UDP facts beside the flows. The test kit's stand-ins
(``harness/fakes.py``) keep the same contracts; ``tests/test_sources_contract.py`` checks the
real classes and the stand-ins against these declarations.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Protocol

from flowpacer.model import Flow, FlowEvent
from flowpacer.sources.sockdiag import Snapshot

__all__ = ["FlowTracer", "SnapshotSource", "Snapshot"]


class FlowTracer(Protocol):
    """OPEN/CLOSE events of the watched processes' flows, from the kernel."""

    hooks: str          # what it is attached to, for status ("tracepoints + ...")

    def set_watch(self, comms: Optional[Iterable[str]], uids: Optional[Iterable[int]]) -> None:
        """Which processes' flows to report (None: any); before ``start`` and at each reload."""

    def set_udp_idle(self, shortest_ns: int, longest_ns: int) -> None:
        """The rules' UDP idle timeouts: a connected UDP socket silent this long is CLOSEd."""

    def start(self) -> None:
        """Load and attach; raises ``TracerUnavailable`` (or ImportError) when it cannot."""

    def poll(self, timeout_ms: int) -> List[FlowEvent]:
        """The events since the last poll, waiting up to ``timeout_ms`` for one."""

    def adopt_udp_connected(self, socks: Dict[int, Flow]) -> None:
        """Connected UDP sockets opened before it started, by socket cookie: followed (and
        ended by idleness) as if it had seen them open."""

    def stats(self) -> dict:
        """Its counters (``model.TracerStats.from_dict`` reads them)."""

    def close(self) -> None:
        """Detach and free its programs and maps."""


class SnapshotSource(Protocol):
    """Every current flow of this network namespace, listed on demand."""

    def snapshot(self) -> Snapshot:
        """FlowKey -> Flow now, with the unconnected UDP sockets' local ports and the connected
        ones' cookies."""
