"""Request-facing value types: sampling parameters and finish reasons.

Names follow vLLM's offline API where they overlap, so users' scripts port with little change.
Every field is validated in `__post_init__`; an error names the field and the allowed range,
so the server can turn it into INVALID_ARGUMENT without guessing.

Rules where the usual anchors disagree (documented once, here):
- `SamplingParams()` has vLLM's defaults for every field both have (temperature 1.0, top_p 1.0,
  top_k 0, min_p 0, n 1, max_tokens 16, no penalties; tests/test_sampler.py checks them), so a
  vLLM script samples the same way here. temperature 0 means greedy: pass it for greedy output.
  Two front doors keep their own defaults: gRPC's GenerateRequest treats an unset temperature
  as proto3's 0 (greedy) and `jaxserve generate` is greedy unless --temperature is given.
- top_p 1.0 is valid (no truncation); max_tokens must be >= 1.
- top_k 0 or -1 both mean "no top-k truncation" (vLLM's default is 0, older vLLM releases used
  -1); a top_k at or above the vocabulary keeps every token, exactly as "off" does, so it is
  accepted up to int32's limit.

Every value that reaches a device array is bounded by that array's dtype here (int32 for top_k
and max_tokens, two uint32 words for the seed, float32 for the rest, with divisors kept away
from float32 overflow); the model-dependent bounds (token ids below the vocabulary, the context
length) are checked by `check_vocab` and scheduler.admission once the model is known.
"""

from __future__ import annotations

import dataclasses
import enum
import math

MAX_LOGPROBS = 20  # top-k logprobs per token, the most any request may ask for
MAX_N = 64  # samples per request
MAX_PROMPT_CHARS = 1_000_000  # checked before tokenizing, so a 10 MB prompt costs nothing
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1  # split into the two uint32 words of a threefry key (sampler.seed_words)
INT32_MAX = 2**31 - 1  # integer settings reach the step as int32 arrays
# Below this a temperature or a repetition penalty divides float32 logits into overflow (inf,
# then NaN probabilities); vLLM treats temperatures under the same epsilon as greedy. Here they
# are refused instead: 0 is the one spelling of greedy.
MIN_DIVISOR = 1e-5
MAX_CACHE_SALT_CHARS = 512
# logit_bias (OpenAI's): at most this many token ids per request (OpenAI's API limit);
# the step carries a fixed [rows, MAX_LOGIT_BIAS] pair of arrays, so this is also its width.
MAX_LOGIT_BIAS = 300
MAX_ABS_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty (OpenAI's range)
MAX_ABS_PRIORITY = 2**31  # the scheduler's priority (lower first), as gRPC's int32 carries it


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed, or a request cannot be served (no chat template)."""


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


def check_priority(priority, field: str = "priority") -> None:
    """The scheduler's priority rule, for every door that takes one (scheduler, LLM, HTTP)."""
    _check(_is_int(priority) and abs(priority) <= MAX_ABS_PRIORITY, field,
           f"must be an integer in [-2**31, 2**31], got {priority!r:.40}")


def _is_finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # this request failed; others go on


MAX_GRAMMAR_CHARS = 65_536  # a JSON schema or regex; a choice list counts its characters


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a sample to a grammar (vLLM's name): exactly one of a JSON schema (as JSON text),
    any JSON object (`json_object`), a regular expression, or a choice among strings. The
    engine compiles it with llguidance (jaxserve/engine/grammar.py)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice), "structured_outputs.choice",
                   "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [n for n, v in (("json", self.json), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("choice", self.choice)) if v is not None]
        _check(len(given) == 1, "structured_outputs",
               f"exactly one of json, json_object, regex, choice must be given, got {given or 'none'}")
        for name in ("json", "regex"):
            v = getattr(self, name)
            if v is not None:
                _check(isinstance(v, str) and 0 < len(v) <= MAX_GRAMMAR_CHARS, f"structured_outputs.{name}",
                       f"must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            _check(sum(len(c) for c in self.choice) <= MAX_GRAMMAR_CHARS, "structured_outputs.choice",
                   f"at most {MAX_GRAMMAR_CHARS} characters in all")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # vLLM's default (it samples); 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
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
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match
    min_tokens: int = 0  # vLLM's: no EOS or stop token id before this many tokens
    # OpenAI's: token id -> a bias in [-100, 100] added to that token's logit before penalties,
    # the grammar mask and sampling (+100 all but forces it, -100 all but bans it). Given as a
    # dict (or (id, bias) pairs); stored as pairs sorted by id so the params stay hashable.
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    # vLLM's: the logprob of every prompt token after the first under the model (and the top
    # `prompt_logprobs` at each position), in RequestOutput.prompt_logprobs. Such a request
    # neither reads nor feeds the prefix cache (cached tokens are not computed, so they have no
    # logits), as in vLLM.
    prompt_logprobs: int | None = None

    def __post_init__(self):
        # Accept lists from callers but store tuples so the params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            _check(isinstance(v, (list, tuple)), name, f"must be a list, got {type(v).__name__}")
            object.__setattr__(self, name, tuple(v))

        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= 2**31 - 1, "max_tokens",
               f"must be an integer in [1, 2^31-1], got {self.max_tokens!r}")
        _check(_is_finite_number(self.temperature)
               and (self.temperature == 0.0 or MIN_DIVISOR <= self.temperature <= MAX_TEMPERATURE),
               "temperature", f"must be 0 (greedy) or a number in [{MIN_DIVISOR:g}, {MAX_TEMPERATURE:g}], "
                              f"got {self.temperature!r}")
        _check(_is_finite_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX, "top_k",
               f"must be -1 or 0 (disabled) or a positive integer up to 2^31-1, got {self.top_k!r}")
        _check(_is_finite_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_finite_number(self.repetition_penalty)
               and MIN_DIVISOR <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", f"must be in [{MIN_DIVISOR:g}, {MAX_REPETITION_PENALTY:g}], "
                                     f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_finite_number(v) and -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY, name,
                   f"must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {v!r}")
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
            _check(_is_int(t) and 0 <= t <= INT32_MAX, "stop_token_ids",
                   f"must be integers in [0, 2^31-1], got {t!r}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n!r}")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str)
                                           and len(self.cache_salt) <= MAX_CACHE_SALT_CHARS),
               "cache_salt", f"must be a string of at most {MAX_CACHE_SALT_CHARS} characters, "
                             f"got {type(self.cache_salt).__name__} {str(self.cache_salt)[:40]!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if isinstance(self.structured_outputs, dict):  # from dataclasses.asdict (lockstep.py's messages)
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(self.structured_outputs is None or not self.ignore_eos, "ignore_eos",
               "cannot be combined with structured_outputs (a finished grammar allows only EOS)")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))

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
        for t, _ in self.logit_bias or ():
            _check(t < vocab_size, "logit_bias", f"token id {t} outside [0, {vocab_size})")


