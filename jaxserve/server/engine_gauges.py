"""The engine's state as the server's Prometheus metrics (metrics.ServerMetrics), set by the
engine thread after every step, add and abort: gauges are set, and the engine's running totals
(preemptions, prefix-cache queries / hits / evictions, draft counts, accepted drafts per
position) become counter increments, each delta counted once.
"""

from __future__ import annotations


class EngineGauges:
    """One engine's counters as last exported, so each update adds only what is new."""

    def __init__(self, metrics):
        self.metrics = metrics
        self._seen: dict[str, int] = {}  # running total -> its value when last exported
        self._accepted_per_pos: list[int] = []

    def update(self, engine, waiting_here: int) -> None:
        """Export `engine`'s state; `waiting_here`: requests the server still queues in front
        of it (counted as waiting)."""
        m = self.metrics
        with m.registry.state_lock:  # a scrape sees all of one step's gauges or none (metrics.py)
            sched = engine.scheduler
            m.running.set(sched.num_running)
            m.waiting.set(sched.num_waiting + waiting_here)
            used, usable = sched.kv_pages()  # the fuller KV group's pages, null page excluded
            m.kv_pages_total.set(usable)
            m.kv_pages_used.set(used)
            self._count("preemptions", engine.stats["preemptions"], m.preemptions)
            m.compilations.set(engine.compiles_after_warmup)
            m.observe_engine(engine)  # KV usage and peak, step tokens, preemptions by reason/tenant
            stats = engine.prefix_cache_stats()
            m.prefix_cache_pages.set(stats["cached_pages"])
            for key, counter in (("queries", m.prefix_cache_queries), ("hits", m.prefix_cache_hits),
                                 ("evictions", m.prefix_cache_evictions)):
                self._count(key, stats[key], counter)
            for key, counter in (("draft_tokens", m.spec_draft_tokens), ("accepted_draft_tokens", m.spec_accepted_tokens),
                                 ("drafts", m.spec_drafts)):
                self._count(key, engine.stats.get(key, 0), counter)
            per_pos = getattr(engine, "spec_positions", {"accepted": []})["accepted"]
            seen = self._accepted_per_pos
            seen += [0] * (len(per_pos) - len(seen))
            for i, n in enumerate(per_pos):
                if n > seen[i]:
                    m.spec_accepted_per_pos.labels(position=str(i)).inc(n - seen[i])
                    seen[i] = n
            m.spec_acceptance.set(engine.draft_acceptance or 0.0)

    def _count(self, key: str, total: int, counter) -> None:
        """Add to `counter` what running total `key` gained since the last export."""
        new = total - self._seen.get(key, 0)
        if new > 0:
            counter.inc(new)
            self._seen[key] = total
