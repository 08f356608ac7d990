"""On-device token sampling for a batch of rows, each with its own parameters and seed.

Every per-request setting is an array argument [B] (never a Python value closed over), so one
compiled function serves any mix of greedy and sampled rows. Each row's randomness comes from
its own key, `fold_in(key(seed), step)`, so a row's tokens never depend on its batch mates.

Order of operations (vLLM's): logit bias -> penalties -> temperature -> top-k -> top-p -> min-p
-> draw.
Temperature 0 rows take the argmax of the raw (penalised) logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30


class SamplingArrays(NamedTuple):
    """Per-row sampling settings; every field is [B]."""

    temperature: jax.Array  # f32, 0 = greedy
    top_k: jax.Array  # i32, <= 0 = off
    top_p: jax.Array  # f32, 1.0 = off
    min_p: jax.Array  # f32, 0.0 = off
    seed: jax.Array  # u32 [B, 2]: the two halves of a 64-bit seed (as jax.random.PRNGKey)
    step: jax.Array  # i32, how many tokens this row has sampled so far


def seed_words(seed: int) -> tuple[int, int]:
    """Split a 64-bit seed into the two uint32 words jax.random.PRNGKey would use."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def host_sampling_arrays(rows: list[dict]) -> SamplingArrays:
    """Build the arrays from per-row dicts with keys temperature, top_k, top_p, min_p, seed, step."""
    return SamplingArrays(
        temperature=np.array([r["temperature"] for r in rows], np.float32),
        top_k=np.array([r["top_k"] for r in rows], np.int32),
        top_p=np.array([r["top_p"] for r in rows], np.float32),
        min_p=np.array([r["min_p"] for r in rows], np.float32),
        seed=np.array([seed_words(r["seed"]) for r in rows], np.uint32).reshape(len(rows), 2),
        step=np.array([r["step"] for r in rows], np.int32),
    )


class PenaltyArrays(NamedTuple):
    """Per-row penalties and the token history they look at."""

    repetition: jax.Array  # f32 [B], 1.0 = off; applies to prompt and output tokens
    presence: jax.Array  # f32 [B], 0.0 = off; output tokens only
    frequency: jax.Array  # f32 [B], 0.0 = off; output tokens only
    prompt_ids: jax.Array  # i32 [B, M], -1 = empty
    output_ids: jax.Array  # i32 [B, M], -1 = empty


def apply_penalties(logits: jax.Array, p: PenaltyArrays) -> jax.Array:
    """vLLM's rules: repetition divides positive logits (multiplies negative ones) of every token
    seen in prompt or output; presence subtracts once per seen output token, frequency per
    occurrence. logits [B, V] f32."""
    B, V = logits.shape
    rows = jnp.arange(B)[:, None]

    def counts(ids):  # -1 -> index V, dropped
        return jnp.zeros((B, V), jnp.int32).at[rows, jnp.where(ids >= 0, ids, V)].add(1, mode="drop")

    out_counts = counts(p.output_ids)
    seen = (out_counts > 0) | (counts(p.prompt_ids) > 0)
    rp = p.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - p.frequency[:, None] * out_counts
    return logits - p.presence[:, None] * (out_counts > 0)


class BiasArrays(NamedTuple):
    """Per-row logit_bias as fixed-width pairs, so any request's bias fits one compiled step."""

    ids: jax.Array  # i32 [B, MAX_LOGIT_BIAS]; padding is V or above (dropped by the scatter)
    values: jax.Array  # f32 [B, MAX_LOGIT_BIAS]; 0 in padding


