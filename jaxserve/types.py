"""Request-facing value types: sampling parameters and finish reasons.

Names follow vLLM's offline API where they overlap, so users' scripts port with little change.
Every field is validated in `__post_init__`; an error names the field and the allowed range,
so the server can turn it into INVALID_ARGUMENT without guessing.

Rules where the usual anchors disagree (documented once, here):
- temperature 0 means greedy; top_p 1.0 is valid (no truncation); max_tokens must be >= 1.
- top_k 0 or -1 both mean "no top-k truncation" (vLLM uses -1, HF uses 0).
"""

from __future__ import annotations

import dataclasses
import enum
import math

MAX_LOGPROBS = 20  # top-k logprobs per token, the most any request may ask for
MAX_N = 64  # samples per request
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT_CHARS = 512


class InvalidRequestError(ValueError):
    """A request field is outside its allowed range. `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise InvalidRequestError(field, message)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # this request failed; others go on


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs to return per token (0 = chosen only)
    skip_special_tokens: bool = True
    # Prefix-cache namespace (vLLM's name): requests share cached KV pages only with requests
    # of the same salt. The server sets it from the caller's tenant (server/tenancy.py).
    cache_salt: str | None = None

    def __post_init__(self):
        # Accept lists from callers but store tuples so the params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            _check(isinstance(v, (list, tuple)), name, f"must be a list, got {type(v).__name__}")
            object.__setattr__(self, name, tuple(v))

        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= 2**31 - 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_finite_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", f"must be a finite number in [0, 100], got {self.temperature!r}")
        _check(_is_finite_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_finite_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_finite_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_finite_number(v) and -2.0 <= v <= 2.0, name, f"must be in [-2, 2], got {v!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED), "seed",
               f"must be an integer in [0, 2^63-1], got {self.seed!r}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop",
                   f"each stop string must be a non-empty string of at most "
                   f"{MAX_STOP_STRING_CHARS} characters, got {s!r:.80}")
        _check(len(self.stop_token_ids) <= MAX_STOP_STRINGS, "stop_token_ids",
               f"at most {MAX_STOP_STRINGS} stop token ids")
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", f"must be non-negative integers, got {t!r}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n!r}")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str)
                                           and len(self.cache_salt) <= MAX_CACHE_SALT_CHARS),
               "cache_salt", f"must be a string of at most {MAX_CACHE_SALT_CHARS} characters, "
                             f"got {type(self.cache_salt).__name__} {str(self.cache_salt)[:40]!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids are bounds-checked on the host: on device an out-of-range id gathers garbage."""
        for t in self.stop_token_ids:
            _check(t < vocab_size, "stop_token_ids", f"{t} outside [0, {vocab_size})")


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # of the chosen token under the model's raw distribution
    top: list[tuple[int, float]]  # the `logprobs` most likely (token id, logprob), best first


@dataclasses.dataclass
class CompletionOutput:
    index: int  # sample index, 0 .. n-1
    text: str
    token_ids: list[int]
    finish_reason: str | None  # a FinishReason value once finished
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set with finish_reason "error"


@dataclasses.dataclass
class RequestMetrics:
    """Seconds, from the engine's perf_counter clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token: the prompt's prefill (chunks, and any wait between)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token to last token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    def tpot(self, num_tokens: int) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or num_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclasses.dataclass
class StepOutput:
    """What one engine step produced for one sample: the streaming delta."""

    request_id: str
    index: int
    token_ids: list[int]  # new tokens this step (usually one; none at an abort)
    text: str  # new text this step (held back while it may be the start of a stop string)
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
