"""Admission checks: a request the scheduler could never finish is refused before anything is
allocated, with an `InvalidRequestError` naming the field and the limit.

The KV a sample needs at most is `prompt + max_tokens - 1` tokens: the last sampled token is
never fed back, so its K/V is never written. A request whose single sample needs more pages
than the whole pool would be preempted and retried forever, so it is refused here; every
admitted sample fits the pool alone, which is what lets the oldest sequence always progress.

With a sliding window whose pages are freed (window.py) a sample never holds more than the
window behind its step's first token plus the step's tokens: `peak_pages`. A model whose
sliding layers are a KV group of their own is checked against both pools.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence as SequenceABC

from jaxserve.config import SchedulerConfig
from jaxserve.types import InvalidRequestError, SamplingParams


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def peak_pages(cfg: SchedulerConfig, num_tokens: int, kv_window: int | None = None) -> int:
    """The most pages one sample of `num_tokens` KV tokens holds at once. Windowed: the pages
    of positions nc - W + 1 .. nc + step tokens - 1 (a step: at most max_num_batched_tokens
    plus the drafts), one more for a window that starts mid-page."""
    full = pages_for(num_tokens, cfg.page_size)
    if kv_window is None:
        return full
    step = cfg.max_num_batched_tokens + cfg.num_speculative_tokens
    return min(full, pages_for(kv_window - 1 + step, cfg.page_size) + 1)


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def validate_request(cfg: SchedulerConfig, request_id: str, prompt_ids: SequenceABC[int],
                     params: SamplingParams, eos_token_ids: Collection[int],
                     live_request_ids: Collection[str], kv_window: int | None = None) -> tuple[int, ...]:
    """Raise `InvalidRequestError` for a request that cannot be admitted; return the prompt tuple.
    kv_window: the scheduler frees pages behind this window (peak_pages)."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id",
                                  f"must be a non-empty string, got {request_id!r:.80}")
    if request_id in live_request_ids:
        raise InvalidRequestError("request_id",
                                  f"{request_id!r:.80} is already in use by a live request")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, SequenceABC):
        raise InvalidRequestError(
            "prompt", f"must be a sequence of token ids, got {type(prompt_ids).__name__}")
    p = len(prompt_ids)
    if p == 0:
        raise InvalidRequestError("prompt", "must contain at least one token")
    # Length before content: a 10 MB prompt is refused without walking it.
    if p > cfg.max_prompt_len:
        raise InvalidRequestError(
            "prompt", f"{p} tokens is more than max_prompt_len={cfg.max_prompt_len}")
    prompt = tuple(prompt_ids)
    if not all(_is_token(t) for t in prompt):
        bad = next(t for t in prompt if not _is_token(t))
        raise InvalidRequestError(
            "prompt", f"token ids must be non-negative integers, got {bad!r:.40}")
    for t in eos_token_ids:
        if not _is_token(t):
            raise InvalidRequestError(
                "eos_token_ids", f"must be non-negative integers, got {t!r:.40}")
    m = params.max_tokens
    if m > cfg.max_output_len:
        raise InvalidRequestError(
            "max_tokens", f"{m} is more than max_output_len={cfg.max_output_len}")
    if p + m > cfg.max_model_len:
        raise InvalidRequestError(
            "max_tokens", f"prompt ({p} tokens) + max_tokens ({m}) = {p + m} is more than "
                          f"the model's context max_model_len={cfg.max_model_len}")
    usable = cfg.num_usable_pages
    if peak_pages(cfg, p, kv_window) > usable:
        raise InvalidRequestError(
            "prompt", f"{p} tokens need {peak_pages(cfg, p, kv_window)} KV pages of {cfg.page_size} "
                      f"tokens; the whole KV cache has {usable}")
    need = peak_pages(cfg, p + m - 1, kv_window)
    if need > usable:
        raise InvalidRequestError(
            "max_tokens", f"prompt ({p} tokens) + max_tokens ({m}) need {need} KV pages of "
                          f"{cfg.page_size} tokens per sample; the whole KV cache has {usable}")
    if cfg.sliding_window is not None:  # the sliding layers' own pool (window.py)
        need = peak_pages(cfg, p + m - 1, cfg.sliding_window)
        if need > cfg.num_sliding_pages - 1:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({p} tokens) + max_tokens ({m}) need {need} KV pages of "
                              f"{cfg.page_size} tokens per sample in the sliding layers' cache; it "
                              f"has {cfg.num_sliding_pages - 1}")
    return prompt
