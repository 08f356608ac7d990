"""Verify a draft model's proposals so that the emitted tokens have exactly the target's sampling
distribution (speculative sampling: Leviathan et al. 2023, Chen et al. 2023). On device, jit-able,
fixed shapes. Two layouts of the same rule: `rejection_sample` on [B, k+1, V] (one row's run per
batch row), and `verify_slots` on the runner's flat logit slots (engine/step_program.py), which the step
uses for every draft method; both draw with the same keys, so they emit the same tokens.

One verify run of a row. The draft proposed x_0 .. x_{n-1} (n = num_drafts <= k) from q_0 .. q_{n-1};
the target scored the run: target_logits[:, i] is its next-token logits after the row's tokens and
x_0 .. x_{i-1}, so i = 0 .. k gives k + 1 positions. p_i is the distribution the sampler would draw
position i from (`sampling_probs`: temperature, then `sampler._filtered_logits`, then softmax).
    for i < n: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); stop at the first rejection;
    rejected at i: emit one token from normalize(max(0, p_i - q_i)) (the "correction");
    all n accepted: emit one token from p_n (the "bonus").
Why this is exact: with x ~ q, P(emit y at i) = q(y) min(1, p(y)/q(y)) + P(reject) r(y), where
P(reject) = 1 - sum min(p, q) = sum max(0, p - q) = Z, the residual's own mass, and r = max(0, p - q)/Z;
so it is min(p, q)(y) + max(0, p - q)(y) = p(y). By induction each emitted token follows p given the
tokens before it, i.e. the joint law of the output is the target's.

Greedy rows (temperature 0) ignore q: a draft is kept while it equals the target logits' `argmax`
(the sampler's), and the extra token is that argmax at the first mismatch or after the last draft:
the same as today's n-gram verify (scheduler.speculation.accept).

Caller's contract. Logit bias, penalties and the structured-output mask are not applied here: the
caller shapes each position's logits first, as the runner does before `sample` (the penalties at
position i count x_0 .. x_{i-1} as output), and the draft's logits get the same shaping before
`sampling_probs` makes q. s.step is the number of tokens the row had emitted before this run; the
caller adds num_accepted + 1 afterwards, so no two runs of a row share a key.

Randomness, per row and from nothing but its seed and step, so a seeded request is reproducible and
a row never depends on its batch mates:
    base           = fold_in(wrap_key_data(seed), step)   (what `sample` would draw this step with)
    key(stream, i) = fold_in(fold_in(base, stream), i)
    DRAFT  (0), i < k:   the draft's token x_i (`sample_draft`)
    ACCEPT (1), i < k:   the uniform u_i deciding x_i
    EXTRA  (2), i <= k:  the correction or bonus token at position i (only one per run is drawn)
Distinct fold_in data give independent keys, so x_i, u_i and the extra token are independent draws,
as the proof above needs; base itself is never drawn with here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.sampler import SamplingArrays, _filtered_logits, argmax

DRAFT, ACCEPT, EXTRA = 0, 1, 2  # key streams (see the module docstring)


def sampling_probs(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The distribution `sample` draws from: logits [B, V] or [B, P, V] (already biased / penalised)
    -> probabilities f32, same shape; row b's settings apply to all its P positions. Exactly the
    sampler's transforms (temperature, then `_filtered_logits`, softmax), so the target's p and the
    draft's q are built by the same code. A greedy row gets the one-hot of its `argmax`, so
    `sample_draft` gives a greedy draft its argmax."""
    lg = logits.astype(jnp.float32)
    shape = lg.shape
    B, V = shape[0], shape[-1]
    P = lg.size // (B * V)
    flat = lg.reshape(B * P, V)
    per_pos = SamplingArrays(*(jnp.repeat(jnp.asarray(a), P, axis=0) for a in s))  # row b at its P positions
    temp = jnp.where(per_pos.temperature > 0, per_pos.temperature, 1.0)[:, None]
    probs = jax.nn.softmax(_filtered_logits(flat / temp, per_pos), axis=-1)  # filtered tokens: exactly 0
    onehot = jax.nn.one_hot(argmax(flat), V, dtype=jnp.float32)
    return jnp.where(per_pos.temperature[:, None] > 0, probs, onehot).reshape(shape)


def _keys(s: SamplingArrays, stream: int, positions: jax.Array) -> jax.Array:
    """key(stream, positions[b, j]) for each row b: typed keys [B, J]; positions i32 [B, J]."""
    def row(seed, step, pos):
        base = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
        st = jax.random.fold_in(base, stream)
        return jax.vmap(lambda i: jax.random.fold_in(st, i))(pos)
    return jax.vmap(row)(jnp.asarray(s.seed), jnp.asarray(s.step), positions)


