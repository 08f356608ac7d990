"""One scrape is one snapshot of the engine's gauges: vllm:kv_cache_usage_perc (derived at collect
time) agrees with the jaxserve_kv_pages_* it derives from, even when a step ends mid-scrape."""

import re
import threading
from types import SimpleNamespace

from prometheus_client.registry import Collector

from jaxserve.server.engine_gauges import EngineGauges
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.vllm_metrics import register_vllm_names


def _fake_loop(pages: list[int]):
    """An engine with just what EngineGauges.update reads, and its gauges; `pages[0]` is the pool's used-page count now."""
    engine = SimpleNamespace(
        stats={"preemptions": 0, "steps": 0, "computed_tokens": 0}, compiles_after_warmup=0,
        draft_acceptance=None,
        scheduler=SimpleNamespace(num_running=1, num_waiting=0, kv_pages=lambda: (pages[0], 8)),
        prefix_cache_stats=lambda: {"queries": 0, "hits": 0, "cached_pages": 0, "evictions": 0})
    return SimpleNamespace(gauges=EngineGauges(ServerMetrics()), engine=engine)


class _StepMidScrape(Collector):
    """Collected after the jaxserve_* gauges and before the vLLM names: the engine thread finishes
    a step (pages 1 -> 5) right then, and sets its gauges."""

    def __init__(self, loop, pages):
        self.loop, self.pages, self.armed, self.thread, self.waited = loop, pages, True, None, None

    def collect(self):
        if self.armed:
            self.armed = False
            self.pages[0] = 5
            self.thread = threading.Thread(target=self.loop.gauges.update, args=(self.loop.engine, 0))
            self.thread.start()
            self.thread.join(timeout=0.5)  # long enough for an unlocked update to land
            # Read here, while the scrape still holds the lock: once it returns, the update may
            # finish before the test looks (seen once under a loaded fresh-clone `make test`).
            self.waited = self.thread.is_alive()
        return []


def _sample(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def test_a_step_ending_mid_scrape_is_not_half_seen():
    pages = [1]
    loop = _fake_loop(pages)
    m = loop.gauges.metrics
    loop.gauges.update(loop.engine, 0)
    mid = _StepMidScrape(loop, pages)
    m.registry.register(mid)
    register_vllm_names(m, "m")

    text = m.exposition().decode()
    used, total = _sample(text, "jaxserve_kv_pages_used"), _sample(text, "jaxserve_kv_pages_total")
    assert (used, total) == (1, 8)
    assert _sample(text, "vllm:kv_cache_usage_perc") == used / total
    assert mid.waited  # the step's gauges waited for the scrape to end
    mid.thread.join(timeout=5)
    assert not mid.thread.is_alive()
    text = m.exposition().decode()  # and the next scrape sees them, all together
    assert _sample(text, "jaxserve_kv_pages_used") == 5
    assert _sample(text, "vllm:kv_cache_usage_perc") == 5 / 8
