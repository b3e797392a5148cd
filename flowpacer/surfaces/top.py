"""``flowpacer top``: a live view of the shaped flows, like iftop, through the control socket.

Every ``interval`` seconds it asks the daemon for its status; a flow's actual rate is the growth
of its class's byte counter since the previous answer divided by the time between the two
answers. Flows are sorted by actual rate, with a steadier 10 s average beside it;
per-rule totals come first. When the daemon does not
answer, the view says so and keeps asking. ``q`` quits.

The view is built by pure functions (``Tracker.update`` -> ``View``, ``render(view, w, h)`` ->
lines) so that it can be tested without a terminal; ``run_top`` is the curses loop around them.
Strings from the daemon (process names come from the kernel) are shown escaped: ASCII only.
"""
from __future__ import annotations

import curses
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from flowpacer.surfaces import control
from flowpacer.model import Side
from flowpacer.surfaces.view import StatusAnswer, parse_status
from flowpacer.errors import FlowpacerError
from flowpacer.text import ascii_only
from flowpacer.units import format_bit_rate, format_bytes

log = logging.getLogger(__name__)

MIN_WIDTH, MIN_HEIGHT = 20, 3


@dataclass
class Row:
    rule: str
    pid: int
    process: str
    local: str
    remote: str
    rate_bit: int
    ceil_bit: int
    bytes: int
    actual_bit: Optional[float]          # None until two answers were seen
    avg_bit: Optional[float] = None      # over up to Tracker.AVG_S seconds
    client: str = ""                     # its client group (issue 15), "" without client_rate
    client_rate_bit: int = 0


@dataclass
class RuleTotal:
    rule: str
    flows: int = 0
    actual_bit: float = 0.0
    avg_bit: float = 0.0
    target_bit: int = 0
    bytes: int = 0
    total_rate_bit: int = 0              # the rule's total_rate (issue 15), 0 without one


@dataclass
class View:
    header: str = ""
    status: str = ""
    error: str = ""                      # "daemon not answering ..." (shown instead of status)
    rows: List[Row] = field(default_factory=list)
    totals: List[RuleTotal] = field(default_factory=list)


class Tracker:
    """Turns successive status answers into rows with actual rates.

    ``actual`` is the byte growth between the last two answers over the time between them (the
    answer's time is the middle of its request, when the daemon read the counters); ``avg`` is
    the same over up to the last ``AVG_S`` seconds, steadier than one refresh (a class's counter
    grows by whole, possibly GSO-sized, packets)."""

    AVG_S = 10.0

    def __init__(self, socket_path: str, interval: float):
        self.socket_path = socket_path
        self.interval = interval
        self._hist: Dict[tuple, Deque[Tuple[float, int]]] = {}

    def _title(self) -> str:
        return f"flowpacer top - every {self.interval:g} s - q quits"

    def failed(self, reason: str) -> View:
        """The daemon did not answer: say so; earlier byte counts are forgotten."""
        self._hist.clear()
        where = "" if self.socket_path in reason else f" on {self.socket_path}"
        return View(header=self._title(),
                    error=f"daemon not answering{ascii_only(where)}: {ascii_only(reason)} - "
                          f"retrying every {self.interval:g} s")

    def update(self, st: dict, now: float) -> View:
        """A view of status answer ``st`` received at monotonic time ``now``."""
        try:
            answer = parse_status(st)
        except ValueError:
            return self.failed("unreadable status answer")
        return self._update(answer, now)

    def _update(self, st: StatusAnswer, now: float) -> View:
        rows: List[Row] = []
        totals_cap: Dict[str, int] = {}
        hist: Dict[tuple, Deque[Tuple[float, int]]] = {}
        for f in st.flows:
            # a flow may have a class on each side, and move to another interface (issue 29)
            key = (f.key, f.interface, f.classid, f.side)
            nbytes = f.bytes
            h = self._hist.get(key)
            if h is None or nbytes < h[-1][1] or now <= h[-1][0]:
                h = deque()                  # new flow, or its class was made anew
            h.append((now, nbytes))
            while len(h) > 2 and now - h[1][0] >= self.AVG_S:
                h.popleft()
            hist[key] = h
            actual = avg = None
            if len(h) >= 2:
                actual = (h[-1][1] - h[-2][1]) * 8 / (h[-1][0] - h[-2][0])
                avg = (h[-1][1] - h[0][1]) * 8 / (h[-1][0] - h[0][0])
            # receive classes (issue 17) count apart: "RULE (receive)" rows and totals
            rule = f.rule + (" (receive)" if f.side is Side.RECEIVE else "")
            local, remote = f.key.endpoints()
            rows.append(Row(rule=ascii_only(rule), pid=f.pid, process=ascii_only(f.process),
                            local=local, remote=remote, rate_bit=f.rate_bit,
                            ceil_bit=f.ceil_bit, bytes=nbytes, actual_bit=actual, avg_bit=avg,
                            client=ascii_only(f.client), client_rate_bit=f.client_rate_bit))
            totals_cap[rows[-1].rule] = f.total_rate_bit
        self._hist = hist
        rows.sort(key=lambda r: (r.actual_bit is None, -(r.actual_bit or 0.0), -(r.avg_bit or 0.0),
                                 -r.bytes, r.rule, r.local, r.remote))
        totals: Dict[str, RuleTotal] = {}
        for r in rows:
            t = totals.setdefault(r.rule, RuleTotal(r.rule))
            t.flows += 1
            t.actual_bit += r.actual_bit or 0.0
            t.avg_bit += r.avg_bit or 0.0
            t.target_bit += r.rate_bit
            t.bytes += r.bytes
            t.total_rate_bit = totals_cap.get(r.rule, 0)
        link = format_bit_rate(st.link_rate_bit)
        where = (", ".join(ascii_only(n) for n, _b, _s in st.interfaces)
                 if len(st.interfaces) > 1 else f"{ascii_only(st.interface)} (link {link})")
        header = f"{self._title()} - backend {ascii_only(st.backend)} on {where}"
        status = (f"{st.shaped_flows} flows shaped of {st.live_flows} live - flow source: "
                  f"{ascii_only(st.flow_source)}"
                  + (f" - {st.unmanaged} leave by an unmanaged interface" if st.unmanaged
                     else ""))
        return View(header=header, status=status, rows=rows,
                    totals=sorted(totals.values(), key=lambda t: (-t.actual_bit, t.rule)))