def _draw(keys: jax.Array, weights: jax.Array) -> jax.Array:
    """One token per row from unnormalised weights [B, V] >= 0 (zeros never drawn); keys [B]."""
    return jax.vmap(jax.random.categorical)(keys, jnp.log(weights)).astype(jnp.int32)


def sample_draft(q: jax.Array, s: SamplingArrays, position) -> jax.Array:
    """The draft's token at run position `position` (int or i32 [B]) from q [B, V] =
    `sampling_probs(draft logits, s)`, with key(DRAFT, position): i32 [B]."""
    pos = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (q.shape[0],))[:, None]
    return _draw(_keys(s, DRAFT, pos)[:, 0], q.astype(jnp.float32))


def _accept(u: jax.Array, px: jax.Array, qx: jax.Array) -> jax.Array:
    """u < p(x) / q(x), i.e. accepted with probability min(1, p/q), without dividing. q(x) = 0 is a
    token the draft could not have drawn (a caller's error, or a probability rounded to zero): it
    is rejected, not accepted on an infinite ratio, so nothing is kept that q cannot vouch for."""
    return (qx > 0) & (u * qx < px)


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """The correction's weights max(0, p - q) [B, V], unnormalised (categorical normalises). All
    zero means p <= q everywhere, so p = q (both sum to 1) and a rejection had probability
    Z = sum max(0, p - q) = 0: it can happen only through f32 rounding of p and q, and any
    choice is exact up to that measure-zero event; p is the natural one (the token p_i would give
    with no draft at all)."""
    r = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p)


def _leading(ok: jax.Array) -> jax.Array:
    """[B, k] bool -> [B] i32: how many leading entries are True."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)


def _at(x: jax.Array, n: jax.Array) -> jax.Array:
    """x [B, P, ...] at position n [B] -> [B, ...]."""
    idx = n.reshape(-1, *([1] * (x.ndim - 1)))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def _verify_greedy(lg, q, x, valid, num_drafts, s):
    ids = argmax(lg)  # [B, k + 1]
    n = _leading(valid & (x == ids[:, :-1]))
    return n, _at(ids, n)


def _verify_mixed(lg, q, x, valid, num_drafts, s):
    B, k = x.shape
    n_greedy, extra_greedy = _verify_greedy(lg, q, x, valid, num_drafts, s)
    p = sampling_probs(lg, s)  # [B, k + 1, V]
    px = jnp.take_along_axis(p[:, :k], x[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(jax.random.uniform))(_keys(s, ACCEPT, jnp.broadcast_to(jnp.arange(k), (B, k))))
    n = _leading(valid & _accept(u, px, qx))
    # Only position n's extra token is drawn: the correction if a draft was rejected there,
    # otherwise (n == num_drafts) the bonus from p_n.
    rejected = n < num_drafts
    p_n = _at(p, n)
    q_n = _at(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1), n)
    weights = jnp.where(rejected[:, None], _residual(p_n, q_n), p_n)
    extra = _draw(_keys(s, EXTRA, n[:, None])[:, 0], weights)
    greedy = jnp.asarray(s.temperature) <= 0
    return jnp.where(greedy, n_greedy, n), jnp.where(greedy, extra_greedy, extra)


def rejection_sample(target_logits: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array,
                     num_drafts: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Verify each row's drafts (see the module docstring for the rule and the keys).

    target_logits [B, k+1, V] any float: the target's shaped logits at the run's k + 1 positions.
    draft_probs [B, k, V]: q_i, the draft's distribution x_i was drawn from (`sampling_probs` of
        the draft's shaped logits); ignored for greedy rows and past num_drafts.
    draft_tokens [B, k] i32; num_drafts [B] i32 in 0..k: entries at or past num_drafts are padding,
        never read. A draft outside [0, V) is rejected.
    s: the rows' SamplingArrays, step = tokens emitted before this run.
    Returns tokens [B, k+1] i32 (the num_accepted kept drafts, then the correction or bonus, then
    -1 padding) and num_accepted [B] i32 (so num_accepted + 1 tokens are emitted).
    """
    lg = target_logits.astype(jnp.float32)
    B, k1, V = lg.shape
    k = k1 - 1
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    num_drafts = jnp.asarray(num_drafts, jnp.int32)
    valid = ((jnp.arange(k) < num_drafts[:, None]) & (draft_tokens >= 0) & (draft_tokens < V))
    x = jnp.where(valid, draft_tokens, 0)  # gathers stay in range; `valid` decides
    q = draft_probs.astype(jnp.float32)
    # As in `sample`: an all-greedy batch skips the filters' bisections at run time.
    n, extra = jax.lax.cond(jnp.any(jnp.asarray(s.temperature) > 0), _verify_mixed, _verify_greedy,
                            lg, q, x, valid, num_drafts, s)
    j = jnp.arange(k + 1)
    kept = jnp.concatenate([x, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], kept, jnp.where(j == n[:, None], extra[:, None], -1))
    return tokens.astype(jnp.int32), n


