"""Quantized matmul: the reference against cases computed by hand, then the CPU path and the
TPU / GPU kernels (Pallas interpret mode) against the reference over a sweep of shapes that
are not multiples of the blocks, every group size, fp32 and bf16 activations; the layouts'
three implementations (kernel, model, checkpoint packer) agree; the model's einsum seam."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.quantize import pack_int4, quantize_int4, quantize_int8, unpack_int4
from jaxserve.model import quant_linear as ql
from pallas_kernels.quantized_matmul import reference as R
from pallas_kernels.quantized_matmul.gpu import quantized_matmul_gpu
from pallas_kernels.quantized_matmul.tpu import quantized_matmul_tpu
from sharding.quantized_matmul import check_quant_impl, quantized_matmul, resolve

XLA = resolve("xla")  # the quantized matmul the model would hold on this CPU

TOL = {"float32": 2e-5, "bfloat16": 2e-2}  # relative to max |y|: fp32 sums vs bf16 operands


def operands(M, N, K, bits, G, x_dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), x_dtype)
    if bits == 8:
        q = jnp.asarray(rng.integers(-127, 128, (N, K)), jnp.int8)
        z = None
    else:
        q = jnp.asarray(rng.integers(0, 256, (N, K // 2)), jnp.uint8)
        z = jnp.asarray(rng.standard_normal((N, K // G)) * 0.05, jnp.float16)
    s = jnp.asarray(rng.random((N, K // G)) * 0.01 + 1e-3, jnp.float16 if G < K else jnp.float32)
    return x, q, s, z


def close(y, ref, dtype):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert y.shape == ref.shape
    err = np.max(np.abs(y - ref)) / np.max(np.abs(ref))
    assert err < TOL[dtype], err


# ---- the reference, by hand -------------------------------------------------------------

def test_int8_reference_by_hand():
    # W = scale * q, per output row: rows [1, -2] * 0.5 and [3, 4] * 2.
    q = jnp.array([[1, -2], [3, 4]], jnp.int8)
    s = jnp.array([[0.5], [2.0]], jnp.float32)  # [N, K/G] with G = K
    x = jnp.array([[1.0, 1.0], [2.0, -1.0]], jnp.float32)
    want = np.array([[0.5 - 1.0, 6.0 + 8.0], [1.0 + 1.0, 12.0 - 8.0]])
    np.testing.assert_allclose(R.ref_quantized_matmul(x, q, s, bits=8, group_size=2), want)
    np.testing.assert_allclose(R.xla_quantized_matmul(x, q, s, bits=8, group_size=2), want)


def test_int4_packing_and_reference_by_hand():
    # One row, K = 64, G = 32: byte j of group g holds input g*32 + j (low) and g*32 + 16 + j (high).
    u = np.arange(64) % 16  # the unsigned 4-bit values, input by input
    packed = pack_int4(u[None], 32)
    assert packed.shape == (1, 32)
    assert packed[0, 0] == (u[0] | u[16] << 4) and packed[0, 17] == (u[33] | u[49] << 4)
    np.testing.assert_array_equal(unpack_int4(packed, 32)[0], u)
    np.testing.assert_array_equal(np.asarray(R.unpack_int4(jnp.asarray(packed), 32))[0], u)
    s = jnp.array([[0.5, 2.0]], jnp.float16)  # group 0 scale 0.5, group 1 scale 2
    z = jnp.array([[-1.0, 3.0]], jnp.float16)
    w = np.concatenate([u[:32] * 0.5 - 1.0, u[32:] * 2.0 + 3.0])
    x = np.zeros((1, 64), np.float32)
    x[0, [0, 20, 40]] = [1.0, 2.0, -1.0]
    want = x @ w
    y = R.ref_quantized_matmul(jnp.asarray(x), jnp.asarray(packed), s, z, bits=4, group_size=32)
    np.testing.assert_allclose(y[0], want, rtol=1e-6)
    np.testing.assert_allclose(R.xla_quantized_matmul(jnp.asarray(x), jnp.asarray(packed), s, z, bits=4,
                                                      group_size=32)[0], want, rtol=1e-6)


def test_three_dequantizers_agree_bit_for_bit():
    """The kernel package, the model package and the checkpoint packer share one layout."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 48, 128)).astype(np.float32)  # stacked [L, N, K]
    for bits, G in ((8, None), (8, 32), (4, 32), (4, 64), (4, 128)):
        parts = [(quantize_int8(m, G) + (None,)) if bits == 8 else quantize_int4(m, G) for m in w]
        q, s = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
        z = None if bits == 8 else np.stack([p[2] for p in parts])
        g = G or 128
        qw = ql.QuantizedWeight(q, s, z, bits=bits, group_size=g, shape=(128, 48), in_axes=(0,))
        kernel = np.asarray(R.dequantize(q, s, z, bits=bits, group_size=g))
        model = np.asarray(ql._dequantize_nk(qw))
        np.testing.assert_array_equal(kernel, model)
        np.testing.assert_array_equal(np.asarray(qw.dequantize()), np.swapaxes(model, 1, 2))
        step = (np.abs(w).reshape(2, 48, -1, g).max(-1) / 127 if bits == 8 else
                (w.reshape(2, 48, -1, g).max(-1) - w.reshape(2, 48, -1, g).min(-1)) / 15)
        err = np.abs(model - w).reshape(2, 48, -1, g).max(-1)
        assert np.all(err <= step * 0.5 + 1e-3 * step + 1e-6)  # round to nearest (+ fp16 scale rounding)


