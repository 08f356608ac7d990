"""The one-line serving stats log, every `stats_log_interval_s` while requests come and go (like
vLLM's "Avg prompt throughput: ... Running: N reqs ... KV cache usage"), read from the server's
own Prometheus registry (metrics.py), so it says exactly what /metrics says. Quiet while idle:
a line is written when something moved since the last one, or something is running or waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

log = logging.getLogger("jaxserve.server.stats")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    t: float
    prompt_tokens: float
    generation_tokens: float
    running: float
    waiting: float
    kv_usage: float
    prefix_queries: float
    prefix_hits: float
    preemptions: float


def snapshot(metrics, now: float | None = None) -> Snapshot:
    get = metrics.registry.get_sample_value

    def v(name: str) -> float:
        return get("jaxserve_" + name) or 0.0
    return Snapshot(time.monotonic() if now is None else now, v("prompt_tokens_total"),
                    v("generation_tokens_total"), v("num_requests_running"), v("num_requests_waiting"),
                    v("kv_cache_usage_fraction"), v("prefix_cache_queries_total"), v("prefix_cache_hits_total"),
                    v("preemptions_total"))


def stats_line(prev: Snapshot, now: Snapshot) -> str | None:
    """The line for the span prev -> now; None when idle throughout (nothing to say)."""
    dt = max(now.t - prev.t, 1e-9)
    moved = (now.prompt_tokens, now.generation_tokens) != (prev.prompt_tokens, prev.generation_tokens)
    if not moved and not now.running and not now.waiting:
        return None
    queries = now.prefix_queries - prev.prefix_queries
    hit = (now.prefix_hits - prev.prefix_hits) / queries if queries else 0.0
    return (f"Avg prompt throughput: {(now.prompt_tokens - prev.prompt_tokens) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(now.generation_tokens - prev.generation_tokens) / dt:.1f} tokens/s, "
            f"Running: {now.running:.0f} reqs, Waiting: {now.waiting:.0f} reqs, "
            f"KV cache usage: {now.kv_usage:.1%}, Prefix cache hit rate: {hit:.1%}, "
            f"Preemptions: {now.preemptions - prev.preemptions:.0f}")


async def run(metrics, interval_s: float) -> None:
    """Log stats_line every interval_s until cancelled."""
    prev = snapshot(metrics)
    while True:
        await asyncio.sleep(interval_s)
        now = snapshot(metrics)
        line = stats_line(prev, now)
        if line is not None:
            log.info(line)
        prev = now
