"""The apply-latency histogram: a measurement the daemon makes (the reconciler adds one sample
per apply, ``Counters.apply_hist``); the view copies its cumulative counts into
``DaemonCounters.apply_hist`` and metrics render that as ``flowpacer_apply_duration_seconds``.
"""
from __future__ import annotations

# upper bounds of the buckets, seconds
APPLY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LatencyHistogram:
    """Cumulative histogram filled by the daemon's loop (one add per apply), read by scrapes."""

    def __init__(self, buckets=APPLY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += seconds

    def cumulative(self):
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append((repr(b), acc))
        acc += self.counts[-1]
        out.append(("+Inf", acc))
        return out, self.total
