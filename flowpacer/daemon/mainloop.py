"""The main stage's loop (``app.py`` wires it): wakes on a signal, a fatal stage or its tick;
SIGHUP reloads, SIGTERM/SIGINT stop; every ``rescan_s`` one reconcile pass (the sock_diag
snapshot taken outside the reconciler's lock, then ``Reconciler.reconcile``), the freed heap
handed back every ``TRIM_S``; systemd's watchdog (``WATCHDOG_USEC``) fed only while every stage
is alive (``stages.watchdog_ok``), and said once when it is withheld and once when it is fed
again. An RTNL link event of a shaped interface or a device below it (``links``: a bond member
down or up changes the bond's link rate, which the pass's health check follows; issue 29)
starts a pass at once and one more ``LINK_FOLLOWUP_S`` later.
"""
from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections import deque
from typing import Callable, Iterable, Optional

from flowpacer.daemon.memory import trim_heap
from flowpacer.daemon.stages import StageContext, watchdog_ok

log = logging.getLogger(__name__)

FILL_GAP_S = 0.005    # between two batches of ready spare classes (issue 26)
TRIM_S = 10.0          # how often freed heap is handed back (a few ms each time)
MAIN_TICK_S = 0.5      # the main loop wakes at least this often (beats, watchdog)
LINK_MIN_GAP_S = 0.2   # link events start a pass at most this often
LINK_FOLLOWUP_S = 1.0  # and one more pass this much later (a bond's view of a member may lag
#                        the member's own event by its miimon interval)


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.debug("sd_notify: %s", e)