# ---- the CPU path against the reference ----------------------------------------------------

@pytest.mark.parametrize("bits,G", [(8, None), (8, 32), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_xla_path_matches_reference(bits, G, x_dtype):
    M, N, K = 3, 70, 256
    x, q, s, z = operands(M, N, K, bits, G or K, x_dtype)
    kw = dict(bits=bits, group_size=G or K)
    close(R.xla_quantized_matmul(x, q, s, z, **kw), R.ref_quantized_matmul(x, q, s, z, **kw), x_dtype)


def test_xla_path_row_chunks_with_a_tail(monkeypatch):
    # Small chunk budget: N = 203 rows go as a scan of whole chunks plus one tail block.
    monkeypatch.setattr(R, "CPU_CHUNK_BYTES", 16 * 1024)
    for bits, G in ((8, 128), (8, 32), (4, 32)):
        x, q, s, z = operands(2, 203, 128, bits, G)
        assert R._chunk_rows(203, 128) < 203
        fn = jax.jit(functools.partial(R.xla_quantized_matmul.__wrapped__, bits=bits, group_size=G))
        close(fn(x, q, s, z), R.ref_quantized_matmul(x, q, s, z, bits=bits, group_size=G), "float32")


# ---- the kernels against the reference (interpret mode) ------------------------------------

# (M, N, K, bits, G, x dtype, block overrides): M and N off the blocks, several K steps,
# every int4 group size, per-channel and grouped int8, both activation dtypes.
TPU_CASES = [
    (5, 200, 256, 8, 256, "float32", dict(bn=128, bk=128)),  # per channel, 2 K steps, N edge
    (3, 136, 256, 8, 32, "bfloat16", dict(bk=128)),
    (9, 130, 256, 4, 32, "float32", dict(bn=128)),
    (5, 260, 512, 4, 64, "bfloat16", dict(bn=128, bk=256)),
    (17, 136, 512, 4, 128, "float32", dict(bm=8, bk=256)),  # three M blocks
    (3, 256, 2048, 4, 32, "bfloat16", {}),  # decode blocks: bk = K, 64 groups run as a loop
    # The loop over aligned 128-lane chunks (Mosaic refused a loop over single groups, E2003):
    # int4 G = 128 is 2 groups a chunk (5 chunks), int8 G = 32 is 4 (10 chunks), both bk = K.
    (2, 136, 1280, 4, 128, "float32", {}),
    (4, 200, 1280, 8, 32, "bfloat16", {}),
    (2, 384, 1024, 8, 1024, "bfloat16", {}),  # decode per channel: bk = K in 512-input chunks
]


@pytest.mark.parametrize("bits,G", [(8, 32), (4, 64)])
def test_tpu_kernel_in_tpu_interpret_mode(bits, G, mem_fill):
    """The TPU interpret mode simulates TPU memory semantics (DMAs, VMEM, grid order)."""
    x, q, s, z = operands(10, 136, 256, bits, G, "bfloat16")
    y = quantized_matmul_tpu(x, q, s, z, bits=bits, group_size=G, interpret="tpu_" + mem_fill, bm=16, bn=128)
    close(y, R.ref_quantized_matmul(x, q, s, z, bits=bits, group_size=G), "bfloat16")


def generic_zero_fill(monkeypatch):
    """Pallas's generic interpret mode fills unwritten outputs, scratch and edge padding with
    NaN, hard-wired (jax 0.10: primitives.uninitialized_value, called while lowering). For the
    zero fill this test swaps it for zeros; the kernels get interpret="zero", a static value of
    its own, so this fill's executables are lowered here, under the swap, and never shared."""
    from jax._src.pallas import primitives

    def zeros(shape, dtype):
        if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer):
            return jnp.zeros(shape, dtype)
        return original(shape, dtype)

    original = primitives.uninitialized_value
    monkeypatch.setattr(primitives, "uninitialized_value", zeros)


GPU_CASES = [
    (5, 200, 192, 8, 192, "float32", {}),  # per channel: K steps of 64
    (3, 136, 256, 8, 32, "bfloat16", {}),
    (9, 130, 256, 4, 32, "float32", dict(bn=32)),
    (5, 70, 256, 4, 64, "bfloat16", {}),
    (17, 136, 512, 4, 128, "float32", dict(bm=16)),  # two M blocks
]


@pytest.mark.parametrize("kernel,M,N,K,bits,G,dt,blocks",
                         [("tpu", *c) for c in TPU_CASES] + [("gpu", *c) for c in GPU_CASES])
def test_kernel_matches_reference(kernel, M, N, K, bits, G, dt, blocks, mem_fill, monkeypatch):
    """Each kernel in Pallas's generic interpret mode against the pure-jnp reference."""
    fn = quantized_matmul_tpu if kernel == "tpu" else quantized_matmul_gpu
    x, q, s, z = operands(M, N, K, bits, G, dt)
    if mem_fill == "zero":
        generic_zero_fill(monkeypatch)
    y = fn(x, q, s, z, bits=bits, group_size=G, interpret=mem_fill, **blocks)
    assert y.dtype == x.dtype
    close(y, R.ref_quantized_matmul(x, q, s, z, bits=bits, group_size=G), dt)


ABSTRACT_DEVICES = {"tpu": jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu"),
                    "cuda": jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "cuda")}