def _logit_bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """A dict {token id: bias} or (id, bias) pairs (dataclasses.asdict / JSON give lists) ->
    pairs sorted by id; an empty bias is None (nothing for the step to do)."""
    if isinstance(bias, dict):
        items = list(bias.items())
    else:
        _check(isinstance(bias, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in bias),
               "logit_bias", f"must be a dict of token id -> bias, got {type(bias).__name__}")
        items = [tuple(x) for x in bias]
    _check(len(items) <= MAX_LOGIT_BIAS, "logit_bias",
           f"at most {MAX_LOGIT_BIAS} token ids, got {len(items)}")
    out = {}
    for t, b in items:
        _check(_is_int(t) and 0 <= t <= INT32_MAX, "logit_bias",
               f"keys must be token ids (integers >= 0), got {t!r:.40}")
        _check(_is_finite_number(b) and -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS, "logit_bias",
               f"token {t}: bias must be a number in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {b!r:.40}")
        _check(t not in out, "logit_bias", f"token id {t} given twice")
        out[t] = float(b)
    return tuple(sorted(out.items())) or None


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
    error: str | None = None  # set with finish_reason "error": why this request failed
    error_field: str | None = None  # the request field to blame, when one is (engine/faults.py)
    # vLLM's: the stop string or stop token id that ended the sample (None for EOS or length).
    stop_reason: int | str | None = None
    # vLLM's: the sum of the chosen tokens' logprobs; None unless logprobs were asked for.
    cumulative_logprob: float | None = None


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
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (no
    # token before it), else its logprob under the model given the tokens before it.
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
    stop_reason: int | str | None = None  # on the finishing delta: CompletionOutput's stop_reason
