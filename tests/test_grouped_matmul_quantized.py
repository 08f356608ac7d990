"""The grouped matmul over int8 / int4 experts (pallas_kernels/grouped_matmul: reference.py's
`ref_quantized_grouped_matmul`, xla.py, tpu_quantized.py; the seam's GroupedMatmul.quantized):
the reference by hand, the XLA path and the TPU kernel (TPU interpret mode, both fills) against
it, no float copy of the experts in the XLA path's compiled memory, the kernel's Mosaic
lowering taking the int8 / packed int4 bytes, tp splits, and quantized MoE models."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_forward

from pallas_kernels.grouped_matmul import xla as gmm_xla
from pallas_kernels.grouped_matmul.reference import ref_quantized_grouped_matmul
from pallas_kernels.grouped_matmul.tpu_quantized import quantized_grouped_matmul_tpu
from pallas_kernels.quantized_matmul.reference import dequantize
from tests.tolerances import EPS32, fp32_reorder_atol

M, K, N, G = 37, 256, 128, 4  # M not a multiple of the row tile; 2 K tiles (int8)
CASES = {  # group sizes are data: one compiled program runs every case
    "empty groups, one spanning tiles, trailing rows in no group": [3, 0, 25, 5],
    "all rows in one group": [0, M, 0, 0],
    "boundaries on tile edges": [8, 16, 0, 13],
}


def _weights(bits, gs, g=G, n=N, k=K, seed=0):
    rng = np.random.default_rng(seed)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (g, n, k // gs)) / 64, jnp.float16)
    if bits == 8:
        return jnp.asarray(rng.integers(-127, 128, (g, n, k)), jnp.int8), scale, None
    zero = jnp.asarray(rng.normal(size=(g, n, k // gs)) / 16, jnp.float16)
    return jnp.asarray(rng.integers(0, 256, (g, n, k // 2)), jnp.uint8), scale, zero


def _lhs(dtype, m=M, k=K):
    return jax.random.normal(jax.random.key(3), (m, k), jnp.float32).astype(dtype)


def test_reference_by_hand_and_against_the_dense_quantized_matmul():
    # int8 per channel, K = 2: expert 0 is [0.5, 1] (q [1, 2] x 0.5), expert 1 [6, -2] (q [3, -1] x 2)
    q = jnp.array([[[1, 2]], [[3, -1]]], jnp.int8)
    scale = jnp.array([[[0.5]], [[2.0]]], jnp.float32)
    x = jnp.array([[1, 1], [2, 0], [1, 0.5], [7, 7]], jnp.float32)
    out = ref_quantized_grouped_matmul(x, q, scale, None, jnp.array([2, 1], jnp.int32), bits=8, group_size=2)
    assert out[:, 0].tolist() == [1.5, 1.0, 5.0, 0.0]  # the last row is in no group: zero
    # Each group's rows equal the dense quantized matmul's dequantized weight (its
    # definition's `dequantize`) applied in float64 numpy, group by group.
    for bits, gs in ((8, 32), (4, 32)):
        q, scale, zero = _weights(bits, gs)
        x = _lhs(jnp.float32)
        sizes = CASES["empty groups, one spanning tiles, trailing rows in no group"]
        out = ref_quantized_grouped_matmul(x, q, scale, zero, jnp.array(sizes, jnp.int32), bits=bits, group_size=gs)
        w = np.asarray(dequantize(q, scale, zero, bits=bits, group_size=gs), np.float64)  # [G, N, K]
        want, start = np.zeros(out.shape), 0
        for g, size in enumerate(sizes):
            want[start:start + size] = np.asarray(x[start:start + size], np.float64) @ w[g].T
            start += size
        # fp32 sums against float64 ones: the K-term rounding bound.
        np.testing.assert_allclose(out, want, rtol=0, atol=fp32_reorder_atol(K, want))


# Each layout once, the two fills of uninitialised memory (pallas_kernels/interpret.py) spread
# over int8 and int4 (interpret mode is slow: a cross product would double the time).
@pytest.mark.parametrize("bits, gs, dtype, mem_fill", [
    (8, 32, jnp.float32, "nan"),  # 4 quantization groups per 128-input K tile
    (8, K, jnp.bfloat16, "zero"),  # per channel: each K tile inside the one group
    (4, 32, jnp.float32, "zero"),
    (4, 128, jnp.bfloat16, "nan"),  # the K tile (256) holds two groups of 128
])
def test_xla_path_and_tpu_kernel_match_the_reference(bits, gs, dtype, mem_fill):
    q, scale, zero = _weights(bits, gs)
    x = _lhs(dtype)
    tm = 8 if dtype == jnp.float32 else 16
    for name, sizes in CASES.items():
        sizes = jnp.array(sizes, jnp.int32)
        ref = ref_quantized_grouped_matmul(x, q, scale, zero, sizes, bits=bits, group_size=gs, out_dtype=jnp.float32)
        kern = quantized_grouped_matmul_tpu(x, q, scale, zero, sizes, bits=bits, group_size=gs, out_dtype=jnp.float32,
                                            interpret=mem_fill, tm=tm, tn=128, tk=128 if bits == 8 else 256)
        # Wait for the interpret-mode kernel (its io_callbacks run jnp on another thread) before
        # dispatching more work: eager ops racing those callbacks deadlocked here once.
        kern = jax.block_until_ready(kern)
        # The XLA path's two forms (it picks one by M): every expert at once, and the work list
        # (8-row tiles here, so groups cross tile edges).
        xla = gmm_xla.all_experts_form(x, q, scale, zero, sizes, bits=bits, group_size=gs)
        wl = gmm_xla.work_list_form(x, q, scale, zero, sizes, bits=bits, group_size=gs, tm=8)
        # The same dequantized weights (int codes, f16 scales: exact in fp32; bf16 x bf16
        # products exact too), fp32 sums over K in another order: the K-term reordering bound.
        atol = max(fp32_reorder_atol(K, ref), EPS32)
        np.testing.assert_allclose(kern, ref, rtol=0, atol=atol, err_msg=name)
        np.testing.assert_allclose(xla, ref, rtol=0, atol=atol, err_msg=name)
        np.testing.assert_allclose(wl, ref, rtol=0, atol=atol, err_msg=name)
        end = int(sizes.sum())
        assert all(np.all(np.asarray(a[end:]) == 0) for a in (kern, xla, wl)), name


def test_xla_path_walks_row_chunks(monkeypatch):
    """Decode-sized M (all experts at once): experts too big for one cached chunk run as a scan
    over chunks of output rows plus a tail; same result. N = 200 with 24-row chunks: 8 steps
    and an 8-row tail."""
    monkeypatch.setattr(gmm_xla, "CPU_CHUNK_BYTES", 24 * G * K * 4)
    assert gmm_xla.chunk_rows(G, 200, K) == 24
    for bits, gs in ((8, 64), (4, 32)):
        q, scale, zero = _weights(bits, gs, n=200)
        x, sizes = _lhs(jnp.float32, m=24), jnp.array([10, 0, 8, 5], jnp.int32)
        assert x.shape[0] <= gmm_xla.ALL_EXPERTS_MAX_ROWS  # the form under test
        out = gmm_xla.xla_quantized_grouped_matmul(x, q, scale, zero, sizes, bits=bits, group_size=gs)
        ref = ref_quantized_grouped_matmul(x, q, scale, zero, sizes, bits=bits, group_size=gs)
        np.testing.assert_allclose(out, ref, rtol=0, atol=fp32_reorder_atol(K, ref))


def test_xla_work_list_form_above_the_decode_rows():
    """Above ALL_EXPERTS_MAX_ROWS rows the XLA path runs the work list: 100 rows in tiles of
    64, groups crossing the tile edge, an empty group, trailing rows in no group; same result."""
    assert gmm_xla.ALL_EXPERTS_MAX_ROWS < 100
    for bits, gs in ((8, 64), (4, 32)):
        q, scale, zero = _weights(bits, gs)
        x, sizes = _lhs(jnp.float32, m=100), jnp.array([30, 0, 50, 15], jnp.int32)
        out = gmm_xla.xla_quantized_grouped_matmul(x, q, scale, zero, sizes, bits=bits, group_size=gs)
        ref = ref_quantized_grouped_matmul(x, q, scale, zero, sizes, bits=bits, group_size=gs)
        np.testing.assert_allclose(out, ref, rtol=0, atol=fp32_reorder_atol(K, ref))
        assert np.all(np.asarray(out[95:]) == 0)


@pytest.mark.parametrize("m", [16, 256])  # the all-experts form, the work list
def test_xla_path_makes_no_float_copy_of_the_experts(m):
    """Compiled temporaries: the old path (dequantize all experts, then ragged_dot) needs the
    [E, K, N] fp32 copy (16 MiB here); the quantized path holds cached chunks of dequantized
    rows (<= 2 x CPU_CHUNK_BYTES: the dense path's unchunked limit) and [M, .] rows."""
    E, k, n = 8, 512, 1024
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((E, n, k), jnp.int8),
            jax.ShapeDtypeStruct((E, n, k // 64), jnp.float16), jax.ShapeDtypeStruct((E,), jnp.int32))
    f32_copy = E * k * n * 4

    def quantized(x, q, s, sizes):
        return gmm_xla.xla_quantized_grouped_matmul(x, q, s, None, sizes, bits=8, group_size=64)

    def dequantized(x, q, s, sizes):
        w = jnp.swapaxes(dequantize(q, s, None, bits=8, group_size=64), 1, 2)
        return jax.lax.ragged_dot(x, w, sizes)

    temp = {f.__name__: jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
            for f in (quantized, dequantized)}
    assert temp["dequantized"] >= f32_copy, temp  # the check can fail: the old path trips it
    rows = m * (n + k) * 4  # the [M, N] output and lhs in fp32
    assert temp["quantized"] <= 2 * gmm_xla.CPU_CHUNK_BYTES + rows, temp
    assert temp["quantized"] < f32_copy // 3, temp  # so no copy of even a third of the experts


def test_bad_operands_name_the_argument():
    q, scale, zero = _weights(4, 32)
    x, sizes = _lhs(jnp.float32), jnp.zeros((G,), jnp.int32)
    run = gmm_xla.xla_quantized_grouped_matmul
    with pytest.raises(ValueError, match="group_sizes must be"):
        run(x, q, scale, zero, jnp.zeros((G + 1,), jnp.int32), bits=4, group_size=32)
    with pytest.raises(ValueError, match="zero must be"):
        run(x, q, scale, None, sizes, bits=4, group_size=32)
    with pytest.raises(ValueError, match="scale / zero must have G=4"):
        run(x, q, scale[:2], zero[:2], sizes, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"q / scale / zero must be \[G, N, .\]"):
        run(x, q[0], scale[0], zero[0], sizes, bits=4, group_size=32)
    with pytest.raises(ValueError, match="tk=128 must be a multiple of the group size 256"):
        q8, s8, _ = _weights(8, 256, k=512)
        quantized_grouped_matmul_tpu(_lhs(jnp.float32, k=512), q8, s8, None, sizes, bits=8, group_size=256, tk=128)


@pytest.mark.parametrize("m, k, n, e, bits, gs, dtype", [
    (24, 1024, 4096, 8, 8, 64, jnp.bfloat16),  # decode-sized int8 expert projection
    (512, 4096, 1024, 8, 4, 32, jnp.bfloat16),  # prefill-sized int4 down projection
    (40, 32, 64, 8, 4, 32, jnp.float32),  # the tiny Qwen3-MoE's down: K = one group = one tile
])
def test_exports_for_tpu(m, k, n, e, bits, gs, dtype):
    """The kernel lowers to Mosaic for TPU with default block sizes, and the weight reaches the
    custom call in its stored int8 / packed uint8 bytes."""
    f = jax.jit(lambda x, q, s, z, sizes: quantized_grouped_matmul_tpu(x, q, s, z, sizes, bits=bits, group_size=gs))
    device = jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")
    kq = k if bits == 8 else k // 2
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((e, n, kq), jnp.int8 if bits == 8 else jnp.uint8),
            jax.ShapeDtypeStruct((e, n, k // gs), jnp.float16),
            None if bits == 8 else jax.ShapeDtypeStruct((e, n, k // gs), jnp.float16),
            jax.ShapeDtypeStruct((e,), jnp.int32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        text = jax.export.export(f, platforms=["tpu"])(*args).mlir_module()
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line and "stablehlo.custom_call" in line]
    assert len(calls) == 1
    stored = f"tensor<{e}x{n}x{kq}x{'i8' if bits == 8 else 'ui8'}>"
    assert stored in calls[0], calls[0]
    assert f"tensor<{e}x{k}x{n}x" not in text and f"tensor<{e}x{n}x{k}xf" not in text  # no float experts


def test_split_over_tp_equals_one_device():
    """q / scale / zero split over tp = 2 (fake CPU devices) by output rows ("n") or by whole
    input groups ("k", partial sums and a psum) equal the unsplit call. The seam's shard_map
    is the same for every row; the Pallas rows' kernel is tested above."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from sharding import grouped_matmul as gmm
    from sharding.mesh import make_mesh
    mesh = make_mesh(tp=2)
    one, split = gmm.resolve("ragged_dot"), gmm.resolve("ragged_dot").on_mesh(mesh)
    q, scale, zero = _weights(4, 32)
    x, sizes = _lhs(jnp.float32, m=24), jnp.array([5, 0, 12, 7], jnp.int32)
    ref = one.quantized(x, q, scale, zero, sizes, bits=4, group_size=32)
    for how, spec in (("n", P(None, "tp", None)), ("k", P(None, None, "tp"))):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        out = jax.jit(lambda x, q, s, z: split.quantized(x, q, s, z, sizes, bits=4, group_size=32, split=how))(
            x, put(q), put(scale), put(zero))
        # "k": each half's K/2-term sum, then one add: still a reordering of the K-term sum.
        np.testing.assert_allclose(out, ref, rtol=0, atol=fp32_reorder_atol(K, ref), err_msg=how)
    with pytest.raises(ValueError, match="given no mesh"):
        one.quantized(x, q, scale, zero, sizes, bits=4, group_size=32, split="n")


DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("name, mode, impl", [
    ("qwen3_moe", "int8", "ragged_dot"),  # 8 experts, top 3, F = 32 (one int8 group of 32)
])
def test_quantized_moe_model_equals_the_float_model_of_its_weights(name, mode, impl, monkeypatch):
    """A MoE golden quantized at load: its logits equal the float model built from the same
    dequantized weights (checkpoints.quantize.dequantize_params) up to fp32 summation order,
    with the experts read as int8 through the grouped matmul row `impl`. (Mixtral int4, dense
    and paged at tp = 2: tests/test_moe_quant.py.)"""
    from checkpoints.quantize import QuantizeSpec, dequantize_params, load_quantized_params
    from jaxserve.model.decoder import Decoder
    from pallas_kernels.interpret import FILL_ENV
    from sharding import grouped_matmul as gmm
    monkeypatch.setenv(FILL_ENV, "zero")  # the kernel tests above cover both fills
    loaded = load_quantized_params(DATA / name, QuantizeSpec(mode))
    cfg, params = loaded.config, loaded.params
    model = Decoder.from_arrays(cfg, params)
    model.grouped_matmul = gmm.resolve(impl)
    prompts = [list(range(5, 17)), [7, 3, 9, 200, 41]]
    quant = dense_forward(model)(prompts)
    ref = dense_forward(Decoder.from_arrays(cfg, dequantize_params(params)))(prompts)
    for i, p in enumerate(prompts):
        # Same weights, fp32 sums in another order; the longest reduction on the path is the
        # MLP width (F), the experts' or the attention's inputs, whichever is longer.
        n = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
        np.testing.assert_allclose(quant[i, :len(p)], ref[i, :len(p)], rtol=0, atol=fp32_reorder_atol(n, ref[i]))
        assert (quant[i, :len(p)].argmax(-1) == ref[i, :len(p)].argmax(-1)).all()
