"""Single-request generation on the dense model: the reference the paged engine must match.

One request at a time: prefill the whole prompt, then decode one token per step, each step one
call of an ahead-of-time compiled executable. Shapes come from two bucket lists, so a new prompt
length reuses an executable instead of recompiling:
  prompt length  -> PREFILL_BUCKETS (tokens per prefill call)
  prompt + max_tokens -> CACHE_BUCKETS (slots in the contiguous KV cache)
The cache is donated to every call, so XLA updates it in place rather than copying it per step.
Sampling runs on device inside the same executable; one int32 per step crosses to the host.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import huge_pages
from jaxserve.model.dense_attention import init_dense_cache, make_dense_attend
from jaxserve.model.llama import KVCache, Llama
from jaxserve.model.sampler import SamplingArrays, host_sampling_arrays, sample
from jaxserve.types import InvalidRequestError, SamplingParams

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CACHE_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # prompt submitted -> first token on the host
    decode_s: float = 0.0  # first token -> last token
    compile_s: float = 0.0  # compilations this request triggered (0 when buckets were warm)
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        return (self.output_tokens - 1) / self.decode_s if self.output_tokens > 1 and self.decode_s else 0.0


class DenseGenerator:
    def __init__(self, model: Llama, eos_token_ids: tuple[int, ...] = ()):
        self.cfg = model.cfg
        self.dtype = model.dtype
        self.eos_token_ids = tuple(eos_token_ids)
        self._graphdef, self._state = nnx.split(model)
        # On CPU the weights on 2 MiB pages, as the paged engine keeps them (jaxserve/huge_pages.py;
        # `jaxserve generate`'s 100-token decode 32.6-33.2 -> 35.4-37.4 tok/s on a 2-core Intel Xeon), moved while the
        # first request compiles. Not the cache: a request's own, small and short-lived.
        self.huge_pages = huge_pages.InBackground(self._state)
        self._attend = make_dense_attend(self.cfg)
        self._executables: dict[tuple[int, int], object] = {}
        self.num_compilations = 0

    # ---- compiled step -------------------------------------------------------------------

    def _step_fn(self, state, tokens, positions, logit_index, cache: KVCache, s: SamplingArrays):
        model = nnx.merge(self._graphdef, state)
        logits, cache = model(tokens, positions, cache, self._attend, positions, logit_index)
        return sample(logits[:, 0], s), cache

    def _executable(self, T: int, S: int):
        key = (T, S)
        if key not in self._executables:
            B = 1
            i32 = jax.ShapeDtypeStruct((B, T), jnp.int32)
            cache_shape = jax.ShapeDtypeStruct(
                (self.cfg.num_layers, B, S, self.cfg.num_kv_heads, self.cfg.head_dim), self.dtype)
            s = SamplingArrays(*(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                 for x in host_sampling_arrays([_row(SamplingParams(), 0, 0)])))
            jitted = jax.jit(self._step_fn, donate_argnums=(4,))
            self._executables[key] = jitted.lower(
                self._state, i32, i32, jax.ShapeDtypeStruct((B, 1), jnp.int32),
                KVCache(cache_shape, cache_shape), s).compile()
            self.num_compilations += 1
        return self._executables[key]

    def warmup(self, prompt_len: int, max_tokens: int) -> float:
        """Compile the executables a request of this size needs; returns seconds spent."""
        t0 = time.perf_counter()
        S = self._cache_len(prompt_len, max_tokens)
        self._executable(pick_bucket(PREFILL_BUCKETS, prompt_len), S)
        self._executable(1, S)
        return time.perf_counter() - t0

    def _cache_len(self, prompt_len: int, max_tokens: int) -> int:
        limit = self.cfg.max_position_embeddings
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                              f"the model's context of {limit} tokens")
        return min(pick_bucket(CACHE_BUCKETS, prompt_len + max_tokens), max(limit, CACHE_BUCKETS[0]))

    # ---- generation ----------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 stats: GenerationStats | None = None) -> Iterator[int]:
        """Yields generated token ids one by one (the EOS / stop token included)."""
        stats = stats if stats is not None else GenerationStats()
        P = len(prompt_ids)
        if P == 0:
            raise InvalidRequestError("prompt", "must contain at least one token")
        V = self.cfg.vocab_size
        bad = [t for t in prompt_ids if not (0 <= t < V)]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad[0]} outside [0, {V})")
        params.check_vocab(V)
        # Refused, not ignored: this single-request path samples without them (the paged
        # engine, LLM / serve, applies both).
        for name in ("logit_bias", "prompt_logprobs"):
            if getattr(params, name) is not None:
                raise InvalidRequestError(name, "is not supported by the dense generator (use jaxserve.LLM)")
        S = self._cache_len(P, params.max_tokens)
        T = pick_bucket(PREFILL_BUCKETS, P)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])

        t0 = time.perf_counter()
        compiles_before = self.num_compilations
        prefill, decode = self._executable(T, S), self._executable(1, S)
        stats.compile_s = time.perf_counter() - t0 if self.num_compilations > compiles_before else 0.0
        stats.prompt_tokens = P

        cache = init_dense_cache(self.cfg, 1, S, self.dtype)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :P] = prompt_ids
        positions = np.full((1, T), -1, np.int32)
        positions[0, :P] = np.arange(P)
        t_start = time.perf_counter()
        next_tok, cache = prefill(self._state, tokens, positions, np.array([[P - 1]], np.int32),
                                  cache, host_sampling_arrays([_row(params, seed, 0)]))
        for step in range(params.max_tokens):
            tok = int(next_tok[0])
            now = time.perf_counter()
            if step == 0:
                stats.ttft_s = now - t_start
            stats.token_times.append(now)
            stats.output_tokens = step + 1
            stats.decode_s = now - stats.token_times[0]
            yield tok
            if tok in stops:
                stats.finish_reason = "stop"
                return
            pos = P + step
            if step + 1 == params.max_tokens:
                break
            next_tok, cache = decode(self._state, np.array([[tok]], np.int32),
                                     np.array([[pos]], np.int32), np.zeros((1, 1), np.int32),
                                     cache, host_sampling_arrays([_row(params, seed, step + 1)]))
        stats.finish_reason = "length"


def _row(params: SamplingParams, seed: int, step: int) -> dict:
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                min_p=params.min_p, seed=seed, step=step)