def verify_slots(logits: jax.Array, slot_row: jax.Array, slot_pos: jax.Array, next_token: jax.Array,
                 s: SamplingArrays, draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`rejection_sample` over the runner's flat logit slots instead of a [B, k+1, V] batch, so a
    step projects only the slots it has (R = S + drafts, not S * (k + 1)).

    logits [R, V]: slot j's shaped target logits; slot_row [R] i32: its row (-1 = padding slot);
    slot_pos [R] i32: its position in that row's run (0 = after the row's last real token, i =
    after its i-th draft); next_token [R] i32: the token that follows slot j in the run (the draft
    x_pos it checks, when pos < the row's number of drafts; anything otherwise). A row's drafts
    are the positions its slots reach: num_drafts = its largest slot_pos. s: the rows'
    SamplingArrays [S] (step = tokens emitted before this run). draft_probs [R, V] or None: q at
    each slot, None meaning the draft was proposed with certainty (n-gram: q is the one-hot of
    the drafted token, so acceptance has probability p(x) and the correction is p without x).

    Returns per slot the token emitted there if the run reaches it (tokens [R] i32: the kept draft
    at positions < n, the correction or bonus at n, junk after) and per row num_accepted [S] i32.
    """
    lg = logits.astype(jnp.float32)
    R, V = lg.shape
    S = jnp.asarray(s.temperature).shape[0]
    live = slot_row >= 0
    row = jnp.where(live, slot_row, 0)
    seg = jnp.where(live, slot_row, S)  # segment ids: padding slots fall out of range (dropped)
    pos = jnp.where(live, slot_pos, 0)
    num_drafts = jnp.zeros((S,), jnp.int32).at[seg].max(pos, mode="drop")
    x = jnp.asarray(next_token, jnp.int32)
    valid = live & (pos < num_drafts[row]) & (x >= 0) & (x < V)
    x = jnp.where(valid, x, 0)
    per_slot = SamplingArrays(*(jnp.asarray(a)[row] for a in s))  # the slot's row's settings and keys
    greedy = per_slot.temperature <= 0
    ids = argmax(lg)

    def stop_at(ok):  # per row, the position of its first slot that does not keep a draft
        stop = live & ~(valid & ok)
        n = jnp.full((S,), jnp.iinfo(jnp.int32).max, jnp.int32).at[jnp.where(stop, seg, S)].min(pos, mode="drop")
        return jnp.minimum(n, num_drafts)  # rows without slots: 0

    def mixed():
        p = sampling_probs(lg, per_slot)
        if draft_probs is None:  # one-hot q: q(x) = 1, and q itself only at the S stopping slots
            qx = jnp.ones((R,), jnp.float32)
            q_at = lambda idx: jax.nn.one_hot(x[idx], V, dtype=jnp.float32)  # noqa: E731
        else:
            q = draft_probs.astype(jnp.float32)
            qx = jnp.take_along_axis(q, x[:, None], axis=-1)[:, 0]
            q_at = lambda idx: q[idx]  # noqa: E731
        px = jnp.take_along_axis(p, x[:, None], axis=-1)[:, 0]
        u = jax.vmap(jax.random.uniform)(_keys(per_slot, ACCEPT, pos[:, None])[:, 0])
        n = stop_at(jnp.where(greedy, x == ids, _accept(u, px, qx)))
        # One draw per row, at its stopping slot: the correction where a valid draft stands
        # there, else the bonus from p (as rejection_sample draws only at n).
        at_n = live & (pos == n[row])
        j = jnp.full((S,), R, jnp.int32).at[jnp.where(at_n, seg, S)].min(jnp.arange(R, dtype=jnp.int32), mode="drop")
        j = jnp.minimum(j, R - 1)  # rows without slots: any slot, unused
        weights = jnp.where(valid[j][:, None], _residual(p[j], q_at(j)), p[j])
        drawn = _draw(_keys(s, EXTRA, n[:, None])[:, 0], weights)
        extra = jnp.where(jnp.asarray(s.temperature) <= 0, ids[j], drawn)  # [S]
        return n, extra[row]

    def all_greedy():
        return stop_at(x == ids), ids
    # As in `sample`: a step whose drafting rows are all greedy skips the filters' bisections.
    n, extra = jax.lax.cond(jnp.any(live & ~greedy & (num_drafts[row] > 0)), mixed, all_greedy)
    tokens = jnp.where(pos < n[row], x, extra)
    return tokens.astype(jnp.int32), n
