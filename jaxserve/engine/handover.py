"""Prefill/decode disaggregation on the engine's side: a request prefilled on one engine goes on
decoding on another, with the KV of its prompt moved instead of recomputed.

Prefill engine: `Engine.add_request(..., hand_over=True)` runs the request as usual (chunked,
prefix-cached, n samples) until every live sample has sampled its first token; its deltas
stream as usual. Then `export` takes its sequences out of the scheduler with their pages
(scheduler/handover.hold), reads those pages out of the cache (engine/kv_pages.py: a copy, in
the stored layout), frees the pages at once (the copy is what moves) and leaves a `Handover`
(everything the decode side needs but the KV, plain data that pickles) with the KV data under
`Engine.handovers`. The request then leaves the prefill engine: no final delta, no finished
output; its owner sends both on.

Decode engine: `Engine.import_request(handover, data)` checks that the two engines store KV
the same way (`layout_key`), admits the samples as running sequences on fresh pages
(scheduler/handover.admit_running, all or nothing), writes the data into them and rebuilds
each sample's host state (tokens, text already streamed, logprobs, grammar state) from the
handover, so the next step decodes exactly as the prefill engine would have: greedy outputs,
and seeded samples (each draw's key comes from the sample's seed and position), are the
colocated engine's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING

from jaxserve.engine.sample_state import SampleState
from jaxserve.scheduler.handover import HeldTable
from jaxserve.types import RequestMetrics, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine, RequestState


@dataclasses.dataclass
class HandedSample:
    table: HeldTable
    seed: int
    token_ids: list[int]
    text: str
    emitted: int  # characters of text already streamed by the prefill side
    logprobs: list[TokenLogprob] | None


@dataclasses.dataclass
class Handover:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    priority: int
    tenant: str
    samples: list[HandedSample]
    layout: str  # layout_key of the prefill engine
    num_cached_tokens: int
    kv_bytes: int = 0
    # With params.prompt_logprobs: what the prefill engine computed (RequestOutput's), which the
    # decode engine's finished output reports as its own.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def full_pages(self) -> int:
        return sum(len(s.table.full_pages) for s in self.samples)

    @property
    def sliding_pages(self) -> int:
        return sum(len(s.table.sliding_pages) for s in self.samples)


class HandoverRefused(ValueError):
    """The decode engine cannot take this handover at all (another model or KV layout)."""


def layout_key(engine: Engine) -> str:
    """What must agree between a prefill and a decode engine for KV to move as stored: the
    model's config, weight dtype, KV cache dtype, page size, a draft model's own cache."""
    r = engine.runner
    parts = (repr(engine.model_config), engine.model_dtype, engine.config.kv_cache_dtype,
             engine.scheduler_config.page_size, engine.scheduler_config.sliding_window,
             getattr(r, "draft_cache", None) is not None)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def ready(engine: Engine, req: RequestState) -> bool:
    """Every unfinished sample has sampled and is running (not preempted), at least one is left."""
    live = [s for s in req.samples if s.finish_reason is None]
    if not live:
        return False
    for s in live:
        seq = engine.scheduler.get_sequence(s.seq_id)
        if not s.token_ids or seq.num_uncomputed_tokens != 1 or seq.status.value != "running":
            return False
    return True


def export(engine: Engine, req: RequestState, priority: int, tenant: str) -> None:
    """The module doc's prefill half for one ready request."""
    tables = engine.scheduler.hold_request(req.request_id)
    try:
        full = [p for t in tables for p in t.full_pages]
        sliding = [p for t in tables for p in t.sliding_pages]
        data = engine.runner.read_pages(full, sliding)
    finally:
        engine.scheduler.release_held(req.request_id)  # the copy moves; the pages are free now
    by_index = {s.index: s for s in req.samples}
    samples = [HandedSample(t, by_index[t.sample_index].seed, list(by_index[t.sample_index].token_ids),
                            by_index[t.sample_index].text, by_index[t.sample_index].emitted,
                            by_index[t.sample_index].logprobs) for t in tables]
    from jaxserve.engine import kv_pages
    h = Handover(req.request_id, req.prompt, list(req.prompt_ids), req.params, req.seed, priority, tenant,
                 samples, layout_key(engine), req.num_cached_tokens or 0, kv_pages.nbytes(data),
                 req.prompt_logprobs)
    engine.handovers[req.request_id] = (h, data)
    engine._forget_request(req)


def import_request(engine: Engine, h: Handover, data: tuple, arrival_time: float | None = None) -> str:
    """The module doc's decode half; returns the request id. Raises HandoverRefused (another
    layout), InvalidRequestError (this engine's limits), scheduler's NoRoomForHandover (not now)."""
    if h.layout != layout_key(engine):
        raise HandoverRefused(f"request {h.request_id!r}: the prefill engine's KV layout {h.layout} "
                              f"is not this engine's {layout_key(engine)} (model, dtype, kv_cache_dtype, "
                              f"page size or draft model differ)")
    if h.request_id in engine._requests:
        from jaxserve.types import InvalidRequestError
        raise InvalidRequestError("request_id", f"{h.request_id!r} is already in flight")
    params = h.params
    matcher = engine.grammar.matcher(params.structured_outputs) if params.structured_outputs is not None else None
    eos = () if params.ignore_eos else engine.eos_token_ids
    seq_ids = engine.scheduler.admit_running(h.request_id, h.prompt_ids, params, eos,
                                             [s.table for s in h.samples], h.priority, h.tenant)
    try:
        full = [p for q in seq_ids for p in _live(engine.scheduler.get_sequence(q).pages)]
        sliding = [p for q in seq_ids for p in _live(engine.scheduler.get_sequence(q).sliding_pages)]
        engine.runner.write_pages(full, sliding, data)
    except BaseException:
        engine.scheduler.abort_request(h.request_id)  # its pages are free again
        raise
    from jaxserve.engine.engine import RequestState
    metrics = RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter())
    matchers = [None] * len(seq_ids)
    if matcher is not None:  # one per sample, copied before any consumes its own tokens
        matchers = [matcher] + [matcher.deep_copy() for _ in seq_ids[1:]]
    samples = []
    for hs, seq_id, m in zip(h.samples, seq_ids, matchers):
        smp = SampleState(h.request_id, hs.table.sample_index, seq_id, hs.seed, params, engine.tokenizer,
                          h.prompt_ids)
        smp.restore(hs.token_ids, hs.text, hs.emitted, hs.logprobs)
        if m is not None:
            for t in hs.token_ids:
                m.consume_token(t)
            smp.matcher = m
        samples.append(smp)
    req = RequestState(h.request_id, h.prompt, list(h.prompt_ids), params, samples, metrics, h.seed,
                       num_cached_tokens=h.num_cached_tokens, prompt_logprobs=h.prompt_logprobs)
    engine._requests[h.request_id] = req
    for s in samples:
        engine._by_seq[s.seq_id] = (req, s)
    return h.request_id


def _live(table: list[int]) -> list[int]:
    from jaxserve.scheduler.page_pool import NULL_PAGE
    return [p for p in table if p != NULL_PAGE]
