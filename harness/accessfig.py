"""What the people at the other end of an access link see, from a receiver's byte counts (issue
30): pure functions, no I/O, so ``make check`` tests them (tests/test_access_figures.py).

A receiver (``harness.accessclient``) counts the body bytes each connection received in bins
of ``bin_s`` seconds from one common start; everything here works on those bins:

- ``per_second``: goodput per whole second of a window (bytes/s);
- ``playout``: a music player on the stream: it starts once ``preroll_bytes`` are in, then
  plays ``bitrate`` bytes/s; when its buffer empties it stalls until ``rebuffer_bytes`` are in
  again. A stream "falls below its bitrate" in every second in which the player stalled;
- ``first_reach``: when a connection's body had its first N bytes (time to first N KiB).
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence


def per_second(bins: Sequence[int], bin_s: float, t_from: float, t_to: float) -> List[float]:
    """Bytes/s in each whole second of [t_from, t_to) (seconds from the bins' start); a last
    part shorter than half a second is left out."""
    per = max(1, round(1.0 / bin_s))
    first = math.ceil(t_from / bin_s - 1e-9)
    last = min(len(bins), math.floor(t_to / bin_s + 1e-9))
    out = []
    i = first
    while i < last:
        chunk = bins[i:min(i + per, last)]
        if len(chunk) >= per / 2:
            out.append(sum(chunk) / (len(chunk) * bin_s))
        i += per
    return out


def first_reach(bins: Sequence[int], bin_s: float, nbytes: int) -> Optional[float]:
    """Seconds from the bins' start to the end of the bin in which the body reached ``nbytes``
    (None: never)."""
    total = 0
    for i, b in enumerate(bins):
        total += b
        if total >= nbytes:
            return (i + 1) * bin_s
    return None


def playout(bins: Sequence[int], bin_s: float, bitrate: float, preroll_bytes: float,
            rebuffer_bytes: Optional[float] = None, t_from: float = 0.0,
            t_to: Optional[float] = None) -> dict:
    """A player of ``bitrate`` bytes/s on the stream whose arrivals are ``bins``.

    ``start_s``: when it began to play (None: never had the preroll); ``stall_s``: time spent
    stalled after the start; ``stalls``: how many times it stalled; ``below_bitrate_seconds``:
    how many whole seconds (counted from the bins' start, only those in [t_from, t_to)) had a
    stall in them. Before the start nothing counts as a stall (that is the startup delay)."""
    rebuffer = preroll_bytes if rebuffer_bytes is None else rebuffer_bytes
    t_to = len(bins) * bin_s if t_to is None else t_to
    buf = 0.0
    playing, started = False, None
    stall_s, stalls = 0.0, 0
    bad_seconds = set()
    per_bin = bitrate * bin_s
    for i, b in enumerate(bins):
        t = i * bin_s
        buf += b
        if not playing:
            if buf >= (rebuffer if started is not None else preroll_bytes):
                playing = True
                if started is None:
                    started = t + bin_s
        if playing:
            if buf >= per_bin:
                buf -= per_bin
                continue
            # the buffer runs dry within this bin: a stall from here on
            playing = False
            stalls += 1
            buf = 0.0
        if started is not None:
            stall_s += bin_s
            if t_from - 1e-9 <= t < t_to:
                bad_seconds.add(int(t + 1e-9))
    return {"start_s": None if started is None else round(started, 3),
            "stall_s": round(stall_s, 3), "stalls": stalls,
            "below_bitrate_seconds": len(bad_seconds)}


def jain(values: Sequence[Optional[float]]) -> Optional[float]:
    """Jain's fairness index of ``values`` (1: all equal; 1/n: one takes everything)."""
    v = [x for x in values if x is not None]
    if not v or not any(v):
        return None
    return sum(v) ** 2 / (len(v) * sum(x * x for x in v))


_SS_PORT = re.compile(r"[\]:](\d+)\s*$")
_SS_RETRANS = re.compile(r"\bretrans:\d+/(\d+)")


def ss_retransmits(text: str) -> Dict[int, int]:
    """{local port: total retransmitted segments} summed over the sockets of ``ss -Htin`` output
    (each socket's line, then its info line starting with white space)."""
    out: Dict[int, int] = {}
    port = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            cols = line.split()
            port = None
            for c in cols[2:4]:              # Recv-Q Send-Q Local Peer (state left out by a filter)
                m = _SS_PORT.search(c)
                if m and ":" in c:
                    port = int(m.group(1))
                    break
            if port is not None:
                out.setdefault(port, 0)
            continue
        if port is None:
            continue
        m = _SS_RETRANS.search(line)
        if m:
            out[port] += int(m.group(1))
    return out


def cpu_per_gbit(busy_s: float, delivered_bytes: int) -> Optional[float]:
    """CPU seconds per delivered gigabit (None when nothing was delivered)."""
    gbit = delivered_bytes * 8 / 1e9
    return round(busy_s / gbit, 3) if gbit > 0 else None


def quantiles(values: Sequence[float], n: int = 100) -> List[float]:
    """``n`` + 1 evenly spaced quantiles (0 to 1, nearest rank) of ``values``: a CDF small
    enough to keep in a result ([] when there is nothing)."""
    v = sorted(values)
    if not v:
        return []
    return [v[min(len(v) - 1, max(0, math.ceil(i / n * len(v)) - 1))] for i in range(n + 1)]


def added_delays_ms(arrivals, t0_ns: int, t1_ns: int) -> List[float]:
    """One-way delays (ms) above the flow's minimum over all ``arrivals`` (objects with
    ``sent_ns`` and ``recv_ns``) of the datagrams sent in [t0_ns, t1_ns)."""
    if not arrivals:
        return []
    base = min(a.recv_ns - a.sent_ns for a in arrivals)
    return [(a.recv_ns - a.sent_ns - base) / 1e6 for a in arrivals if t0_ns <= a.sent_ns < t1_ns]
