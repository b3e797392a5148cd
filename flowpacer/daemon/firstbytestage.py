"""The first-byte stage (issue 16): classes claimed in the kernel at the handshake
(``sources/firstbyte.py``), in a supervised ``Stage`` of its own.

A loop of rounds: ``poll`` -> ``report`` -> the reconciler's ``on_claims`` -> ``granted``. Only
``on_claims`` holds the reconciler's lock. When the stage gives up, first-byte shaping stops and
flows get their class after the handshake, as without it. The composition root (``app.py``)
builds it, hands it the reconciler when the stages start, reads ``firstbyte`` (the source, None
when it does not run) for its view and closes it on shutdown.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

from flowpacer.daemon.memory import release_compiler_memory
from flowpacer.daemon.stages import GiveUp, Stage, StageContext
from flowpacer.errors import TracerUnavailable

log = logging.getLogger(__name__)


def real_firstbyte():
    """The kernel's first-byte programs, with ``FLOWPACER_FIRST_BYTE_POOL`` ready classes per
    rule when it is set (a bad value: the default, with a warning)."""
    from flowpacer.sources.firstbyte import POOL_ENV, POOL_TARGET, FirstByte
    raw = os.environ.get("FLOWPACER_FIRST_BYTE_POOL", "")
    try:
        return FirstByte(pool_target=int(raw) if raw.strip() else POOL_TARGET)
    except ValueError as e:
        log.warning("%s=%r ignored (%s): %d ready classes per rule", POOL_ENV, raw, e,
                    POOL_TARGET)
        return FirstByte()


class FirstByteStage:
    """``factory``: makes the first-byte source (``real_firstbyte``, a fake in tests; None: no
    first-byte shaping, as with the fakes' tracer); ``make_stage``: the daemon's stage builder;
    ``tracer``: false with ``--no-tracer`` (first-byte shaping then does not run either);
    ``enabled``: false with ``FLOWPACER_NO_FIRST_BYTE`` (benchmarks' "before" figures)."""

    def __init__(self, factory: Optional[Callable[[], object]],
                 make_stage: Callable[..., Stage], *, tracer: bool, enabled: bool):
        self._factory = factory
        self._make_stage = make_stage
        self._tracer = tracer
        self._enabled = enabled
        self._rec = None
        self.firstbyte = None

    def stage(self, rec) -> Stage:
        """Start first-byte shaping for the reconciler ``rec`` and make its first round (the
        pools): its supervised stage, or a disabled one saying why it does not run."""
        self._rec = rec
        if not self._tracer or self._factory is None:
            return Stage.disabled("firstbyte", "no tracer")
        if not self._enabled:     # benchmarks' "before" figures
            return Stage.disabled("firstbyte", "FLOWPACER_NO_FIRST_BYTE")
        try:
            fb = self._factory()
            fb.start()
        except (ImportError, TracerUnavailable, OSError) as e:
            log.warning("first-byte shaping unavailable (%s): flows get their class after "
                        "the handshake", e)
            return Stage.disabled("firstbyte", f"unavailable: {e}")
        finally:
            # its compile came after the tracer's release: ~54 MB of LLVM heap and library
            # pages stayed resident (idle RSS 121 MB instead of 67 since first-byte shaping)
            release_compiler_memory()
        self.firstbyte = fb
        self._round(fb, [])
        return self._make_stage("firstbyte", self._run, GiveUp.DEGRADE, stall_s=10.0,
                                on_degrade=self._degraded)

    def _run(self, ctx: StageContext) -> None:
        fb = self.firstbyte
        while not ctx.stopping():
            claims = fb.poll(100)
            ctx.beat()
            self._round(fb, claims)

    def _round(self, fb, claims) -> None:
        """The claims to the reconciler as events, the pools' ids back to the source. Only
        ``on_claims`` holds the reconciler's lock; the source's drains, sweeps and map writes
        run outside it. A new bookkeeping (start, rebuild) or new rules take a second round
        at once: the pools are made anew."""
        for _ in range(3):
            grant = self._rec.on_claims(fb.report(claims))
            claims = []
            if not fb.granted(grant):
                return

    def _degraded(self, stage: Stage, why: str) -> None:
        if self.firstbyte is not None:
            log.error("first-byte shaping stopped (%s): flows get their class after the "
                      "handshake", why)
            fb, self.firstbyte = self.firstbyte, None
            self._close(fb)

    def close(self) -> None:
        """On shutdown (the source stays in ``firstbyte``, stopped)."""
        if self.firstbyte is not None:
            self._close(self.firstbyte)

    def _close(self, fb) -> None:
        """Detach (the drain's wait outside the reconciler's lock), then the ready classes
        taken back are deleted by the reconciler's one writer."""
        try:
            last = fb.close()
            if last is not None:
                self._rec.on_claims(last)
        except Exception as e:
            log.warning("first byte close: %s", e)
