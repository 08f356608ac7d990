"""The program of one engine step, as a pure function of (weights, KV cache, StepInputs[, the
draft's q]): the model over the step's flat ragged batch, the LM head on its logit slots, the
logits shaped (logit_bias, penalties, the structured-output mask, each only in steps that use
it), sampled, drafts verified by the rejection rule, and prompt logprobs where a row asks. The
runner (runner.py) jits, shards and compiles it per bucket; the input layout is runner.py's
module doc.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.engine import self_draft
from jaxserve.engine.step_arrays import StepInputs
from jaxserve.model.llama import KVCache
from jaxserve.model.paged_attention import PagedMeta
from jaxserve.model.rejection_sampler import verify_slots
from jaxserve.model.sampler import apply_logit_bias, apply_penalties, apply_token_bitmask, logprobs_of, sample
from jaxserve.types import MAX_LOGPROBS

PROMPT_LP_ROWS = 128  # positions projected onto the vocabulary at a time for prompt_logprobs


def make_step_fn(graphdef, attend):
    """The step of the model `graphdef` describes, with attention `attend`
    (model/paged_attention.make_paged_attend, sharded or not): returns (cache, outputs), the
    outputs as runner.StepResult lists them."""

    def step(state, cache: KVCache, inp: StepInputs, draft_q=None):
        model = nnx.merge(graphdef, state)
        meta = PagedMeta(inp.positions, inp.slot_mapping, inp.token_seq, inp.block_tables,
                         inp.sliding_slot_mapping, inp.sliding_block_tables)
        # Rows R.. of h are every token of the step (their final norm is T x D, next to nothing
        # beside the layers); only steps with a prompt_logprobs row project them (below).
        T = inp.tokens.shape[0]
        # build_inputs puts the plan's tokens first and its rows first, padding after them: the
        # native matmul computes only these (the buckets' padding is 10-25% of a decode step's rows).
        live = inp.positions >= 0
        live_tokens = jnp.sum(live, dtype=jnp.int32)
        live_rows = jnp.max(jnp.where(live, inp.token_seq + 1, 0))
        h, cache = model.hidden(inp.tokens[None], inp.positions[None], cache, attend, meta,
                                jnp.concatenate([inp.logit_index, jnp.arange(T, dtype=jnp.int32)])[None],
                                live_tokens=live_tokens)
        S, R = inp.block_tables.shape[0], inp.logit_index.shape[0]
        h, h_all = h[:, :R], h[:, R:]
        logits = model.head(h[:, :S], live_rows=live_rows)[0]  # [S, V] fp32: one slot per row
        p = inp.penalties
        active = jnp.any((p.repetition != 1.0) | (p.presence != 0.0) | (p.frequency != 0.0))

        def shape(lg):  # logit_bias, penalties, then the structured-output mask, each only when used
            lg = jax.lax.cond(inp.has_bias, apply_logit_bias, lambda x, _: x, lg, inp.bias)
            lg = jax.lax.cond(active, apply_penalties, lambda x, _: x, lg, p)
            return jax.lax.cond(inp.has_mask, apply_token_bitmask, lambda x, _: x, lg, inp.allowed)
        # One outer cond, so a step with none of them (the common case) pays for one as before,
        # not for a pass over the [S, V] logits each.
        shaped = jax.lax.cond(active | inp.has_mask | inp.has_bias, shape, lambda lg: lg, logits)
        tokens = sample(shaped, inp.sampling)
        no_drafts = jnp.zeros((S,), jnp.int32)  # accepted drafts per row
        if R > S:
            # Draft slots. Projecting them onto the vocabulary costs as much as R - S rows more,
            # so steps without drafts (every step that prefills, in practice) skip it.
            def drafted():
                lg = model.head(h[:, S:])[0]
                # Structured outputs: each draft slot masked with the grammar's state before it.
                lg = jax.lax.cond(inp.has_mask, apply_token_bitmask, lambda x, _: x, lg, inp.draft_allowed)
                # Rows that draft have no bias or penalties (speculation.speculates), so their
                # slots' logits (masked above) are the shaped ones. verify_slots keeps drafts by the
                # rejection rule (the argmax for greedy rows) and draws the correction or bonus.
                nxt = inp.tokens[jnp.minimum(inp.logit_index + 1, T - 1)]
                q = None if draft_q is None else self_draft.slot_probs(draft_q, inp)  # None: n-gram
                verified, accepted = verify_slots(jnp.concatenate([shaped, lg]), inp.slot_row, inp.slot_pos,
                                                  nxt, inp.sampling, draft_probs=q)
                # A row without drafts keeps `sample`'s token: its random stream is the one it
                # would have with speculation off.
                first = jnp.where(self_draft.row_drafts(inp, S) > 0, verified[:S], tokens)
                lps = [jnp.concatenate([a, b]) for a, b in zip(_logprobs(logits, first, inp.want_logprobs),
                                                               _logprobs(lg, verified[S:], inp.want_logprobs))]
                return (jnp.concatenate([first, verified[S:]]), *lps, accepted)

            def plain():
                lps = [jnp.concatenate([a, b]) for a, b in zip(_logprobs(logits, tokens, inp.want_logprobs),
                                                               _no_logprobs(R - S))]
                return (jnp.concatenate([tokens, jnp.zeros((R - S,), jnp.int32)]), *lps, no_drafts)
            *out, accepted = jax.lax.cond(inp.has_drafts, drafted, plain)
        else:
            out, accepted = (tokens, *_logprobs(logits, tokens, inp.want_logprobs)), no_drafts

        def prompt_lps():  # the raw model's log-softmax at every position: [T], [T, K], [T, K]
            # In blocks of PROMPT_LP_ROWS positions: the branch's [rows, V] logits are memory
            # XLA reserves for every step (a whole [T, V] would be 1 GiB at T = 2048, V = 128k).
            c = min(T, PROMPT_LP_ROWS)
            nb = -(-T // c)
            hs = jnp.pad(h_all[0], ((0, nb * c - T), (0, 0))).reshape(nb, c, -1)
            tg = jnp.pad(jnp.maximum(inp.prompt_targets, 0), (0, nb * c - T)).reshape(nb, c)
            res = jax.lax.map(lambda a: logprobs_of(model.head(a[0][None])[0], a[1], MAX_LOGPROBS), (hs, tg))
            return tuple(x.reshape(nb * c, *x.shape[2:])[:T] for x in res)
        out = (*out, *jax.lax.cond(inp.want_prompt_lp, prompt_lps, lambda: _no_logprobs(T)), accepted)
        return cache, out

    return step


def _logprobs(logits, tokens, want):
    return jax.lax.cond(want, lambda: logprobs_of(logits, tokens, MAX_LOGPROBS),
                        lambda: _no_logprobs(logits.shape[0]))


def _no_logprobs(n: int):
    return (jnp.zeros((n,), jnp.float32), jnp.zeros((n, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((n, MAX_LOGPROBS), jnp.float32))