def _table(rows: List[Tuple[str, ...]], right: Tuple[bool, ...], width: int = 0,
           drop: Tuple[int, ...] = ()) -> List[str]:
    """Aligned lines; while wider than ``width`` (if given), the columns ``drop`` names go,
    in that order."""
    keep = list(range(len(rows[0])))
    widths = [max(len(r[i]) for r in rows) for i in keep]
    for col in drop:
        if not width or sum(widths[i] + 2 for i in keep) - 2 <= width:
            break
        keep.remove(col)
    out = []
    for r in rows:
        cells = [r[i].rjust(widths[i]) if right[i] else r[i].ljust(widths[i]) for i in keep]
        out.append("  ".join(cells).rstrip())
    return out


def _target(r: Row) -> str:
    t = format_bit_rate(r.rate_bit)
    return t if r.ceil_bit <= r.rate_bit else f"{t} (ceil {format_bit_rate(r.ceil_bit)})"


def _total_target(t: RuleTotal) -> str:
    s = format_bit_rate(t.target_bit)
    return s if not t.total_rate_bit else f"{s} (total {format_bit_rate(t.total_rate_bit)})"


def _client(r: Row) -> str:
    return f"{r.client} @{format_bit_rate(r.client_rate_bit)}" if r.client else "-"


def render(view: View, width: int, height: int) -> List[Tuple[str, str]]:
    """The screen as (style, text) lines, at most ``height`` lines of at most ``width``
    characters. Styles: "title", "error", "head", "" (plain)."""
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        return [("", "too small"[:max(0, width)])][:max(0, height)]
    lines: List[Tuple[str, str]] = [("title", view.header)]
    if view.error:
        lines.append(("error", view.error))
    else:
        lines.append(("", view.status))
    room = height - len(lines)
    if not view.error and view.rows and room >= 3:
        trows = [("RULE", "FLOWS", "TARGET (sum)", "ACTUAL", "AVG 10s", "SENT")]
        trows += [(t.rule, str(t.flows), _total_target(t), format_bit_rate(t.actual_bit),
                   format_bit_rate(t.avg_bit), format_bytes(t.bytes)) for t in view.totals]
        if len(view.totals) > 1:
            trows.append(("all", str(sum(t.flows for t in view.totals)),
                          format_bit_rate(sum(t.target_bit for t in view.totals)),
                          format_bit_rate(sum(t.actual_bit for t in view.totals)),
                          format_bit_rate(sum(t.avg_bit for t in view.totals)),
                          format_bytes(sum(t.bytes for t in view.totals))))
        tlines = _table(trows, (False, True, True, True, True, True))
        # the per-rule totals may take at most half of what is left; the flows get the rest
        keep = max(2, min(len(tlines), (room - 1) // 2))
        lines.append(("", ""))
        lines.append(("head", tlines[0]))
        lines.extend(("", t) for t in tlines[1:keep])
        room = height - len(lines)
        if room >= 3:
            frows = [("RULE", "PID", "PROCESS", "LOCAL", "REMOTE", "TARGET", "ACTUAL", "AVG 10s",
                      "SENT")]
            frows += [(r.rule, str(r.pid) if r.pid else "-", r.process or "-", r.local, r.remote,
                       _target(r), format_bit_rate(r.actual_bit), format_bit_rate(r.avg_bit), format_bytes(r.bytes))
                      for r in view.rows]
            right = (False, True, False, False, False, True, True, True, True)
            # on a narrow terminal the rates matter most: AVG, SENT, PID, LOCAL go first
            drop: Tuple[int, ...] = (7, 8, 1, 3)
            if any(r.client for r in view.rows):     # rules with client_rate: the CLIENT column
                frows = [row[:5] + (c,) + row[5:] for row, c in
                         zip(frows, ["CLIENT"] + [_client(r) for r in view.rows])]
                right = right[:5] + (False,) + right[5:]
                drop = (8, 9, 1, 3, 5)
            flines = _table(frows, right, width, drop=drop)
            lines.append(("", ""))
            lines.append(("head", flines[0]))
            room = height - len(lines)
            body = flines[1:]
            if len(body) > room:
                shown = max(0, room - 1)
                lines.extend(("", f) for f in body[:shown])
                lines.append(("", f"... {len(body) - shown} more flows"))
            else:
                lines.extend(("", f) for f in body)
    elif not view.error and not view.rows and room >= 2:
        lines.append(("", ""))
        lines.append(("", "no shaped flows"))
    return [(style, text[:width]) for style, text in lines[:height]]


# ------------------------------------------------------------------ curses

def _draw(scr, view: View) -> None:
    h, w = scr.getmaxyx()
    styles = {"title": curses.A_REVERSE, "error": curses.A_BOLD, "head": curses.A_BOLD, "": 0}
    scr.erase()
    for y, (style, text) in enumerate(render(view, w, h)):
        try:
            # the bottom-right cell cannot be written without curses complaining: skip it
            scr.addnstr(y, 0, text, w - 1 if y == h - 1 else w, styles.get(style, 0))
        except curses.error:
            pass
    scr.refresh()


def _loop(scr, socket_path: str, interval: float) -> None:
    try:
        curses.curs_set(0)
    except curses.error:
        pass
    scr.keypad(True)
    tracker = Tracker(socket_path, interval)
    view = View(header=tracker._title(), status="asking the daemon ...")
    _draw(scr, view)
    next_poll = 0.0
    call_timeout = max(0.5, min(2.0, interval))
    while True:
        now = time.monotonic()
        if now >= next_poll:
            try:
                st = control.call(socket_path, {"cmd": "status"}, timeout=call_timeout)
                # the counters were read between request and answer: take the middle
                view = tracker.update(st, (now + time.monotonic()) / 2)
            except FlowpacerError as e:
                view = tracker.failed(str(e))
            next_poll = now + interval
            _draw(scr, view)
        scr.timeout(max(10, int((next_poll - time.monotonic()) * 1000)))
        ch = scr.getch()
        if ch in (ord("q"), ord("Q")):
            return
        if ch == curses.KEY_RESIZE:
            curses.update_lines_cols()
            _draw(scr, view)
        elif ch in (12,):          # Ctrl-L: redraw from scratch
            scr.clear()
            _draw(scr, view)


def _on_term(signum, frame):
    raise SystemExit(0)       # lets curses.wrapper restore the terminal


def run_top(socket_path: str, interval: float) -> int:
    """The curses view until ``q``; returns the exit status."""
    import click
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        click.echo("flowpacer: top needs a terminal (use `flowpacer status` otherwise)", err=True)
        return 1
    # ncurses prefers $LINES/$COLUMNS to the terminal's real size: a stale export would fix the
    # size forever (and break resizing); without them it asks the terminal
    for var in ("LINES", "COLUMNS"):
        os.environ.pop(var, None)
    old = signal.signal(signal.SIGTERM, _on_term)
    try:
        curses.wrapper(_loop, socket_path, interval)
    except KeyboardInterrupt:
        pass
    except curses.error as e:
        click.echo(f"flowpacer: the terminal cannot be used: {ascii_only(e)}", err=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    return 0
