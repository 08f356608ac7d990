"""Prometheus metrics of one server, in its own registry (tests run many servers in a process).

Latency histograms are observed once per finished request from the engine's RequestMetrics
(arrival = when the call reached the server, so queueing in the server counts). Token counters
move as requests are accepted (prompt) and as deltas arrive (generated), on the event loop. Gauges of the
engine's state are set by the engine thread after every step; prometheus_client is thread-safe.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.types import RequestOutput

# From 1 ms (a step or a queue wait on an accelerator) to minutes (a long answer on a CPU).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
                    120.0, 300.0)
_STEP_TOKEN_BUCKETS = tuple(2 ** i for i in range(14))  # 1 .. 8192 tokens a step
# Tenants named in per-tenant label sets; later tenants are counted as "other". Tenants are
# digests of bearer tokens (tenancy.py), so without --auth-token any caller can mint new ones:
# the cap keeps one client from growing the registry (and every scrape) without end. The real
# tenant ids ("anonymous", "token:...", "cert:...") can never be "other".
MAX_TENANT_LABELS = 64
OTHER_TENANTS = "other"
_BYTE_BUCKETS = tuple(2.0 ** i for i in range(10, 36, 2))  # 1 KiB .. 32 GiB, x4
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SnapshotRegistry(CollectorRegistry):
    """A registry whose scrape is one snapshot of the engine's state: the engine thread sets its
    gauges (pages used and usable, running, waiting) under `state_lock`, and a scrape collects
    every family under it. Without it a scrape could read jaxserve_kv_pages_used before a step and
    vllm:kv_cache_usage_perc (derived from it at collect time) after, and the two disagree.
    A scrape holds the engine thread's gauge update back for its own few milliseconds, never a step."""

    def __init__(self):
        super().__init__()
        self.state_lock = threading.RLock()

    def collect(self):
        with self.state_lock:
            families = list(super().collect())
        yield from families


