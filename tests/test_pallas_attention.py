"""The Pallas ragged paged attention kernels against the XLA reference.

Level 1 (the reference against cases computed by hand) is tests/test_paged_attention.py. Here:
each kernel runs in its interpret mode on CPU over a sweep of page sizes, head dims 64 / 128 (and
256 on TPU), GQA ratios 1 / 3 / 4 / 8, fp32 / bf16 / int8 caches, and three ragged mixes per compiled shape
(decode only, prefill only, mixed) whose context lengths sit at 0, 1, a page boundary and one
past it. Interpret mode is slow, so each configuration compiles once and runs all three mixes.
Every interpret-mode test runs under both fills of uninitialised memory, NaN and zeros
(conftest `mem_fill`): a device's memory is stale and finite, never NaN.
Both kernels also lower for their real targets here (CUDA / TPU Mosaic, without a device),
over a wider sweep, which catches what the interpreters do not model (layouts, TMA rules).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import cpu_native as rpa_cpu
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from sharding import ops

L, LAYER = 2, 1  # two layers in the caches; attend over the second (the layer index is live)
# On a GPU / TPU machine, JAXSERVE_NATIVE_KERNELS=1 runs that backend's kernel compiled for the
# device instead of interpreted (scripts/check_gpu_kernels.sh does this on an H200).
NATIVE = os.environ.get("JAXSERVE_NATIVE_KERNELS") == "1"


def _interpret(kernel, fill):
    """The kernel's `interpret` value: the fill of uninitialised memory, or False on its device."""
    own = {ragged_paged_attention_gpu: "gpu", ragged_paged_attention_tpu: "tpu"}[kernel]
    return False if NATIVE and jax.default_backend() == own else fill

T, S, PAGES_PER_SEQ = 32, 8, 8  # one token bucket, table rows, table width for every case


def mixes(ps):
    """(context before the step, new tokens) per sequence. Key counts after the step land on
    1, a page boundary, one past it, and the middle of later pages (4 pages + 8 keys: several
    KV blocks, so split-K and the double-buffered walk have work); (c, 0) is a row of the
    table with no tokens this step (its KV length is 0 in the step's metadata)."""
    return {
        "decode": [(0, 1), (ps - 1, 1), (ps, 1), (2 * ps + 3, 1), (5, 0), (4 * ps + 7, 1)],
        # chunks: a whole short prompt, one that spans query blocks / tiles, and chunks after
        # a prefix that end on a page boundary, one past it, and across a page
        "prefill": [(0, 1), (0, 12), (ps - 3, 3), (ps - 1, 2), (2 * ps - 2, 5), (7, 0)],
        "mixed": [(ps - 1, 1), (ps - 4, 5), (ps, 2), (3, 0), (4 * ps + 7, 5), (0, 1), (0, 9)],
    }


