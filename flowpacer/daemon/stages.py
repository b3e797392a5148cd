"""Supervised stages: every long-running loop of the daemon runs under a ``Stage``.

A stage is a callable ``run(ctx)`` that loops until ``ctx.stopping()``, calls ``ctx.beat()`` at
least every ``beat_s`` seconds and returns when asked to stop. The supervisor:

- logs an exception that escapes ``run`` with its traceback the first time that error is seen
  (the same error again: one line with its count), counts it (``failures``, exported as
  ``flowpacer_stage_failures_total{stage}``) and starts ``run`` again after a back-off that
  doubles from ``backoff_s[0]`` up to ``backoff_s[1]``;
- a ``run`` that returns while nobody asked it to stop is a failure too;
- after ``give_up`` failures within ``window_s`` it gives up: ``GiveUp.DEGRADE`` leaves the
  stage ``DEGRADED`` (the daemon carries on without it and says so), ``GiveUp.EXIT`` marks it
  ``FAILED`` and calls ``on_fatal`` (the daemon stops and exits non-zero, so that systemd's
  ``Restart=on-failure`` starts it again and the new process adopts the live flows);
- ``watchdog_ok()`` is what the systemd watchdog is fed on: false while a stage that should be
  running has not beaten within ``stall_s`` (hung), so that systemd restarts a stuck daemon.

Threads are started by ``start()``; the main loop runs in the main thread via ``run_here()``.
The clock is injected so that back-off and stall detection are tested without waiting.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
import traceback
from collections import deque
from typing import Callable, Optional

from flowpacer.model import StageState, StageView

log = logging.getLogger(__name__)


class GiveUp(enum.Enum):
    DEGRADE = "degrade"
    EXIT = "exit"


class StageContext:
    """What a stage's ``run`` sees of its supervisor."""

    def __init__(self, stage: "Stage"):
        self._stage = stage

    def stopping(self) -> bool:
        return self._stage._stop.is_set()

    def beat(self) -> None:
        self._stage._last_beat = self._stage.clock()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, or until asked to stop; True when stopping."""
        return self._stage._stop.wait(seconds)


class Stage:
    def __init__(self, name: str, run: Callable[[StageContext], None], *,
                 give_up: int = 5, window_s: float = 60.0, backoff_s=(0.2, 10.0),
                 on_give_up: GiveUp = GiveUp.DEGRADE,
                 on_degrade: Optional[Callable[["Stage", str], None]] = None,
                 on_fatal: Optional[Callable[["Stage", str], None]] = None,
                 stall_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 stop_event: Optional[threading.Event] = None):
        self.name = name
        self._run = run
        self.give_up = give_up
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.on_give_up = on_give_up
        self.on_degrade = on_degrade
        self.on_fatal = on_fatal
        self.stall_s = stall_s
        self.clock = clock
        self._stop = stop_event or threading.Event()
        self.state = StageState.STARTING
        self.failures = 0
        self.last_error = ""
        self.detail = ""
        self._recent: deque = deque()          # failure times within the window
        self._seen: dict = {}                  # error text -> times seen (traceback once)
        self._last_beat = clock()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    @classmethod
    def disabled(cls, name: str, why: str) -> "Stage":
        s = cls(name, lambda ctx: None)
        s.state = StageState.DISABLED
        s.detail = why
        return s

    # ------------------------------------------------------------- running
    def begin(self) -> None:
        """The stage's work has begun in its thread: it is running from now on, not starting
        (a status read between a thread's start and its first instruction, or before the main
        thread enters ``run_here``, must not call a live stage "starting")."""
        with self._lock:
            if self.state is StageState.STARTING:
                self.state = StageState.RUNNING
        self._last_beat = self.clock()

    def start(self) -> "Stage":
        if self.state is StageState.DISABLED:
            return self
        self.begin()
        self._thread = threading.Thread(target=self.run_here, name=self.name, daemon=True)
        self._thread.start()
        return self

    def run_here(self) -> None:
        """Run the stage in the calling thread until it stops or is given up."""
        ctx = StageContext(self)
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            self._set(StageState.RUNNING)
            self._last_beat = self.clock()
            try:
                self._run(ctx)
            except Exception as e:     # the point of a supervisor: nothing escapes unseen
                err = f"{type(e).__name__}: {e}"
                tb = traceback.format_exc()
            else:
                if self._stop.is_set():
                    break
                err, tb = "returned while not asked to stop", ""
            if not self._failed(err, tb):
                return
            self._set(StageState.RESTARTING)
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self.backoff_s[1])
        self._set(StageState.STOPPED)

    def _failed(self, err: str, tb: str) -> bool:
        """Count and log one failure; False when the stage is given up."""
        now = self.clock()
        with self._lock:
            self.failures += 1
            self.last_error = err
            self._recent.append(now)
            while self._recent and now - self._recent[0] > self.window_s:
                self._recent.popleft()
            recent = len(self._recent)
            n = self._seen.get(err, 0) + 1
            self._seen[err] = n
        if n == 1:
            log.error("stage %s failed: %s\n%s", self.name, err, tb.rstrip())
        else:
            log.error("stage %s failed again (%d times): %s", self.name, n, err)
        if recent < self.give_up:
            return True
        why = f"{recent} failures in {self.window_s:.0f} s, last: {err}"
        if self.on_give_up is GiveUp.DEGRADE:
            self._set(StageState.DEGRADED)
            self.detail = why
            log.error("stage %s given up (%s): the daemon carries on without it", self.name, why)
            if self.on_degrade is not None:
                self.on_degrade(self, why)
        else:
            self._set(StageState.FAILED)
            self.detail = why
            log.critical("stage %s given up (%s): stopping so that the service manager "
                         "restarts flowpacer", self.name, why)
            if self.on_fatal is not None:
                self.on_fatal(self, why)
        return False

    def _set(self, state: StageState) -> None:
        with self._lock:
            self.state = state

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # -------------------------------------------------------------- health
    def stalled(self) -> bool:
        return (self.state is StageState.RUNNING
                and self.clock() - self._last_beat > self.stall_s)

    def view(self) -> StageView:
        state = StageState.STALLED if self.stalled() else self.state
        return StageView(self.name, state, self.failures, self.last_error, self.detail)


def watchdog_ok(stages) -> bool:
    """Feed systemd's watchdog only while no stage is hung, failed or stopped. A stage in
    back-off, or given up with a visible degradation, is not hung: the daemon is doing what it
    says it does."""
    return all(s.view().state in (StageState.RUNNING, StageState.RESTARTING, StageState.DEGRADED,
                                  StageState.DISABLED) for s in stages)