class ServerMetrics:
    def __init__(self, registry: SnapshotRegistry | None = None, max_tenant_labels: int = MAX_TENANT_LABELS):
        r = self.registry = registry or SnapshotRegistry()
        self.max_tenant_labels = max_tenant_labels
        self._tenant_labels: set[str] = set()
        self._tenant_lock = threading.Lock()  # the event loop and the engine thread both count
        p = "jaxserve_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time between a request's later tokens.", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "Arrival to first scheduled by the engine.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        # The latency breakdown: queue (above) + prefill = TTFT; decode = TTFT to last token.
        self.prefill_time = Histogram(p + "request_prefill_time_seconds",
                                      "First scheduled to first token.", buckets=_LATENCY_BUCKETS,
                                      registry=r)
        self.decode_time = Histogram(p + "request_decode_time_seconds",
                                     "First token to last token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.step_tokens = Histogram(p + "engine_step_tokens", "Tokens computed in one engine step.",
                                     buckets=_STEP_TOKEN_BUCKETS, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_fraction", "Fraction of usable KV pages held (of the fuller "
                              "page group, for models whose sliding layers have their own).",
                              registry=r)
        self.kv_usage_peak = Gauge(p + "kv_cache_usage_peak_fraction",
                                   "Highest kv_cache_usage_fraction since the server started.",
                                   registry=r)
        self.preemptions_by = Counter(p + "preemptions_by_reason",
                                      "Sequences preempted, by reason (kv: the pool ran short; "
                                      "priority: a higher-priority request) and tenant.",
                                      ["reason", "tenant"], registry=r)
        self._seen_tokens = 0
        self._seen_steps = 0
        self.step_seconds = Histogram(p + "engine_step_seconds", "Duration of one engine step.",
                                      buckets=_TPOT_BUCKETS, registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences the engine is running.",
                             registry=r)
        self.waiting = Gauge(p + "num_requests_waiting",
                             "Sequences waiting to run (server queue and engine waiting list).",
                             registry=r)
        self.kv_pages_used = Gauge(p + "kv_pages_used", "KV cache pages in use.", registry=r)
        self.kv_pages_total = Gauge(p + "kv_pages_total", "Usable KV cache pages.", registry=r)
        self.preemptions = Counter(p + "preemptions", "Sequences preempted by recompute.",
                                   registry=r)
        self.compilations = Gauge(p + "compilations_after_warmup",
                                  "XLA compilations since warm-up (should stay 0).", registry=r)
        self.rejections = Counter(p + "rejected_requests", "Requests refused, by reason.",
                                  ["reason"], registry=r)
        # Refusals by tenant and the limit that refused: a per-tenant quota (scheduler/quotas.py,
        # named by its TenantLimits field), the server's waiting queue (max_queued_requests /
        # max_queued_tokens), the tokenizer pool's backlog (max_pool_backlog) or the TTFT target
        # (slo_ttft_ms). Count through reject_tenant().
        self.tenant_rejections = Counter(p + "tenant_rejected_requests",
                                         "Requests refused, by tenant (beyond the first "
                                         f"{max_tenant_labels}: \"{OTHER_TENANTS}\") and the limit that "
                                         "refused.", ["tenant", "limit"], registry=r)
        self.finished = Counter(p + "finished_requests", "Requests ended, by outcome.",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens",
                                         "Tokens generated (cancelled requests' included).", registry=r)
        # Prefix cache, in tokens like vLLM's (vllm_metrics.py re-exports them under vLLM's
        # names): every admission of a sequence looks its tokens up; hits are the tokens not
        # prefilled.
        self.prefix_cache_queries = Counter(p + "prefix_cache_queries",
                                            "Tokens looked up in the prefix cache at admission.", registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits",
                                         "Tokens found in the prefix cache at admission (not prefilled).",
                                         registry=r)
        self.prefix_cache_pages = Gauge(p + "prefix_cache_pages",
                                        "KV pages nobody holds, kept for prefix matches.", registry=r)
        self.prefix_cache_evictions = Counter(p + "prefix_cache_evictions",
                                              "Cached KV pages reused for other content.", registry=r)
        self.request_success = Counter(p + "request_success",
                                       "Requests finished (not cancelled or failed), by the finish "
                                       "reason of their first sample.", ["finished_reason"], registry=r)
        # Speculative decoding: drafts verified and kept (vLLM's spec_decode counters' meaning),
        # and their ratio since start.
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens",
                                         "Draft tokens verified (speculative decoding).", registry=r)
        self.spec_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens",
                                            "Draft tokens kept (by the rejection rule).", registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verified runs that carried drafts.", registry=r)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens kept, by their position in the run (0 = first).",
                                             ["position"], registry=r)
        self.spec_acceptance = Gauge(p + "spec_decode_draft_acceptance_rate",
                                     "Draft tokens kept / verified since start (0 before any draft).",
                                     registry=r)

        # Disaggregated roles (engine_loop.py's module doc): the KV that moved, how long a decode
        # engine's pull took (from its start to the last byte), and handovers that failed.
        self.handover_bytes = Histogram(p + "handover_kv_bytes", "KV bytes of one handover, by role "
                                        "(prefill: offered; decode: received).", ["role"],
                                        buckets=_BYTE_BUCKETS, registry=r)
        self.kv_transfer_seconds = Histogram(p + "kv_transfer_seconds", "Decode role: a handover's KV "
                                             "pull, started to arrived.", buckets=_LATENCY_BUCKETS,
                                             registry=r)
        self.handover_failures = Counter(p + "handover_failures", "Handovers that failed, by role and "
                                         "status (unavailable: the KV did not arrive in time).",
                                         ["role", "status"], registry=r)

    def observe_kv_pull(self, seconds: float, nbytes: int) -> None:
        self.kv_transfer_seconds.observe(seconds)
        self.handover_bytes.labels("decode").observe(nbytes)

    def tenant_label(self, tenant: str) -> str:
        """`tenant` while fewer than max_tenant_labels tenants have been named, else "other"
        (a tenant once named keeps its label)."""
        with self._tenant_lock:
            if tenant in self._tenant_labels:
                return tenant
            if len(self._tenant_labels) < self.max_tenant_labels:
                self._tenant_labels.add(tenant)
                return tenant
        return OTHER_TENANTS

    def reject_tenant(self, tenant: str, limit: str) -> None:
        """Count one refusal of `tenant`'s request by `limit`."""
        self.tenant_rejections.labels(self.tenant_label(tenant), limit).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        n_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if out.outputs:
            self.request_success.labels(out.outputs[0].finish_reason or "unknown").inc()
        for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e), (self.queue_time, m.queue_time),
                            (self.tpot, m.tpot(n_tokens)), (self.prefill_time, m.prefill_time),
                            (self.decode_time, m.decode_time)):
            if value is not None:
                hist.observe(value)

    def observe_engine(self, engine) -> None:
        """On the engine thread after every step: KV usage (and its peak), tokens of the step,
        preemptions by reason and tenant (deltas of the engine's running totals)."""
        sched = engine.scheduler
        held, usable = sched.kv_pages()  # the fuller KV group's (two-group models: Gemma)
        frac = held / usable if usable else 0.0
        self.kv_usage.set(frac)
        if frac > self._peak:
            self._peak = frac
            self.kv_usage_peak.set(frac)
        steps, tokens = engine.stats["steps"], engine.stats["computed_tokens"]
        if steps > self._seen_steps:
            # one observation per step; several steps between calls share their mean
            per = (tokens - self._seen_tokens) / (steps - self._seen_steps)
            for _ in range(steps - self._seen_steps):
                self.step_tokens.observe(per)
            self._seen_steps, self._seen_tokens = steps, tokens
        take = getattr(sched, "take_preemptions_by_tenant", None)
        for (reason, tenant), count in (take() if take else {}).items():
            self.preemptions_by.labels(reason, self.tenant_label(tenant)).inc(count)

    _peak = 0.0

    @property
    def kv_peak(self) -> float:
        """The highest KV usage fraction seen after a step since start or reset_kv_peak()."""
        return self._peak

    def reset_kv_peak(self) -> None:
        self._peak = 0.0
        self.kv_usage_peak.set(0.0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def start_http(self, host: str, port: int):
        """Serve /metrics on a thread; returns the HTTP server (its `server_port` is the port).
        Only /metrics answers (200); any other path is 404, so an HTTP probe aimed at this port
        by mistake (say /v1/models or /ready) fails instead of passing on a server not ready."""
        from jaxserve.server.metrics_http import start_metrics_http
        return start_metrics_http(self.registry, host, port)
