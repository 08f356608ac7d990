"""Self-speculative drafts: the target's own first N layers, its final norm and LM head as the draft
model (`speculative_layers=N`), so no second checkpoint is needed (the embedded default has no
smaller sibling).

The draft's KV is the target's: layer i < N of the draft is layer i of the target, so the KV the
target wrote for a sequence's tokens is exactly the draft's. Drafting a row's k tokens runs k
one-token passes of the N layers over the step's rows (a fori_loop inside one program, per bucket),
each writing its token's KV into those layers at positions the scheduler gave the row's drafts
(pages it already holds); the target step then runs the decode token and the drafts through every
layer and writes all their KV again, so what the draft wrote is overwritten before anything reads
it as the target's, and a refused draft's KV is garbage in slots the sequence will write again.

Draft token j of a row is drawn from q_j = sampler's law of the draft's logits (rejection_sampler.
sampling_probs: the row's temperature, top-k, top-p, min-p; the argmax for a greedy row) with
key(DRAFT, j); the step verifies with the same q (rejection_sampler.verify_slots), so sampled rows
keep the target's law exactly. The program returns the draft tokens (to the host, which puts them
in the plan) and q [S, k, V] (kept on device for the step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config_base import ConfigError
from jaxserve.engine.step_arrays import StepInputs
from jaxserve.model.paged_attention import PagedMeta
from jaxserve.model.rejection_sampler import sample_draft, sampling_probs


def check(num_layers: int, model_layers: int, two_groups: bool) -> None:
    """speculative_layers against the model, one line naming the field."""
    if not 1 <= num_layers < model_layers:
        raise ConfigError(f"speculative_layers: must be in [1, {model_layers - 1}] (the model has {model_layers} "
                          f"layers; the draft is its first N), got {num_layers}")
    if two_groups:
        raise ConfigError("speculative_layers: not supported for a model with sliding and full KV groups "
                          "(Gemma 2 / 3); use n-gram drafts (speculative_layers 0)")


def row_drafts(inp: StepInputs, S: int) -> jax.Array:
    """[S] i32: each row's draft count (the largest position its logit slots reach)."""
    return jnp.zeros((S,), jnp.int32).at[jnp.where(inp.slot_row >= 0, inp.slot_row, S)].max(inp.slot_pos, mode="drop")


def make_draft_fn(graphdef, attend, num_layers: int, k: int, page_size: int):
    """(state, cache, inp: StepInputs) -> (cache, tokens [S, k] i32, q [S, k, V] f32). Rows past
    their own draft count (and rows that do not draft) run as padding: position -1, nothing
    written, their tokens and q don't-cares."""

    def draft(state, cache, inp: StepInputs):
        model = nnx.merge(graphdef, state)
        S = inp.block_tables.shape[0]
        first = inp.logit_index[:S]  # row i's last real token: the decode token its drafts follow
        pos0, tok0 = inp.positions[first], inp.tokens[first]
        n = row_drafts(inp, S)
        rows = jnp.arange(S, dtype=jnp.int32)
        V = model.cfg.vocab_size

        def one(j, carry):
            cache, tok, toks, qs = carry
            pos = jnp.where(j < n, pos0 + j, -1)
            page = jnp.take_along_axis(inp.block_tables, jnp.maximum(pos, 0)[:, None] // page_size, axis=1)[:, 0]
            slots = jnp.where(pos >= 0, page * page_size + jnp.maximum(pos, 0) % page_size, -1)
            meta = PagedMeta(pos, slots, rows, inp.block_tables)
            h, cache = model.hidden(tok[None], pos[None], cache, attend, meta, num_layers=num_layers)
            q = sampling_probs(model.head(h)[0], inp.sampling)  # [S, V]
            x = sample_draft(q, inp.sampling, j)
            return cache, x, toks.at[:, j].set(x), qs.at[:, j].set(q)

        init = (cache, tok0, jnp.zeros((S, k), jnp.int32), jnp.zeros((S, k, V), jnp.float32))
        cache, _, toks, qs = jax.lax.fori_loop(0, k, one, init)
        return cache, toks, qs

    return draft


def slot_probs(q: jax.Array, inp: StepInputs) -> jax.Array:
    """The draft's q at each logit slot [R, V]: slot (row, pos) checks draft pos with q[row, pos];
    bonus and padding slots get q of some draft, never read (verify_slots reads q only where a
    draft stands)."""
    k = q.shape[1]
    return q[jnp.where(inp.slot_row >= 0, inp.slot_row, 0), jnp.minimum(inp.slot_pos, k - 1)]
