"""A scheduler StepPlan -> the fixed-shape host arrays of one compiled step (`StepInputs`),
padded to a token bucket; the runner (runner.py) hands them to the executable. The layout is
runner.py's module doc. Per-bucket arrays that no row uses (an all-ones token mask, an empty
logit bias, empty penalty histories) are built once and shared.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.sampler import BiasArrays, PenaltyArrays, SamplingArrays, seed_words
from jaxserve.scheduler.plan import StepPlan
from jaxserve.types import MAX_LOGIT_BIAS, InvalidRequestError, SamplingParams


class StepInputs(NamedTuple):
    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, -1 = padding
    slot_mapping: jax.Array  # [T] int32, -1 = padding
    token_seq: jax.Array  # [T] int32
    block_tables: jax.Array  # [S, pages_per_seq] int32
    logit_index: jax.Array  # [R] int32
    # Speculation: each logit slot's plan row (-1 = padding) and its position in the row's run (0 =
    # after the row's last real token, i = after its i-th draft); rejection_sampler.verify_slots.
    slot_row: jax.Array  # [R] int32
    slot_pos: jax.Array  # [R] int32
    sampling: SamplingArrays  # [S] each
    penalties: PenaltyArrays  # [S] / [S, max_model_len]
    want_logprobs: jax.Array  # bool scalar: compute top-k logprobs this step
    has_drafts: jax.Array  # bool scalar: some row carries draft tokens (slots S.. are used)
    allowed: jax.Array  # [S, ceil(V/32)] int32 token bitmask (structured outputs; all ones = free)
    has_mask: jax.Array  # bool scalar: some row is constrained (else the mask is skipped)
    draft_allowed: jax.Array  # [R - S, ceil(V/32)] int32: the draft slots' bitmasks (all ones = free)
    bias: BiasArrays  # [S, MAX_LOGIT_BIAS] each: logit_bias pairs
    has_bias: jax.Array  # bool scalar: some row has a logit_bias (else it is skipped)
    prompt_targets: jax.Array  # [T] int32: the next prompt token where prompt logprobs are wanted, else -1
    want_prompt_lp: jax.Array  # bool scalar: some prompt_targets entry is set
    # A two-group model's sliding layers (model/paged_attention.GroupedKV); None otherwise, so a
    # one-group model's step takes exactly the arrays it always did.
    sliding_slot_mapping: jax.Array | None = None  # [T] int32, -1 = padding
    sliding_block_tables: jax.Array | None = None  # [S, pages_per_seq] int32


@dataclasses.dataclass(frozen=True)
class RowInfo:
    """Host facts about one scheduled sequence that the arrays need."""

    params: SamplingParams
    seed: int
    step: int  # tokens sampled so far (keys the per-row random stream)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    allowed: np.ndarray | None = None  # [ceil(V/32)] int32 bitmask of a constrained row
    # ... and of each of its draft slots (the grammar's state after each draft), in order
    draft_allowed: tuple[np.ndarray, ...] | None = None


class StepArrays:
    """Builds a step's arrays for a runner's buckets (module doc)."""

    def __init__(self, buckets: Sequence[int], max_num_seqs: int, page_size: int, pages_per_seq: int,
                 spec_k: int, max_model_len: int, vocab_size: int, sliding: bool = False):
        """sliding: the model's sliding layers are a KV group of their own (their slots and
        block tables are built too, from each row's sliding_table)."""
        self.buckets = tuple(buckets)
        self.sliding = sliding
        self.max_num_seqs = max_num_seqs
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.spec_k = spec_k
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32  # structured outputs' bitmask width
        self._no_penalty_cache: dict[int, np.ndarray] = {}
        self._free_mask_cache: dict[int, np.ndarray] = {}
        self._free_draft_mask_cache: dict[int, np.ndarray] = {}
        self._no_bias_cache: dict[int, BiasArrays] = {}

    def seqs_for(self, T: int) -> int:
        return min(T, self.max_num_seqs)

    def logit_slots_for(self, T: int) -> int:
        """S row slots, then room for the most drafts a step of T tokens can carry (every
        token but one row's, and at most k per row)."""
        S = self.seqs_for(T)
        return S + min(T - 1, S * self.spec_k)

    def abstract_inputs(self, T: int) -> StepInputs:
        """Bucket T's StepInputs as shapes: what the step program is traced and lowered with."""
        S, M, R = self.seqs_for(T), self.max_model_len, self.logit_slots_for(T)

        def a(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype)

        i32, f32 = jnp.int32, jnp.float32
        return StepInputs(
            a((T,), i32), a((T,), i32), a((T,), i32), a((T,), i32), a((S, self.pages_per_seq), i32),
            a((R,), i32), a((R,), i32), a((R,), i32),
            SamplingArrays(a((S,), f32), a((S,), i32), a((S,), f32), a((S,), f32), a((S, 2), jnp.uint32),
                           a((S,), i32)),
            PenaltyArrays(a((S,), f32), a((S,), f32), a((S,), f32), a((S, M), i32), a((S, M), i32)),
            a((), jnp.bool_), a((), jnp.bool_), a((S, self.mask_words), i32), a((), jnp.bool_),
            a((R - S, self.mask_words), i32),
            BiasArrays(a((S, MAX_LOGIT_BIAS), i32), a((S, MAX_LOGIT_BIAS), f32)), a((), jnp.bool_),
            a((T,), i32), a((), jnp.bool_),
            *((a((T,), i32), a((S, self.pages_per_seq), i32)) if self.sliding else ()))

    def bucket_for(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, num_tokens)
        if i == len(self.buckets):
            raise ValueError(f"a step of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")
        return self.buckets[i]

    def build_inputs(self, plan: StepPlan, rows: Sequence[RowInfo]
                     ) -> tuple[int, StepInputs, tuple[tuple[int, ...], ...]]:
        """The step's arrays, padded to its bucket T, and each row's logit slots in order."""
        n = plan.num_tokens
        T = self.bucket_for(n)
        S, R = self.seqs_for(T), self.logit_slots_for(T)
        if len(plan.seqs) > S:
            raise ValueError(f"a step of {len(plan.seqs)} sequences exceeds the {S} rows of bucket {T}")
        drafts = sum(s.draft_len for s in plan.seqs)
        if S + drafts > R or any(s.draft_len > self.spec_k for s in plan.seqs):
            raise ValueError(f"a step with {drafts} draft tokens (up to {max(s.draft_len for s in plan.seqs)} "
                             f"a row) exceeds bucket {T}'s {R - S} draft slots for "
                             f"num_speculative_tokens={self.spec_k}")
        ps = self.page_size
        tokens = np.zeros(T, np.int32)
        positions = np.full(T, -1, np.int32)
        slot_map = np.full(T, -1, np.int32)
        token_seq = np.zeros(T, np.int32)
        tables = np.zeros((S, self.pages_per_seq), np.int32)
        if self.sliding:
            s_slots = np.full(T, -1, np.int32)
            s_tables = np.zeros((S, self.pages_per_seq), np.int32)
        logit_index = np.zeros(R, np.int32)
        slot_row = np.full(R, -1, np.int32)
        slot_pos = np.zeros(R, np.int32)
        prompt_targets = np.full(T, -1, np.int32)
        row_slots = []
        off, extra = 0, S
        for i, s in enumerate(plan.seqs):
            k = len(s.token_ids)
            pos = np.arange(s.start_pos, s.start_pos + k, dtype=np.int32)
            bt = np.asarray(s.block_table, np.int32)
            tokens[off:off + k] = s.token_ids
            positions[off:off + k] = pos
            slot_map[off:off + k] = bt[pos // ps] * ps + pos % ps
            token_seq[off:off + k] = i
            tables[i, :len(bt)] = bt
            if self.sliding:  # the same positions through the sliding group's own pages
                sbt = np.asarray(s.sliding_table, np.int32)
                s_slots[off:off + k] = sbt[pos // ps] * ps + pos % ps
                s_tables[i, :len(sbt)] = sbt
            d = s.draft_len
            logit_index[i] = off + k - 1 - d
            logit_index[extra:extra + d] = np.arange(off + k - d, off + k)
            slot_row[i] = i
            slot_row[extra:extra + d] = i
            slot_pos[extra:extra + d] = np.arange(1, d + 1)
            row_slots.append((i, *range(extra, extra + d)))
            if rows[i].params.prompt_logprobs is not None:
                prompt = rows[i].prompt_ids  # the next token, where it is a prompt token
                for j, p in enumerate(range(s.start_pos, min(s.start_pos + k, len(prompt) - 1))):
                    prompt_targets[off + j] = prompt[p + 1]
            extra += d
            off += k
        return T, StepInputs(tokens, positions, slot_map, token_seq, tables, logit_index, slot_row, slot_pos,
                             self._sampling(rows, S), self._penalties(rows, S),
                             np.bool_(any(r.params.logprobs is not None for r in rows)),
                             np.bool_(extra > S), *self._masks(rows, S), self._draft_masks(rows, row_slots, S, R),
                             *self._bias(rows, S),
                             prompt_targets, np.bool_((prompt_targets >= 0).any()),
                             *((s_slots, s_tables) if self.sliding else ())), tuple(row_slots)

    def _masks(self, rows: Sequence[RowInfo], S: int) -> tuple[np.ndarray, np.bool_]:
        used = [i for i, r in enumerate(rows) if r.allowed is not None]
        if not used:  # the common case: one shared all-ones mask per bucket, never read
            return self._free_mask_cache.setdefault(S, np.full((S, self.mask_words), -1, np.int32)), np.bool_(False)
        m = np.full((S, self.mask_words), -1, np.int32)
        for i in used:
            m[i] = rows[i].allowed
        return m, np.bool_(True)

    def _draft_masks(self, rows: Sequence[RowInfo], row_slots, S: int, R: int) -> np.ndarray:
        used = [i for i, r in enumerate(rows) if r.draft_allowed]
        if not used:  # the common case: one shared all-ones mask per bucket, never read
            return self._free_draft_mask_cache.setdefault(R, np.full((R - S, self.mask_words), -1, np.int32))
        m = np.full((R - S, self.mask_words), -1, np.int32)
        for i in used:
            for slot, words in zip(row_slots[i][1:], rows[i].draft_allowed):
                m[slot - S] = words
        return m

    def _bias(self, rows: Sequence[RowInfo], S: int) -> tuple[BiasArrays, np.bool_]:
        V = self.vocab_size
        used = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if not used:  # the common case: one shared empty bias per bucket, never read
            none = self._no_bias_cache.get(S)
            if none is None:
                none = self._no_bias_cache[S] = BiasArrays(np.full((S, MAX_LOGIT_BIAS), V, np.int32),
                                                           np.zeros((S, MAX_LOGIT_BIAS), np.float32))
            return none, np.bool_(False)
        ids = np.full((S, MAX_LOGIT_BIAS), V, np.int32)
        values = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
        for i in used:
            pairs = rows[i].params.logit_bias
            ids[i, :len(pairs)] = [t for t, _ in pairs]
            values[i, :len(pairs)] = [b for _, b in pairs]
        return BiasArrays(ids, values), np.bool_(True)

    def _sampling(self, rows: Sequence[RowInfo], S: int) -> SamplingArrays:
        return sampling_arrays(rows, S)

    def check_row(self, seq, row: RowInfo) -> None:
        """Build one scheduled sequence's share of the step arrays alone; raises where a value does
        not fit its array (engine/faults.py blames the request for it)."""
        V = self.vocab_size
        bad = next((t for t in seq.token_ids if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside [0, {V})")
        sampling_arrays([row], 1)
        self._penalties([row], 1)
        self._bias([row], 1)

    def _penalties(self, rows: Sequence[RowInfo], S: int) -> PenaltyArrays:
        rep = np.ones(S, np.float32)
        pres = np.zeros(S, np.float32)
        freq = np.zeros(S, np.float32)
        M = self.max_model_len
        used = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not used:
            # The common case: one shared all-empty history per bucket, built once.
            empty = self._no_penalty_cache.setdefault(S, np.full((S, M), -1, np.int32))
            return PenaltyArrays(rep, pres, freq, empty, empty)
        prompt = np.full((S, M), -1, np.int32)
        output = np.full((S, M), -1, np.int32)
        for i in used:
            r = rows[i]
            rep[i], pres[i], freq[i] = (r.params.repetition_penalty, r.params.presence_penalty,
                                        r.params.frequency_penalty)
            prompt[i, :len(r.prompt_ids)] = r.prompt_ids
            output[i, :len(r.output_ids)] = r.output_ids
        return PenaltyArrays(rep, pres, freq, prompt, output)


def sampling_arrays(rows: Sequence[RowInfo], S: int) -> SamplingArrays:
    """The rows' sampling settings as the step's [S] arrays (padding rows greedy). A value that
    does not fit its field's dtype raises InvalidRequestError naming the field: SamplingParams
    bounds every field, so this only fires for a gap in that validation, and then blames the
    one request (engine/faults.py) instead of failing the whole step anonymously."""
    temp = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    seed = np.zeros((S, 2), np.uint32)
    step = np.zeros(S, np.int32)
    for i, r in enumerate(rows):
        p = r.params
        for arr, name, value in ((temp, "temperature", p.temperature), (top_k, "top_k", p.top_k),
                                 (top_p, "top_p", p.top_p), (min_p, "min_p", p.min_p),
                                 (seed, "seed", seed_words(r.seed)), (step, "max_tokens", r.step)):
            try:
                arr[i] = value
            except (OverflowError, ValueError, TypeError):
                raise InvalidRequestError(name, f"{value!r:.40} does not fit the step's {arr.dtype} "
                                                f"array") from None
    return SamplingArrays(temp, top_k, top_p, min_p, seed, step)