def test_kernels_lower_for_their_hardware():
    """Both kernels lower on this CPU-only machine: to Mosaic MLIR for TPU, to Triton for CUDA
    (Mosaic's and Triton's own compilers, on the devices, are not exercised)."""
    M, N, K, G = 16, 256, 512, 32
    for bits in (8, 4):
        args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
                jax.ShapeDtypeStruct((N, K if bits == 8 else K // 2), jnp.int8 if bits == 8 else jnp.uint8),
                jax.ShapeDtypeStruct((N, K // G), jnp.float32),
                jax.ShapeDtypeStruct((N, K // G), jnp.float32) if bits == 4 else None)
        for fn, platform, marker in ((quantized_matmul_tpu, "tpu", "tpu_custom_call"),
                                     (quantized_matmul_gpu, "cuda", "triton")):
            f = jax.jit(functools.partial(fn, bits=bits, group_size=G))
            # Since jax 0.11 the Triton lowering asks which GPU it lowers for (its compute
            # capability), as Pallas TPU asks which TPU: an abstract H100 says so without one.
            mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=ABSTRACT_DEVICES[platform])
            with jax.sharding.use_abstract_mesh(mesh):
                text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert marker in text


def test_gpu_split_k_fills_the_gpu_and_matches_one_split(mem_fill, monkeypatch):
    """4096 -> 1024 at M = 1 has 16 output tiles for 132 SMs: 16 K splits. Here at a small K,
    4 splits give the reference's answer (fp32 partials summed in another order). The sweep
    above runs split-K too (its small N leaves few tiles) and one split (per channel, K = 192)."""
    from pallas_kernels.quantized_matmul.gpu import choose_splits
    assert choose_splits(1, 1024, 4096, 16, 64, 128) == 16
    assert choose_splits(1, 14336, 4096, 16, 64, 128) == 1
    assert choose_splits(1, 4096, 14336, 16, 64, 128) == 4
    if mem_fill == "zero":
        generic_zero_fill(monkeypatch)
    x, q, s, z = operands(3, 70, 512, 4, 64, "float32")
    want = R.ref_quantized_matmul(x, q, s, z, bits=4, group_size=64)
    y = quantized_matmul_gpu(x, q, s, z, bits=4, group_size=64, interpret=mem_fill, splits=4)
    close(y, want, "float32")


def test_tpu_decode_blocks_take_all_of_k_and_wide_columns():
    """Decode (M <= 64): bk = K and bn as wide as a 4 MiB weight block allows, so 4096 -> 14336
    runs 14 grid steps (the old (16, 512, 1024) blocks ran 112) and 14336 -> 4096 runs 16."""
    from pallas_kernels.quantized_matmul.tpu import choose_blocks
    bf16 = jnp.bfloat16
    assert choose_blocks(1, 14336, 4096, bits=8, group_size=4096, x_dtype=bf16) == (16, 1024, 4096)
    assert choose_blocks(1, 4096, 14336, bits=8, group_size=128, x_dtype=bf16) == (16, 256, 14336)
    assert choose_blocks(16, 14336, 4096, bits=4, group_size=128, x_dtype=bf16) == (16, 2048, 4096)
    assert choose_blocks(1, 1024, 4096, bits=8, group_size=128, x_dtype=bf16) == (16, 1024, 4096)
    # Prefill keeps square-ish blocks that reuse each weight block over many rows.
    assert choose_blocks(512, 14336, 4096, bits=8, group_size=128, x_dtype=bf16) == (256, 256, 512)


def test_tpu_kernel_lowers_at_llama_decode_shapes():
    """4096 -> 14336 at M = 1: per channel (chunked), int8 g32 (128 groups: the loop) and int4
    g128 lower to Mosaic with f16 scales (converted to f32 rows outside the kernel)."""
    M, N, K = 1, 14336, 4096
    for bits, G in ((8, K), (8, 32), (4, 128)):
        args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
                jax.ShapeDtypeStruct((N, K if bits == 8 else K // 2), jnp.int8 if bits == 8 else jnp.uint8),
                jax.ShapeDtypeStruct((N, K // G), jnp.float16),
                jax.ShapeDtypeStruct((N, K // G), jnp.float16) if bits == 4 else None)
        f = jax.jit(functools.partial(quantized_matmul_tpu, bits=bits, group_size=G))
        text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


# ---- validation ----------------------------------------------------------------------------

def test_validation_names_shapes():
    x, q, s, z = operands(2, 8, 64, 4, 32)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[N, K/2\] = \[8, 32\].*\(8, 16\)"):
        R.ref_quantized_matmul(x, q[:, :16], s, z, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"scale must be \[N, K/G\] = \[8, 2\].*\(2, 8\)"):
        R.ref_quantized_matmul(x, q, s.T, z, bits=4, group_size=32)
    with pytest.raises(ValueError, match="group size 48 does not divide K=64"):
        R.xla_quantized_matmul(x, q, s, z, bits=4, group_size=48)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        quantized_matmul_tpu(x[None], q, s, z, bits=4, group_size=32, interpret=True)
    with pytest.raises(ValueError, match="bk=96 must divide K=64"):
        quantized_matmul_tpu(x, q, s, z, bits=4, group_size=32, interpret=True, bk=96)
    with pytest.raises(ValueError, match="bn=24 must be a power of two"):
        quantized_matmul_gpu(x, q, s, z, bits=4, group_size=32, interpret=True, bn=24)
    with pytest.raises(ValueError, match="not available"):
        check_quant_impl("cuda_please")
    with pytest.raises(ValueError, match="needs a TPU backend"):
        check_quant_impl("pallas_tpu")


# ---- the model's seam ----------------------------------------------------------------------

def qweight(shape, in_axes, bits, G, lead=(), seed=0):
    """A random float weight in the model's layout and its QuantizedWeight (via the packer)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(lead + shape).astype(np.float32) * 0.1
    out_axes = [a for a in range(len(shape)) if a not in in_axes]
    L = len(lead)
    nk = np.transpose(w, tuple(range(L)) + tuple(L + a for a in out_axes) + tuple(L + a for a in in_axes))
    N, K = int(np.prod([shape[a] for a in out_axes])), int(np.prod([shape[a] for a in in_axes]))
    nk = nk.reshape(lead + (N, K))
    parts = [(quantize_int8(m, G) + (None,)) if bits == 8 else quantize_int4(m, G) for m in nk.reshape(-1, N, K)]
    stack = lambda i: None if parts[0][i] is None else np.stack([p[i] for p in parts]).reshape(lead + parts[0][i].shape)  # noqa: E731
    return ql.QuantizedWeight(stack(0), stack(1), stack(2), bits=bits, group_size=G or K, shape=shape,
                              in_axes=in_axes)


@pytest.mark.parametrize("spec,x_shape,w_shape,in_axes", [
    ("btd,dnh->btnh", (2, 3, 64), (64, 2, 32), (0,)),  # q / k / v
    ("btnh,nhd->btd", (2, 3, 2, 32), (2, 32, 64), (0, 1)),  # o
    ("btd,df->btf", (1, 4, 64), (64, 96), (0,)),  # gate / up
    ("btd,vd->btv", (1, 2, 64), (80, 64), (1,)),  # tied head: the [V, D] table
])
@pytest.mark.parametrize("bits,G", [(8, None), (4, 32)])
def test_einsum_matches_float_einsum_on_dequantized_weights(spec, x_shape, w_shape, in_axes, bits, G):
    qw = qweight(w_shape, in_axes, bits, G)
    x = jnp.asarray(np.random.default_rng(3).standard_normal(x_shape), jnp.float32)
    y = ql.einsum(spec, x, qw, matmul=XLA)
    want = jnp.einsum(spec, x, qw.dequantize(), precision="highest")
    close(y, want, "float32")
    assert ql.einsum(spec, x, qw, matmul=XLA, preferred_element_type=jnp.float32).dtype == jnp.float32
    # a float weight goes straight to jnp.einsum
    np.testing.assert_array_equal(ql.einsum(spec, x, qw.dequantize()), jnp.einsum(spec, x, qw.dequantize()))


def test_stacked_weight_under_scan_nnx_and_kernel_impl():
    """A stacked [L, ...] QuantizedWeight inside an nnx.Param: split / merge, jit, lax.scan
    slicing, `param[...]`, and the TPU kernel through the seam (interpret mode)."""
    from flax import nnx
    qw = qweight((64, 96), (0,), 4, 32, lead=(2,))

    class Holder(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(qw)

    graph, state = nnx.split(Holder())
    x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 3, 64)), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnames="impl")
    def run(state, x, impl):
        w, mm = nnx.merge(graph, state).w[...], resolve(impl)
        return jax.lax.scan(lambda c, wl: (c, ql.einsum("btd,df->btf", x, wl, matmul=mm)), 0, w)[1]

    want = jnp.einsum("btd,ldf->lbtf", x.astype(jnp.float32), qw.dequantize(), precision="highest")
    close(run(state, x, "xla"), want, "bfloat16")
    close(run(state, x, "pallas_tpu_interpret"), want, "bfloat16")
    assert qw.full_shape == (2, 64, 96) and qw[...] is qw


@pytest.mark.parametrize("bits,G", [(8, 32), (4, 64)])
def test_embedding_lookup_dequantizes_only_its_rows(bits, G):
    table = qweight((50, 128), (1,), bits, G)
    tokens = jnp.array([[3, 0, 49], [7, 7, 1]])
    got = ql.embedding_lookup(table, tokens, jnp.float32)
    np.testing.assert_array_equal(got, jnp.take(table.dequantize(), tokens, axis=0))
    assert ql.embedding_lookup(table, tokens, jnp.bfloat16).dtype == jnp.bfloat16


def test_einsum_rejects_specs_that_disagree_with_the_weight():
    qw = qweight((64, 2, 32), (0,), 8, None)
    x = jnp.zeros((1, 2, 64))
    with pytest.raises(ValueError, match="inputs 'd'"):  # contracts the weight's axis 1, not 0
        ql.einsum("btn,dnh->btdh", jnp.zeros((1, 2, 2)), qw, matmul=XLA)
    with pytest.raises(ValueError, match="stacked weights must be sliced"):
        ql.einsum("btd,ldnh->btnh", x, qweight((64, 2, 32), (0,), 8, None, lead=(2,)), matmul=XLA)
    with pytest.raises(ValueError, match="needs the model's quantized matmul"):  # none given: never a default
        ql.einsum("btd,dnh->btnh", x, qw)
    with pytest.raises(ValueError, match=r"QuantizedWeight int8 of shape \(64, 2, 32\).*q must end in \[N, K\] = \[64, 64\]"):
        ql.QuantizedWeight(qw.q[:, :32], qw.scale, None, bits=8, group_size=64, shape=(64, 2, 32), in_axes=(0,))


def test_quantized_matmul_seam_dispatches_by_name():
    x, q, s, z = operands(4, 40, 128, 4, 32)
    ref = R.ref_quantized_matmul(x, q, s, z, bits=4, group_size=32)
    for impl in ("auto", "xla", "ref", "pallas_gpu_interpret"):
        close(quantized_matmul(x, q, s, z, bits=4, group_size=32, impl=impl), ref, "float32")
