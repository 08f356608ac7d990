"""Draft models for speculative decoding, run in a draft program before each step.

Two kinds. Self-speculation (`speculative_layers=N`): the target's own first N layers, its final
norm and LM head as the draft, so no second checkpoint is needed (the embedded default has no
smaller sibling). A draft model of its own (`Engine(draft_model=...)`, `--speculative-model`,
`--speculative-quantize`): any model of the target's vocabulary, with its own KV cache on the
target's pages (the same page ids, block tables and slots, so admission, preemption and the
prefix cache count the draft's KV with the target's: each page costs both models' bytes).

Self-speculation: the draft's KV is the target's: layer i < N of the draft is layer i of the target, so the KV the
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

A draft model of its own must hold KV for every token the target computed, so its program runs
every step: first the step's own tokens (prefill chunks, decode tokens and the draft slots'
placeholders) through the draft, which gives each row's q_0, then passes 1..k over the drafts (pass j
writes draft j - 1 and draws draft j), and one last pass that only writes the last draft's KV,
so that when every draft is kept the draft's cache still covers them all. A prefix-cache hit or a
shared page therefore holds the draft's KV too: it was written in the step that wrote the
target's.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config_base import ConfigError
from jaxserve.config_engine import EngineConfig, SchedulerConfig
from jaxserve.engine.step_arrays import StepInputs
from jaxserve.model.paged_attention import PagedMeta
from jaxserve.model.rejection_sampler import sample_draft, sampling_probs

log = logging.getLogger("jaxserve.engine")


def check(num_layers: int, model_layers: int, two_groups: bool) -> None:
    """speculative_layers against the model, one line naming the field."""
    if not 1 <= num_layers < model_layers:
        raise ConfigError(f"speculative_layers: must be in [1, {model_layers - 1}] (the model has {model_layers} "
                          f"layers; the draft is its first N), got {num_layers}")
    if two_groups:
        raise ConfigError("speculative_layers: not supported for a model with sliding and full KV groups "
                          "(Gemma 2 / 3); use n-gram drafts (speculative_layers 0)")


def pool_with_draft(config: EngineConfig, sched: SchedulerConfig, target, draft) -> SchedulerConfig:
    """The scheduler's config for a target with a draft model of its own: checked (one line
    naming the field), its pool sized for both models' KV on every page."""
    import dataclasses

    import numpy as np

    from jaxserve.kv_sizing import CPU_KV_CACHE_BYTES
    if config.num_speculative_tokens == 0:
        raise ConfigError("speculative_model: drafts up to num_speculative_tokens tokens: set it > 0")
    if config.speculative_layers:
        raise ConfigError("speculative_layers: a draft model of its own and self-speculation exclude each other")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ConfigError(f"speculative_model: its vocabulary has {draft.cfg.vocab_size} tokens, the target's "
                          f"{target.cfg.vocab_size}: a draft must share the target's tokenizer")
    if len(draft.cfg.kv_groups()) != 1 or sched.sliding_window is not None:
        raise ConfigError("speculative_model: not supported with sliding and full KV groups (Gemma 2 / 3)")
    if config.tp != 1:
        raise ConfigError(f"speculative_model: a draft model of its own runs at tp 1 only for now, got tp={config.tp}")
    tb, db = _weight_bytes(target), _weight_bytes(draft)
    if db >= tb:  # each draft token then costs about a target step: speculation cannot pay
        log.warning("speculative_model: the draft's weights (%.1f MB) are not smaller than the target's (%.1f MB): "
                    "every draft token costs about a target step", db / 1e6, tb / 1e6)
    pages = config.num_pages
    if pages is None:
        per_page = (config.kv_bytes_per_page(target.cfg, np.dtype(target.dtype).itemsize)
                    + config.kv_bytes_per_page(draft.cfg, np.dtype(draft.dtype).itemsize))
        pages = max(2, (config.kv_cache_bytes or CPU_KV_CACHE_BYTES) // per_page)
    return dataclasses.replace(sched, num_pages=pages, model_drafts=True)


def _weight_bytes(model) -> int:
    return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(nnx.state(model)))


def row_drafts(inp: StepInputs, S: int) -> jax.Array:
    """[S] i32: each row's draft count (the largest position its logit slots reach)."""
    return jnp.zeros((S,), jnp.int32).at[jnp.where(inp.slot_row >= 0, inp.slot_row, S)].max(inp.slot_pos, mode="drop")