def build_case(rng, seqs, ps, K, G, H):
    """Random caches and queries for `seqs`, laid out as the runner does: each sequence's
    tokens contiguous, in row order, padding (position -1) last; pages shuffled."""
    num_pages = S * PAGES_PER_SEQ + 1
    k = rng.normal(size=(L, num_pages, ps, K, H)).astype(np.float32)
    v = rng.normal(size=(L, num_pages, ps, K, H)).astype(np.float32)
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 stays the null page
    tables = np.zeros((S, PAGES_PER_SEQ), np.int32)
    positions, token_seq, used = [], [], 0
    for s, (ctx, new) in enumerate(seqs):
        n = -(-(ctx + new) // ps)
        tables[s, :n] = perm[used:used + n]
        used += n
        positions += range(ctx, ctx + new)
        token_seq += [s] * new
    pad = T - len(positions)
    positions = np.array(positions + [-1] * pad, np.int32)
    token_seq = np.array(token_seq + [0] * pad, np.int32)
    q = rng.normal(size=(T, K * G, H)).astype(np.float32)
    return q, k, v, positions, token_seq, tables


def make_caches(k, v, kind, lane_dense=False):
    """kind: "float32" / "bfloat16" plain caches, or "int8" (QuantizedKV, quantized as written;
    scales paged, or lane-dense as the runner stores them for the TPU kernel)."""
    if kind != "int8":
        return jnp.asarray(k, kind), jnp.asarray(v, kind)
    kq, ks = kv_cache.quantize(jnp.asarray(k))  # [L, P, page, K, H], scales [L, P, page, K]
    vq, vs = kv_cache.quantize(jnp.asarray(v))
    ks, vs = jnp.swapaxes(ks, -1, -2), jnp.swapaxes(vs, -1, -2)
    if lane_dense:
        ks, vs = kv_cache.to_lane_dense(ks), kv_cache.to_lane_dense(vs)
    return kv_cache.QuantizedKV(kq, ks), kv_cache.QuantizedKV(vq, vs)


# Tolerances, absolute, for outputs of magnitude ~1 (softmax-weighted sums of N(0, 1) values):
#  fp32 exact-math kernel (TPU): the two differ only in summation order and block boundaries.
#  bf16 anything: probabilities and values round to bf16 (8 bits: 2^-8 ~ 4e-3 relative) before
#       the P V product and the output rounds again; a few ulps of 1.
#  int8: both sides dequantize the same int8 codes, so the tolerance is that of the compute
#       dtype the kernel uses (fp32 queries -> fp32 on TPU; the GPU kernel's MMA is bf16).
TOL = {"float32": 2e-5, "bfloat16": 3e-2, "bf16_mma": 3e-2}


def check_kernel(kernel, kind, ps, K, G, H, q_dtype, tol, seed, fill, **kw):
    # The TPU kernel reads int8 scales lane-dense (the runner's layout for it); the reference
    # reads either, and gets the same layout.
    lane_dense = kernel is ragged_paged_attention_tpu
    rng = np.random.default_rng(seed)
    f = jax.jit(functools.partial(kernel, interpret=_interpret(kernel, fill), **kw))
    ref = jax.jit(functools.partial(ref_ragged_paged_attention, kv_chunk_pages=2,
                                    sliding_window=kw.get("sliding_window"), soft_cap=kw.get("soft_cap")))
    for name, seqs in mixes(ps).items():
        q, k, v, positions, token_seq, tables = build_case(rng, seqs, ps, K, G, H)
        kc, vc = make_caches(k, v, kind, lane_dense)
        args = (jnp.asarray(q, q_dtype), kc, vc, jnp.int32(LAYER), jnp.asarray(positions),
                jnp.asarray(token_seq), jnp.asarray(tables))
        got = np.asarray(f(*args), np.float32)
        want = np.asarray(ref(*args), np.float32)
        valid = positions >= 0
        assert np.isfinite(got).all(), f"{name}: non-finite output"
        np.testing.assert_allclose(got[valid], want[valid], atol=tol, rtol=tol, err_msg=name)
        np.testing.assert_array_equal(got[~valid], 0, err_msg=f"{name}: padding rows")


# (page size, head dim, KV heads, G, cache kind, query dtype, extra): every page size, head dim,
# GQA ratio and cache kind appears at least once, and each with more than one partner. The
# sliding window and soft-cap ride on the first case (a case of their own cost one more compile
# per fill of uninitialised memory; the window of 19 keys hides whole KV blocks of the longer
# contexts, so the walk's lower bound is exercised).
WINDOW = dict(sliding_window=19, soft_cap=5.0)
TPU_CASES = [
    (16, 64, 2, 1, "float32", jnp.float32, WINDOW),
    (16, 128, 1, 3, "bfloat16", jnp.bfloat16, {}),
    (32, 64, 1, 8, "int8", jnp.float32, {}),
    (16, 128, 2, 3, "int8", jnp.bfloat16, {}),
    # Head dim 256 (Gemma 2, Gemma 3 270M): 256-lane head slices of the [page, K * H] pages;
    # Gemma 2's soft cap of 50 on one, a sliding window over int8 pages on the other.
    (16, 256, 2, 2, "bfloat16", jnp.bfloat16, dict(soft_cap=50.0)),
    (32, 256, 1, 4, "int8", jnp.float32, dict(sliding_window=40)),
]


@pytest.mark.parametrize("ps,H,K,G,kind,q_dtype,extra", TPU_CASES)
def test_tpu_kernel_matches_reference(ps, H, K, G, kind, q_dtype, extra, mem_fill):
    tol = TOL["bfloat16" if q_dtype == jnp.bfloat16 or kind == "bfloat16" else "float32"]
    # Small blocks (2 pages, 16-token query blocks) so a sequence spans several KV blocks and
    # several query blocks: the double-buffered walk and the block edges are exercised.
    check_kernel(ragged_paged_attention_tpu, kind, ps, K, G, H, q_dtype, tol, seed=ps + H + G,
                 fill=mem_fill, q_block=16 if G != 8 else 2, kv_pages_per_block=2, **extra)


# The GPU kernel: int8 caches need pages of >= 64 tokens (128-byte scale copies).
# The window case runs 3 splits (uneven shares), the others 2.
GPU_CASES = [
    (16, 64, 2, 1, "bfloat16", jnp.bfloat16, dict(WINDOW, kv_splits=3)),
    (64, 128, 1, 3, "int8", jnp.bfloat16, dict(kv_splits=2)),
    (16, 64, 1, 8, "float32", jnp.float32, dict(kv_splits=2)),
]


@pytest.mark.parametrize("ps,H,K,G,kind,q_dtype,extra", GPU_CASES)
def test_gpu_kernel_matches_reference(ps, H, K, G, kind, q_dtype, extra, mem_fill):
    # Its MMA runs in bf16 (fp32 inputs are rounded to bf16 first): bf16 tolerance throughout.
    check_kernel(ragged_paged_attention_gpu, kind, ps, K, G, H, q_dtype, TOL["bf16_mma"],
                 seed=ps + H + G, fill=mem_fill, kv_block=64, **extra)


# Zero fill only: under NaN the old merge was right (the sweep above runs both fills).
@pytest.mark.parametrize("mem_fill", ["zero"])
def test_gpu_split_merge_ignores_splits_that_did_not_run(mem_fill):
    """Issue 22: split-K programs whose share of KV blocks is empty write nothing. The merge
    once dropped a split only when its log-sum-exp was non-finite, which holds in the NaN-filled
    interpreter but not on a device (stale, finite memory): under the zero fill the issue saw a
    5-key decode with 2 splits 0.36 away from the reference, and these cases with 4 splits came
    out up to 2.19 away before the fix (measured). Short contexts only (one KV block),
    so 3 of 4 splits of every item are empty; every token's row is checked."""
    if NATIVE:
        pytest.skip("the fill is an interpreter setting")
    rng = np.random.default_rng(22)
    ps, K, G, H = 16, 1, 2, 64
    seqs = [(4, 1), (0, 1), (15, 1), (2, 3), (0, 7)]  # 5, 1, 16, 5 and 7 keys
    q, k, v, positions, token_seq, tables = build_case(rng, seqs, ps, K, G, H)
    kc, vc = make_caches(k, v, "bfloat16")
    args = (jnp.asarray(q, jnp.bfloat16), kc, vc, jnp.int32(LAYER), jnp.asarray(positions),
            jnp.asarray(token_seq), jnp.asarray(tables))
    got = np.asarray(ragged_paged_attention_gpu(*args, interpret=mem_fill, kv_block=64, kv_splits=4), np.float32)
    want = np.asarray(ref_ragged_paged_attention(*args, kv_chunk_pages=2), np.float32)
    valid = positions >= 0
    np.testing.assert_allclose(got[valid], want[valid], atol=TOL["bf16_mma"], rtol=TOL["bf16_mma"])
    np.testing.assert_array_equal(got[~valid], 0)


# ---- lowering for the real targets (no device needed) ------------------------------------

# (page size, head dim, G, cache kind): each value of each axis at least twice.
LOWER_SWEEP = [(16, 64, 1, "bfloat16"), (16, 128, 8, "int8"), (64, 64, 3, "int8"),
               (64, 128, 1, "bfloat16"), (256, 64, 8, "bfloat16"), (256, 128, 3, "int8")]


def _lower(kernel, platform, ps, H, G, kind, **kw):
    K = 2

    def operands():
        kc, vc = kv_cache.init_cache(2, 16, ps, K, H, "int8" if kind == "int8" else jnp.dtype(kind))
        return (jnp.zeros((64, K * G, H), jnp.bfloat16), kc, vc, jnp.int32(1), jnp.zeros(64, jnp.int32),
                jnp.zeros(64, jnp.int32), jnp.zeros((8, 4), jnp.int32))
    # Shapes only: under an abstract mesh (the TPU case) jax >= 0.11 refuses to run ops eagerly.
    args = jax.eval_shape(operands)
    return jax.jit(functools.partial(kernel, **kw)).trace(*args).lower(lowering_platforms=(platform,))


def test_gpu_kernel_lowers_for_cuda():
    """The Mosaic GPU lowering runs its layout and TMA checks in Python: this is as close to
    compiling for an H200 as a CPU machine gets. Window and soft-cap ride on one case."""
    for i, (ps, H, G, kind) in enumerate(LOWER_SWEEP):
        if kind == "int8" and ps < 64:
            continue  # refused up front (see test_gpu_kernel_refuses_small_int8_pages)
        kw = dict(sliding_window=100, soft_cap=30.0) if i == 0 else {}
        _lower(ragged_paged_attention_gpu, "cuda", ps, H, G, kind, **kw)
    _lower(ragged_paged_attention_gpu, "cuda", 16, 128, 1, "float32")


def test_tpu_kernel_lowers_to_mosaic():
    """Pallas -> Mosaic MLIR for a v5e (Mosaic's own passes run only inside libtpu)."""
    device = jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        for i, (ps, H, G, kind) in enumerate(LOWER_SWEEP):
            kw = dict(sliding_window=100, soft_cap=30.0) if i == 0 else {}
            _lower(ragged_paged_attention_tpu, "tpu", ps, H, G, kind, **kw)


# ---- what the kernels refuse, and the seam's dispatch -------------------------------------

def test_gpu_kernel_refuses_small_int8_pages():
    with pytest.raises(ValueError, match="page_size 16 gives 32-byte scale runs"):
        ops.check_impl("pallas_gpu_interpret", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       q_dtype=jnp.bfloat16, kv_dtype="int8")


@pytest.mark.parametrize("impl", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_unsupported_head_dim_is_a_startup_error(impl):
    with pytest.raises(ValueError, match="head_dim 16"):
        ops.check_impl(impl, num_heads=4, num_kv_heads=1, head_dim=16, page_size=16, q_dtype=jnp.float32)


def test_kernel_validation_names_shapes():
    kc, vc = kv_cache.init_cache(1, 4, 16, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"query heads 3 not a multiple of KV heads 2.*\(8, 3, 64\)"):
        ragged_paged_attention_tpu(jnp.zeros((8, 3, 64)), kc, vc, 0, jnp.zeros(8, jnp.int32),
                                   jnp.zeros(8, jnp.int32), jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"positions \(7,\)"):
        ragged_paged_attention_gpu(jnp.zeros((8, 4, 64)), kc, vc, 0, jnp.zeros(7, jnp.int32),
                                   jnp.zeros(8, jnp.int32), jnp.zeros((2, 2), jnp.int32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU dispatch")
def test_dispatch_by_backend_and_no_silent_fallback():
    # On the CPU "auto" is the native kernel where the install built it (test_ragged_paged_attention_cpu.py).
    assert ops.check_impl("auto") == ("cpu_native" if rpa_cpu.available() and ops.AUTO_PREFERS_NATIVE else "xla")
    for impl in ("pallas_tpu", "pallas_gpu"):
        with pytest.raises(ValueError, match="_interpret"):
            ops.check_impl(impl)
    with pytest.raises(ValueError, match="not available"):
        ops.check_impl("triton")
