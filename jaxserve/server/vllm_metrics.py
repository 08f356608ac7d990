"""vLLM's metric names beside jaxserve's, for dashboards and routers that already know them
(GKE Inference Gateway and llm-d route on vllm:num_requests_waiting and vllm:kv_cache_usage_perc).

No second set of counters: a collector re-exports the jaxserve_* metrics under vLLM's names at
scrape time, with vLLM's `model_name` label, so the two can never disagree.

    vllm:num_requests_running / _waiting      jaxserve_num_requests_running / _waiting
    vllm:kv_cache_usage_perc                  jaxserve_kv_pages_used / jaxserve_kv_pages_total
                                              (a fraction in [0, 1], as vLLM exports it; with
                                              two KV page groups, Gemma's, the fuller one's)
    vllm:prompt_tokens_total                  jaxserve_prompt_tokens_total
    vllm:generation_tokens_total              jaxserve_generation_tokens_total
    vllm:time_to_first_token_seconds          jaxserve_time_to_first_token_seconds
    vllm:time_per_output_token_seconds        jaxserve_time_per_output_token_seconds
    vllm:e2e_request_latency_seconds          jaxserve_e2e_request_latency_seconds
    vllm:request_queue_time_seconds           jaxserve_request_queue_time_seconds
    vllm:request_success_total{finished_reason}  jaxserve_request_success_total{finished_reason}
    vllm:prefix_cache_queries_total / _hits   jaxserve_prefix_cache_queries_total / _hits (tokens)
    vllm:spec_decode_num_draft_tokens_total   jaxserve_spec_decode_num_draft_tokens_total
    vllm:spec_decode_num_accepted_tokens_total  jaxserve_spec_decode_num_accepted_tokens_total
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from jaxserve.server.metrics import ServerMetrics

_RENAMES = {  # jaxserve family name -> vLLM family name
    "jaxserve_num_requests_running": "vllm:num_requests_running",
    "jaxserve_num_requests_waiting": "vllm:num_requests_waiting",
    "jaxserve_prompt_tokens": "vllm:prompt_tokens",
    "jaxserve_generation_tokens": "vllm:generation_tokens",
    "jaxserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "jaxserve_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "jaxserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "jaxserve_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "jaxserve_request_success": "vllm:request_success",
    "jaxserve_prefix_cache_queries": "vllm:prefix_cache_queries",
    "jaxserve_prefix_cache_hits": "vllm:prefix_cache_hits",
    "jaxserve_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "jaxserve_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


class VllmNames(Collector):
    def __init__(self, metrics: ServerMetrics, model_name: str):
        self._sources = [metrics.running, metrics.waiting, metrics.prompt_tokens,
                         metrics.generation_tokens, metrics.ttft, metrics.tpot, metrics.e2e,
                         metrics.queue_time, metrics.request_success,
                         metrics.prefix_cache_queries, metrics.prefix_cache_hits,
                         metrics.spec_draft_tokens, metrics.spec_accepted_tokens]
        self._used, self._total = metrics.kv_pages_used, metrics.kv_pages_total
        self._model = model_name

    def _value(self, gauge) -> float:
        return next(s.value for fam in gauge.collect() for s in fam.samples)

    def collect(self):
        for src in self._sources:
            for fam in src.collect():
                name = _RENAMES[fam.name]
                out = Metric(name, fam.documentation + " (vLLM's name)", fam.type)
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue  # vLLM exports none; dashboards do not read them
                    out.add_sample(name + s.name[len(fam.name):], {**s.labels, "model_name": self._model},
                                   s.value)
                yield out
        total = self._value(self._total)
        usage = Metric("vllm:kv_cache_usage_perc", "KV cache usage as a fraction (1 = full).", "gauge")
        usage.add_sample("vllm:kv_cache_usage_perc", {"model_name": self._model},
                         self._value(self._used) / total if total else 0.0)
        yield usage


def register_vllm_names(metrics: ServerMetrics, model_name: str) -> None:
    metrics.registry.register(VllmNames(metrics, model_name))