def make_draft_fn(graphdef, attend, num_layers: int | None, k: int, page_size: int, own_cache: bool = False):
    """(state, cache, inp: StepInputs) -> (cache, tokens [S, k] i32, q [S, k, V] f32). Rows past
    their own draft count (and rows that do not draft) run as padding: position -1, nothing
    written, their tokens and q don't-cares. own_cache: the draft model's own cache (module doc:
    the step's tokens first, and the last draft's KV at the end); else the target's first
    num_layers layers on the target's cache."""

    def draft(state, cache, inp: StepInputs):
        model = nnx.merge(graphdef, state)
        S = inp.block_tables.shape[0]
        first = inp.logit_index[:S]  # row i's last real token: the decode token its drafts follow
        pos0 = inp.positions[first]
        n = row_drafts(inp, S)
        V = model.cfg.vocab_size

        def pass_over(cache, j, tok):  # the rows' token j of their runs, through the draft
            # The attention kernels take the runner's layout (reference.seq_metadata): runs in
            # row order, padding after the last. Rows that draft no token j are padding, so the
            # live rows go first (a stable sort keeps their order) and come back after.
            live = j < n + own_cache
            order = jnp.argsort(~live, stable=True).astype(jnp.int32)
            pos = jnp.where(live[order], pos0[order] + j, -1)
            page = jnp.take_along_axis(inp.block_tables[order], jnp.maximum(pos, 0)[:, None] // page_size,
                                       axis=1)[:, 0]
            slots = jnp.where(pos >= 0, page * page_size + jnp.maximum(pos, 0) % page_size, -1)
            meta = PagedMeta(pos, slots, order, inp.block_tables)
            h, cache = model.hidden(tok[order][None], pos[None], cache, attend, meta, num_layers=num_layers)
            return h[:, jnp.argsort(order)], cache

        def drawn(h, j):
            q = sampling_probs(model.head(h)[0], inp.sampling)  # [S, V]
            return sample_draft(q, inp.sampling, j), q

        def one(j, carry):  # pass j: writes token j of the run (the decode token, then draft j - 1), draws draft j
            cache, tok, toks, qs = carry
            h, cache = pass_over(cache, j, tok)
            x, q = drawn(h, j)
            return cache, x, toks.at[:, j].set(x), qs.at[:, j].set(q)

        toks = jnp.zeros((S, k), jnp.int32)
        qs = jnp.zeros((S, k, V), jnp.float32)
        if not own_cache:
            cache, _, toks, qs = jax.lax.fori_loop(0, k, one, (cache, inp.tokens[first], toks, qs))
            return cache, toks, qs
        # The step's own tokens, so the draft's cache covers them. The draft slots' placeholder
        # tokens go through too (the kernels take whole runs): their KV is junk that passes
        # 1..k overwrite before anything reads it, and causality keeps it out of q_0.
        meta = PagedMeta(inp.positions, inp.slot_mapping, inp.token_seq, inp.block_tables)
        h, cache = model.hidden(inp.tokens[None], inp.positions[None], cache, attend, meta, first[None])
        x0, q0 = drawn(h, 0)
        toks, qs = toks.at[:, 0].set(x0), qs.at[:, 0].set(q0)

        def drafting(cache, toks, qs):  # pass 0 was the step's own tokens: passes 1..k - 1 draw
            cache, last, toks, qs = jax.lax.fori_loop(1, k, one, (cache, x0, toks, qs))
            _, cache = pass_over(cache, k, last)  # the last draft's KV, for when all are kept
            return cache, toks, qs
        cache, toks, qs = jax.lax.cond(jnp.any(n > 0), drafting, lambda c, t, q: (c, t, q), cache, toks, qs)
        return cache, toks, qs

    return draft


def slot_probs(q: jax.Array, inp: StepInputs) -> jax.Array:
    """The draft's q at each logit slot [R, V]: slot (row, pos) checks draft pos with q[row, pos];
    bonus and padding slots get q of some draft, never read (verify_slots reads q only where a
    draft stands)."""
    k = q.shape[1]
    return q[jnp.where(inp.slot_row >= 0, inp.slot_row, 0), jnp.minimum(inp.slot_pos, k - 1)]