def apply_logit_bias(logits: jax.Array, b: BiasArrays) -> jax.Array:
    """OpenAI's logit_bias: add each row's biases to its tokens' logits. logits [B, V] f32; ids
    are unique within a row (types.SamplingParams), so the scatter-add is one addition each."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, b.ids].add(b.values, mode="drop")


def apply_token_bitmask(logits: jax.Array, words: jax.Array) -> jax.Array:
    """Structured outputs: logits [B, V] with every token whose bit is 0 in `words`
    ([B, ceil(V/32)] int32; bit j of word w = token 32w + j) set to -1e30, so neither the argmax
    nor a draw can pick it (the grammar always allows at least one token, EOS at the end)."""
    B, V = logits.shape
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(B, -1)[:, :V] != 0
    return jnp.where(allowed, logits, _NEG)


def logprobs_of(logits: jax.Array, chosen: jax.Array, top_n: int):
    """Log-softmax of the model's raw logits: (chosen [B], top ids [B, top_n], top logprobs)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen_lp = jnp.take_along_axis(lp, chosen[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, top_n)
    return chosen_lp, top_ids.astype(jnp.int32), top_lp


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (finite values and infinities): the sign bit flips
    the halves, and a negative's magnitude bits are inverted."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _bisect_keys(fits, rows: int) -> jax.Array:
    """Per row, the largest uint32 T with fits(T) True, fits monotone (True up to some T, then
    False) and fits(0) True: 32 halvings, each one pass over the row."""
    def body(_, bounds):
        lo, hi = bounds
        d = hi - lo
        mid = lo + d // 2 + d % 2  # rounded up: no overflow, and lo == hi stays put
        ok = fits(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    lo = jnp.zeros((rows,), jnp.uint32)
    hi = jnp.full((rows,), 0xFFFFFFFF, jnp.uint32)
    return jax.lax.fori_loop(0, 32, body, (lo, hi))[0]


def _filtered_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] f32 (already temperature-scaled) -> the same with every token top-k, top-p
    or min-p drops set to _NEG. Without sorting: XLA:CPU's sort of a [40, 49152] batch took
    540 ms (a decode step of that batch is ~120), and its scratch slowed even steps that did
    not sample. Each filter is a threshold found by bisection over the values' bit patterns
    (32 passes over the row), in vLLM's order:
      top-k   keep the tokens at or above the k-th largest logit;
      top-p   over the softmax of what top-k kept, keep token i while the mass of the tokens
              more likely than it is below top_p (so the most likely always stays);
      min-p   keep probabilities at least min_p times the largest.
    Against a sort, only exact ties at a threshold differ: tied tokens are all kept, where a
    sort keeps them in id order."""
    B, V = logits.shape
    keys = _order_keys(logits)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)

    def top_k_keys():
        return _bisect_keys(lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k, B)
    kth = jax.lax.cond(jnp.any(k < V), top_k_keys, lambda: jnp.zeros((B,), jnp.uint32))
    kept = jnp.where(keys >= kth[:, None], logits, _NEG)
    probs = jax.nn.softmax(kept, axis=-1)
    pkeys = _order_keys(probs)

    def top_p_keys():
        # the smallest T whose strictly-greater mass is below top_p: bisect on "mass >= top_p"
        above = lambda t: jnp.sum(jnp.where(pkeys > t[:, None], probs, 0.0), axis=-1) >= s.top_p  # noqa: E731
        return _bisect_keys(lambda t: (t == 0) | above(t - 1), B)
    cut = jax.lax.cond(jnp.any(s.top_p < 1.0), top_p_keys, lambda: jnp.zeros((B,), jnp.uint32))
    keep = (pkeys >= cut[:, None]) | (s.top_p[:, None] >= 1.0)
    keep &= probs >= s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, kept, _NEG)


def sample(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] (any float dtype) -> next token ids [B] int32."""
    logits = logits.astype(jnp.float32)
    # The filters' bisections (64 passes over every row) cost more than the argmax, so an
    # all-greedy batch skips them at run time.
    return jax.lax.cond(jnp.any(s.temperature > 0), _sample_mixed, _greedy, logits, s)


ARGMAX_CHUNK = 128  # vocabulary entries per chunk in argmax's first pass


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax(logits, axis=-1) as int32, the same index (the first maximum; the first NaN
    where there is one), in two passes without argmax's (value, index) reduce, which XLA:CPU runs
    as scalar code (4.7 ms for [40, 49152] logits): each chunk of ARGMAX_CHUNK entries' largest
    key (_argmax_keys), the first chunk holding the row's largest, then the first hit inside that
    one chunk. A flat max-then-min-index (1.5 ms alone) wrote two [B, V] temporaries that cost
    7-10 ms a 40-row step in the engine; this writes [B, V / 128]."""
    *lead, v = logits.shape
    c = ARGMAX_CHUNK
    nc = -(-v // c)
    x = logits.reshape(-1, v)
    if nc * c != v:  # -inf padding after the last entry never wins (a tie picks the lower index)
        x = jnp.pad(x, ((0, 0), (0, nc * c - v)), constant_values=-jnp.inf)
    x = x.reshape(x.shape[0], nc, c)
    chunk_best = jnp.max(_argmax_keys(x), axis=-1)
    best = jnp.max(chunk_best, axis=-1, keepdims=True)
    first = _first_hit(chunk_best, best)
    inside = jnp.take_along_axis(x, first[:, None, None], axis=1)[:, 0]
    return (first * c + _first_hit(_argmax_keys(inside), best)).reshape(lead)


def _argmax_keys(x: jax.Array) -> jax.Array:
    """uint32 keys whose integer max is argmax's winner: the float order (_order_keys) with -0.0
    as 0.0 (they compare equal) and every NaN, of either sign, above +inf. Integer maxima are
    exact, where XLA:CPU's vectorised float max may drop a NaN."""
    x = x.astype(jnp.float32)
    keys = _order_keys(jnp.where(x == 0, jnp.float32(0), x))
    return jnp.where(jnp.isnan(x), jnp.uint32(0xFFFFFFFF), keys)


def _first_hit(keys: jax.Array, target: jax.Array) -> jax.Array:
    """[B, n] -> [B]: the first index where keys equals target [B, 1]."""
    n = keys.shape[-1]
    return jnp.min(jnp.where(keys == target, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _greedy(logits, s):
    return argmax(logits)


def _sample_mixed(logits, s):
    greedy_ids = argmax(logits)
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    masked = _filtered_logits(logits / temp, s)

    def draw(seed_pair, step, row_logits):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed_pair, impl="threefry2x32"), step)
        return jax.random.categorical(key, row_logits)

    sampled_ids = jax.vmap(draw)(s.seed, s.step, masked).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled_ids, greedy_ids)
