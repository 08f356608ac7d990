"""The XLA ragged paged attention: the per-token reference and the blocked CPU path, on tiny
cases by hand, then both against the dense attention reference over ragged mixes of prefill
chunks and decodes (q_block small enough that runs span several blocks); cache writes exact."""

import functools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import ragged_case
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_attention.blocked import blocked_ragged_paged_attention

# Both XLA implementations; the blocked one with 3-query blocks so that prefill runs of
# 4..11 tokens span several blocks, one of them partial.
IMPLS = {"reference": ref_ragged_paged_attention,
         "blocked": functools.partial(blocked_ragged_paged_attention, q_block=3)}
# As a speculative decoding step runs it: runs of up to 4 tokens take the decode path.
BLOCKED_4Q = functools.partial(blocked_ragged_paged_attention, q_block=3, decode_queries=4)


@pytest.mark.parametrize("impl", IMPLS)
def test_by_hand_two_keys_one_page(impl):
    # One layer, 2 pages of 2 slots; the sequence owns page 1. Keys [0, ln 3], values [4, 8]:
    # at position 1 softmax([0, ln 3]) = [1/4, 3/4] -> 1 + 6 = 7; at position 0 -> 4.
    k = jnp.zeros((1, 2, 2, 1, 1)).at[0, 1, :, 0, 0].set(jnp.array([0.0, math.log(3.0)]))
    v = jnp.zeros((1, 2, 2, 1, 1)).at[0, 1, :, 0, 0].set(jnp.array([4.0, 8.0]))
    q = jnp.ones((2, 1, 1))
    # One sequence with both tokens (positions 0 and 1, in run order).
    out = IMPLS[impl](q, k, v, 0, jnp.array([0, 1]), jnp.array([0, 0]), jnp.array([[1]]),
                      kv_chunk_pages=1)
    np.testing.assert_allclose(out[:, 0, 0], [4.0, 7.0], rtol=1e-6)


def test_write_kv_exact_and_padding_dropped():
    kc = jnp.zeros((2, 3, 4, 1, 2))
    vc = jnp.zeros((2, 3, 4, 1, 2))
    k = jnp.arange(6, dtype=jnp.float32).reshape(3, 1, 2) + 1
    # slots: page 2 offset 1 (=9), page 0 offset 3 (=3), padding (-1)
    kc2, vc2 = write_kv(kc, vc, 1, k, -k, jnp.array([9, 3, -1]))
    want = np.zeros((2, 3, 4, 1, 2), np.float32)
    want[1, 2, 1, 0] = [1, 2]
    want[1, 0, 3, 0] = [3, 4]
    np.testing.assert_array_equal(kc2, want)
    np.testing.assert_array_equal(vc2, -want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("K,G", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("mix", ["decode", "prefill", "mixed"])
def test_matches_dense_reference(page_size, K, G, mix, impl):
    rng = np.random.default_rng(page_size * 100 + K * 10 + G)
    ps = page_size
    decode = [(ps - 1, 1), (ps, 1), (ps + 1, 1), (1, 1), (3 * ps, 1)]  # lengths at page edges
    prefill = [(0, 1), (0, ps), (0, ps + 1), (ps, 2 * ps + 3)]  # incl. a chunk after a prefix
    # "mixed" interleaves the two kinds: runs need not come decodes-first.
    seqs = {"decode": decode, "prefill": prefill, "mixed": prefill[1:2] + decode[:3] + prefill[2:]}[mix]
    got, want = ragged_case(IMPLS[impl], rng, seqs, ps, K, G, 8, num_pages=64, pages_per_seq=8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("page_size,K,G,window", [(4, 1, 2, None), (16, 2, 4, 6)])
def test_short_runs_on_the_decode_path(page_size, K, G, window, monkeypatch):
    # Verification runs of 2..4 tokens (a decode token plus drafts) ending on both sides of
    # page and item edges, next to plain decodes and a 4-token prefill. The query-block path
    # is replaced by NaNs, so a run that does not take the decode path fails the comparison.
    # 4 x G = 8 query heads per KV head multiply-and-sum; 16 run as matmuls.
    import pallas_kernels.ragged_paged_attention.blocked as blocked
    monkeypatch.setattr(blocked, "_query_block", lambda qblk, *a, **k: jnp.full_like(qblk, jnp.nan))
    rng = np.random.default_rng(page_size + K + G)
    ps = page_size
    seqs = [(ps - 1, 3), (2 * ps, 4), (5, 2), (0, 4), (ps + 2, 1), (3 * ps - 2, 4), (1, 1)]
    got, want = ragged_case(BLOCKED_4Q, rng, seqs, ps, K, G, 8, num_pages=64, pages_per_seq=8, window=window)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_sliding_window(impl):
    rng = np.random.default_rng(7)
    # Windows start mid-chunk (chunks of 2 pages x 4 slots) and a 13-token run spans 5 blocks.
    got, want = ragged_case(IMPLS[impl], rng, [(20, 1), (0, 13), (9, 6), (17, 5)], 4, 2, 2, 8, num_pages=32,
                            pages_per_seq=8, window=5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_within_bf16_tolerance(impl):
    rng = np.random.default_rng(8)
    got, want = ragged_case(IMPLS[impl], rng, [(5, 1), (0, 9), (17, 4)], 4, 2, 3, 16, num_pages=32,
                            pages_per_seq=8, dtype=jnp.bfloat16)
    # Both sides read bf16 inputs; they differ in accumulation order and the final bf16
    # rounding (8 mantissa bits: ~4e-3 relative) of outputs of magnitude ~1.
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_validation_names_shapes():
    with pytest.raises(ValueError, match=r"\[T, N, H\].*\(2, 3\)"):
        ref_ragged_paged_attention(jnp.zeros((2, 3)), jnp.zeros((1, 2, 2, 1, 3)), jnp.zeros((1, 2, 2, 1, 3)),
                                   0, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="multiple of kv_chunk_pages"):
        ref_ragged_paged_attention(jnp.zeros((2, 2, 4)), jnp.zeros((1, 2, 2, 1, 4)), jnp.zeros((1, 2, 2, 1, 4)),
                                   0, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((1, 3), jnp.int32),
                                   kv_chunk_pages=2)
