"""The native CPU attention kernel (attention_impl "cpu_native", a C++ XLA FFI custom call)
against the dense attention reference and the per-token XLA reference: ragged mixes of
prefill runs, decodes and speculative runs, page edges, sliding windows, soft caps, keys split
across threads, under jit; and its refusals, which must name what they refuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import ragged_case
from other_build import assert_bit_identical_to_installed_build, only_in_the_other_build_leg

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import cpu_native as native
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention
from sharding import backends, ops


def _native(q_block=3, **options):
    """The kernel for ragged_case, by default with 3-token blocks so runs of 4..11 tokens span
    several blocks; the cases' kv_chunk_pages is an XLA-path knob this kernel has no use for."""
    def call(*args, kv_chunk_pages=None, **kw):
        return native.ragged_paged_attention_cpu(*args, q_block=q_block, **options, **kw)
    return call


# Each mix once, both page sizes and both head groupings across them: the full cross product
# doubled this file's time and ran no code path these four do not.
@pytest.mark.parametrize("page_size,K,G,mix", [(4, 1, 3, "decode"), (16, 1, 3, "prefill"),
                                               (4, 2, 4, "speculative"), (16, 2, 4, "mixed")])
def test_matches_dense_reference(page_size, K, G, mix):
    rng = np.random.default_rng(page_size * 100 + K * 10 + G)
    ps = page_size
    decode = [(ps - 1, 1), (ps, 1), (ps + 1, 1), (1, 1), (3 * ps, 1)]  # lengths at page edges
    prefill = [(0, 1), (0, ps), (0, ps + 1), (ps, 2 * ps + 3)]  # incl. a chunk after a prefix
    speculative = [(ps - 1, 3), (2 * ps, 4), (5, 2), (0, 4), (ps + 2, 1), (3 * ps - 2, 8), (1, 1)]
    # "mixed" interleaves the kinds as a speculative step with a prefill chunk has them.
    seqs = {"decode": decode, "prefill": prefill, "speculative": speculative,
            "mixed": prefill[1:2] + decode[:3] + speculative[:2] + prefill[3:]}[mix]
    got, want = ragged_case(_native(), rng, seqs, ps, K, G, 16, num_pages=64, pages_per_seq=8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_sliding_window_and_head_dim_64():
    rng = np.random.default_rng(7)
    # Windows start mid-tile (tiles of 16 keys) and a 13-token run spans 5 blocks.
    got, want = ragged_case(_native(), rng, [(40, 1), (0, 13), (29, 6), (37, 5)], 4, 2, 2, 64,
                            num_pages=64, pages_per_seq=16, window=5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_long_rows_split_across_threads():
    # Rows longer than the kernel's 512-key parts (kSplitKeys) are split along their keys
    # (flash-decoding) and merged; with one thread the same parts run in turn. Both must equal
    # the reference.
    # An item covers every KV head of its run, so the merge walks K heads' rows per part:
    # SmolLM2's 3 KV heads x 3 query heads x 64 is the case with K > 1.
    rng = np.random.default_rng(11)
    seqs = [(1100, 1), (700, 4), (30, 1)]
    for K, G, H in ((1, 3, 16), (3, 3, 64)):
        for threads in (1, 2):
            got, want = ragged_case(_native(q_block=32, num_threads=threads), rng, seqs, 16, K, G, H,
                                    num_pages=128, pages_per_seq=80)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_a_rows_output_does_not_depend_on_its_batch_mates_or_thread_count():
    # The engine's greedy tokens and logprobs must not change with what else runs in the step
    # (the XLA path's do not): the split of a long row into parts, and so its rounding, may
    # depend only on the row itself. Row 0 (1,100 keys: three parts) gets the same data in
    # every call (ragged_case draws it first from the same seed); alone, beside many long rows,
    # and with one or two threads its output must be bit-identical. The old rule (parts from a
    # fair share of the step's total work) split it 4 ways alone and 1 way in a crowd.
    def row0(seqs, threads):
        got, _ = ragged_case(_native(q_block=32, num_threads=threads), np.random.default_rng(3), seqs,
                             16, 1, 3, 16, num_pages=1024, pages_per_seq=80)
        return got[:1]
    alone = row0([(1100, 1)], 2)
    crowd = [(1100, 1)] + [(900 + 37 * i, 1) for i in range(7)] + [(200, 24)]
    for seqs, threads in (([(1100, 1)], 1), (crowd, 2), (crowd, 1)):
        np.testing.assert_array_equal(row0(seqs, threads), alone)


@pytest.mark.parametrize("K,G,H,window,soft_cap", [(3, 3, 64, None, None), (2, 4, 16, 7, None),
                                               (1, 8, 32, None, 2.0)])
def test_wide_blocks_match_reference_over_uninitialised_memory(K, G, H, window, soft_cap):
    # Blocks of at least 16 query rows per KV head (prefill chunks, long speculative runs) take
    # the AVX-512 build's wide path: 16 rows in a vector's lanes, tiles transposed in
    # registers, a vertical softmax. Runs of 6..40 tokens give 18..120 rows per head (row
    # counts off the 16-lane grid, groups straddling a causal edge or a window's start), after
    # prefixes on and off page edges, beside decodes; every unwritten cache slot is NaN, which
    # must never reach an output.
    rng = np.random.default_rng(K * 100 + G * 10 + H)
    seqs = [(0, 40), (16, 33), (5, 1), (31, 20), (700, 6), (3, 17)]
    impl = _native(q_block=32)
    if soft_cap:  # ragged_case has no cap: compare against the per-token reference directly
        def impl(q, kc, vc, layer, positions, token_seq, block_tables, sliding_window=None, kv_chunk_pages=None):
            got = native.ragged_paged_attention_cpu(q, kc, vc, layer, positions, token_seq, block_tables,
                                                    soft_cap=soft_cap, q_block=32)
            want = ref_ragged_paged_attention(q, kc, vc, layer, positions, token_seq, block_tables,
                                              kv_chunk_pages=4, soft_cap=soft_cap)
            n = int((positions >= 0).sum())
            np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
            assert np.isfinite(np.asarray(got)).all()
            return got
        ragged_case(impl, rng, seqs, 16, K, G, H, num_pages=128, pages_per_seq=48, fill=0.0)
        return
    got, want = ragged_case(impl, rng, seqs, 16, K, G, H, num_pages=128, pages_per_seq=48, window=window,
                            fill=np.nan)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # Finite junk in the unwritten slots (large enough to overflow a score) must not show either.
    junk, want_junk = ragged_case(impl, np.random.default_rng(K * 100 + G * 10 + H), seqs, 16, K, G, H,
                                  num_pages=128, pages_per_seq=48, window=window, fill=3e38)
    np.testing.assert_allclose(junk, want_junk, rtol=2e-5, atol=2e-5)
    # A run's rows depend only on its own block: alone or beside batch mates, bit-identical.
    alone, _ = ragged_case(impl, np.random.default_rng(K * 100 + G * 10 + H), seqs[:1], 16, K, G, H,
                           num_pages=128, pages_per_seq=48, window=window, fill=np.nan)
    np.testing.assert_array_equal(got[:40], alone)


def cross_build_outputs() -> np.ndarray:
    """The kernel's outputs on a mix of every path: decodes (one of them long enough to be split
    into parts and merged), speculative runs, and prefill blocks of at least 16 query rows per KV
    head (the wide path, split and merged at 1,300 keys), for SmolLM2's heads and two other
    groupings: flat, for a bit-for-bit comparison between builds."""
    outs = []
    seqs = [(1300, 40), (1100, 1), (37, 1), (900, 20), (600, 33), (250, 4), (0, 48), (15, 1), (70, 7)]
    for K, G, H in ((3, 3, 64), (1, 8, 32), (2, 4, 16)):
        got, _ = ragged_case(_native(q_block=32), np.random.default_rng(5), seqs, 16, K, G, H, num_pages=512,
                             pages_per_seq=100)
        outs.append(np.asarray(got).ravel())
    return np.concatenate(outs)


@only_in_the_other_build_leg
def test_outputs_are_bit_identical_across_builds(tmp_path):
    # Attention must not depend on which x86 build a server runs: the row path is the same ymm
    # code in both builds, the AVX2 and AVX-512 wide paths do the same operations in the same
    # order, and setup.py's -ffp-contract=off keeps the compiler's tuning from fusing the scalar
    # merge differently (it did: ~7% of a prefill's outputs an ulp apart between the
    # generic-tuned AVX2 build and the znver3-tuned native one).
    assert_bit_identical_to_installed_build(cross_build_outputs, native, tmp_path)


def _random_step(rng, L=3, P=40, ps=4, K=2, G=2, H=8):
    kc = jnp.asarray(rng.normal(size=(L, P, ps, K, H)), jnp.float32)
    vc = jnp.asarray(rng.normal(size=(L, P, ps, K, H)), jnp.float32)
    positions = jnp.array([3, 4, 5, 9, 0, -1, -1], jnp.int32)  # a 3-token run, a decode, a prompt start
    token_seq = jnp.array([0, 0, 0, 1, 2, 0, 0], jnp.int32)
    block_tables = jnp.asarray(rng.permutation(np.arange(1, P))[:3 * 4].reshape(3, 4), jnp.int32)
    q = jnp.asarray(rng.normal(size=(7, K * G, H)), jnp.float32)
    return q, kc, vc, positions, token_seq, block_tables


def test_soft_cap_under_jit_matches_reference_and_padding_is_zero():
    rng = np.random.default_rng(5)
    q, kc, vc, positions, token_seq, block_tables = _random_step(rng)
    q = q * 4.0  # scores large enough for the cap to matter
    run = jax.jit(lambda layer: native.ragged_paged_attention_cpu(q, kc, vc, layer, positions, token_seq,
                                                                  block_tables, soft_cap=2.0))
    for layer in range(3):  # the layer is a traced argument: one executable reads every layer
        want = ref_ragged_paged_attention(q, kc, vc, layer, positions, token_seq, block_tables,
                                          kv_chunk_pages=2, soft_cap=2.0)
        got = run(jnp.int32(layer))
        np.testing.assert_allclose(got[:5], want[:5], rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(got[5:], 0.0)
    uncapped = native.ragged_paged_attention_cpu(q, kc, vc, 1, positions, token_seq, block_tables)
    assert not np.allclose(uncapped[:5], run(jnp.int32(1))[:5], atol=1e-3), "the cap changed nothing"


def test_refusals_name_the_field():
    rng = np.random.default_rng(1)
    q, kc, vc, positions, token_seq, block_tables = _random_step(rng)
    args = (positions, token_seq, block_tables)
    with pytest.raises(ValueError, match="float32 only; dtype is bfloat16"):
        native.ragged_paged_attention_cpu(q.astype(jnp.bfloat16), kc.astype(jnp.bfloat16),
                                          vc.astype(jnp.bfloat16), 0, *args)
    kq, vq = kv_cache.init_cache(3, 40, 4, 2, 8, "int8")
    with pytest.raises(ValueError, match="float32 caches, not int8"):
        native.ragged_paged_attention_cpu(q, kq, vq, 0, *args)
    with pytest.raises(ValueError, match="head_dim a multiple of 8, this model's is 12"):
        ops.check_impl("cpu_native", num_heads=4, num_kv_heads=2, head_dim=12, page_size=16,
                       q_dtype=jnp.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype is int8"):
        ops.check_impl("cpu_native", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       q_dtype=jnp.float32, kv_dtype="int8")


def test_built_at_install_and_matching_its_source():
    """`make setup` built the library (setup.py) from the source beside it: present, loading,
    the same hash. The suite runs on a checkout set up that way (README)."""
    assert native.library_path() is not None, "run `make setup` (pip install -e .) to build the kernel"
    assert native.unavailable_reason() is None, native.unavailable_reason()


def test_missing_or_stale_library_is_refused_and_auto_says_why(tmp_path, monkeypatch, caplog):
    """No library, or one built from another source: never loaded; "cpu_native" is a start-up
    error naming how to rebuild; "auto" takes "xla" and logs why."""
    import logging
    installed = native.library_path()
    # A source elsewhere, with no library beside it.
    monkeypatch.setattr(native, "_SOURCE", tmp_path / "ragged_paged_attention_cpu.cc")
    native._SOURCE.write_text("// an edited kernel source\n")
    native._load.cache_clear()
    try:
        assert "not built at install time" in native.unavailable_reason()
        # The real library beside it: built from the real source, so stale for this one.
        (tmp_path / installed.name).symlink_to(installed)
        native._load.cache_clear()
        assert "was built from another ragged_paged_attention_cpu.cc" in native.unavailable_reason()
        with pytest.raises(native.NativeBuildError, match="built from another.*make setup.*attention_impl='xla'"):
            native.ensure_registered.__wrapped__()
        backends.say_once_clear()
        with caplog.at_level(logging.WARNING, logger="jaxserve.attention"):
            assert ops.check_impl("auto", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                  q_dtype=jnp.float32) == "xla"
        assert "attention_impl 'auto' on cpu: 'xla'; not 'cpu_native'" in caplog.text
        assert "built from another" in caplog.text
    finally:
        native._load.cache_clear()
        backends.say_once_clear()


def test_auto_picks_the_native_kernel_where_the_model_takes_it(monkeypatch):
    assert ops.check_impl("auto", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          q_dtype=jnp.float32) == ("cpu_native" if ops.AUTO_PREFERS_NATIVE else "xla")
    monkeypatch.setattr(ops, "AUTO_PREFERS_NATIVE", True)
    assert ops.check_impl("auto", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          q_dtype=jnp.float32) == "cpu_native"
    # bf16 and int8 KV are not the kernel's: "auto" takes "xla" for them.
    assert ops.check_impl("auto", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          q_dtype=jnp.bfloat16) == "xla"
    assert ops.check_impl("auto", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          q_dtype=jnp.float32, kv_dtype="int8") == "xla"


def test_engine_through_native_kernel_equals_dense_greedy(smollm2):
    """The whole engine on the native kernel: chunked prefills next to speculative decodes,
    a pool small enough to preempt, every greedy output the dense model's. SmolLM2 cut to 4
    layers (the kernel runs the same code for every layer)."""
    from conftest import assert_dense_greedy, first_layers, make_engine, staggered_with_drafts

    from jaxserve.types import SamplingParams
    lm = smollm2
    model = first_layers(lm.model, 4)
    rng = np.random.default_rng(0)
    prompts = [lm.tokenizer.encode(t) for t in ("Once upon a time, there was a little", "def fibonacci(n):")]
    prompts += [rng.integers(3, 49152, size=int(n)).tolist() for n in (5, 40, 23)]
    eng = make_engine(model, lm.tokenizer, lm.eos_token_ids, attention_impl="cpu_native", max_model_len=256,
                      page_size=4, num_pages=31, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(32,),
                      num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs, _ = staggered_with_drafts(eng, prompts, params)
    got = [o.token_ids for o in outs]
    assert_dense_greedy(model, prompts, got, params.max_tokens)
    assert len({tuple(g) for g in got}) == len(prompts), "the cut model should answer each prompt differently"
