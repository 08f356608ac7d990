"""One request's latencies from its client-side timestamps, shared by the load scripts
(bench_serving.py, capacity.py): `sent` (arrival), `first` / `last` (first and last token
received), `tokens` (tokens received), all in seconds on one clock."""

from __future__ import annotations


class RequestTiming:
    """Mixed into a dataclass with fields sent, first, last and tokens."""

    @property
    def ttft(self):
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self):
        if self.first is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    @property
    def e2e(self):
        return None if self.last is None else self.last - self.sent