def watchdog_interval_s() -> Optional[float]:
    """Half of systemd's WatchdogSec= (WATCHDOG_USEC, for this process), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


class MainLoop:
    """``run(ctx)`` is the main stage's body. ``reconciler`` and ``sockdiag`` are the pass's
    inputs; ``reload`` is called for SIGHUP; ``stages`` gives the stages the watchdog asks
    about; ``stop`` is the daemon's stop event (set here for SIGTERM/SIGINT)."""

    def __init__(self, reconciler, sockdiag, *, rescan_s: float, reload: Callable[[], object],
                 stages: Callable[[], Iterable], stop: threading.Event,
                 notify: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 links=None, watched: Callable[[], Iterable[str]] = tuple):
        """``links``: a ``kernel/linkwatch.LinkWatch`` (or None: no link events, the health
        check runs at every pass only); ``watched``: the device names whose events start a
        pass (the shaped interfaces and the devices below them)."""
        self.reconciler = reconciler
        self.sockdiag = sockdiag
        self.rescan_s = rescan_s
        self._reload = reload
        self._stages = stages
        self._stop = stop
        self._notify = notify
        self.clock = clock
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._signals: deque = deque()
        self._next_scan = 0.0
        self._next_trim = 0.0
        self._next_watchdog = 0.0
        self._watchdog_s = watchdog_interval_s()
        self._watchdog_withheld = False
        self.links = links
        self._watched = watched
        self._last_scan = float("-inf")
        self._link_followup: Optional[float] = None
        self._next_fill: Optional[float] = None   # the next batch of ready spares (issue 26)
        self.link_passes = 0           # passes started by a link event (and their follow-ups)

    # ------------------------------------------------------------ signals
    def catch_signals(self) -> None:
        """SIGHUP, SIGTERM and SIGINT queue here and wake the loop (main thread only)."""
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)

    def wake(self) -> None:
        """From any thread: the loop looks at once (a fatal stage, a stop)."""
        with contextlib.suppress(OSError):      # closed at shutdown, or full: it wakes anyway
            os.write(self._wake_w, b"x")

    def _drain_signals(self) -> None:
        while self._signals:
            sig = self._signals.popleft()
            if sig == signal.SIGHUP:
                self._reload()
            else:
                log.info("signal %d: stopping", sig)
                self._stop.set()

    # --------------------------------------------------------------- loop
    def run(self, ctx: StageContext) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self.links is not None:
            sel.register(self.links, selectors.EVENT_READ, "links")
        try:
            while not ctx.stopping():
                now = self.clock()
                timeout = min(MAIN_TICK_S, max(0.0, self._next_scan - now))
                if self._link_followup is not None:
                    timeout = min(timeout, max(0.0, self._link_followup - now))
                if self._next_fill is not None:
                    timeout = min(timeout, max(0.0, self._next_fill - now))
                for key, _ev in sel.select(timeout):
                    if key.data == "links":
                        if not self.on_links():
                            sel.unregister(key.fileobj)
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                ctx.beat()
                self.link_followup_due()
                self._drain_signals()
                if self.clock() >= self._next_scan:
                    self.rescan()
                elif self._next_fill is not None and self.clock() >= self._next_fill:
                    self.fill_spares()
                self._feed_watchdog()
        finally:
            sel.close()

    def on_links(self) -> bool:
        """Link events are queued: a pass soon (at most every LINK_MIN_GAP_S after the last)
        and one more LINK_FOLLOWUP_S later, when one concerns a watched device (or events were
        lost). False when the events cannot be read any more (the pass still checks)."""
        from flowpacer.kernel.linkwatch import OVERFLOW
        try:
            names = self.links.drain()
        except OSError as e:
            log.warning("link events: %s; link rates are checked at every pass only", e)
            return False
        if not names:
            return True
        hit = {OVERFLOW} if OVERFLOW in names else names & set(self._watched())
        if not hit:
            return True
        now = self.clock()
        log.debug("link events of %s: checking the link rates", ", ".join(sorted(hit)))
        self._next_scan = min(self._next_scan, max(now, self._last_scan + LINK_MIN_GAP_S))
        self._link_followup = now + LINK_FOLLOWUP_S
        self.link_passes += 1
        return True

    def link_followup_due(self) -> None:
        """The pass LINK_FOLLOWUP_S after a link event, when that time has come."""
        if self._link_followup is not None and self.clock() >= self._link_followup:
            self._link_followup = None
            self._next_scan = min(self._next_scan, self.clock())
            self.link_passes += 1

    def rescan(self) -> None:
        """One reconcile pass now: the snapshot outside the lock, then the reconciler's."""
        started = time.monotonic_ns()
        self._last_scan = self.clock()
        try:
            snap = self.sockdiag.snapshot()          # outside the lock: events keep flowing
        except Exception as e:  # never let a scan failure stop the daemon
            log.warning("sock_diag scan failed: %s", e)
            snap = None
        rec = self.reconciler
        rec.reconcile(snap, started)
        now = self.clock()
        if rec.resync_requested:
            rec.resync_requested = False
            self._next_scan = now
        else:
            self._next_scan = now + self.rescan_s
        if now >= self._next_trim:
            self._next_trim = now + TRIM_S
            trim_heap()
        self.fill_spares()

    def fill_spares(self) -> None:
        """One batch of ready spare classes (issue 26), and the next one FILL_GAP_S later while
        more are wanted: the lock is free in between, for the flows' events."""
        more = self.reconciler.fill_spares()
        self._next_fill = self.clock() + FILL_GAP_S if more else None

    def _feed_watchdog(self) -> None:
        if self._watchdog_s is None:
            return
        now = self.clock()
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + self._watchdog_s
        stages = list(self._stages())
        if watchdog_ok(stages):
            if self._watchdog_withheld:
                log.warning("every stage is alive again: feeding the watchdog")
            self._watchdog_withheld = False
            self._notify("WATCHDOG=1")
        elif not self._watchdog_withheld:
            self._watchdog_withheld = True
            bad = [f"{s.name} {s.view().state.value}" for s in stages if not watchdog_ok([s])]
            log.error("not feeding the watchdog: %s", ", ".join(bad))

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.links is not None:
            self.links.close()
