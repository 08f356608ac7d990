"""The grouped matmul (pallas_kernels/grouped_matmul): the TPU kernel under the TPU interpret
mode (both fills of uninitialised memory) against the dense per-group reference and against
jax.lax.ragged_dot, its Mosaic lowering (exported for TPU, no TPU needed), and the work list
it builds from the group sizes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_forward

from pallas_kernels.interpret import FILL_ENV
from pallas_kernels.grouped_matmul import ref_grouped_matmul
from pallas_kernels.grouped_matmul.tpu import choose_blocks, grouped_matmul_tpu, work_list
from tests.tolerances import EPS32, fp32_reorder_atol

M, K, N, G = 37, 256, 256, 4  # M not a multiple of the tile; 2 K tiles, 2 N tiles
TM, TN, TK = 8, 128, 128
EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)

# Group sizes are data, not shapes: one compiled kernel runs every case below.
CASES = {
    "empty groups, one spanning several tiles, trailing rows in no group": [3, 0, 25, 5],
    "all rows in one group": [0, M, 0, 0],
    "every group empty": [0, 0, 0, 0],
    "boundaries on tile edges": [8, 16, 0, 13],
    "random": None,
}


def _sizes(name):
    if CASES[name] is not None:
        return jnp.array(CASES[name], jnp.int32)
    rng = np.random.default_rng(7)
    return jnp.array(rng.multinomial(M - 2, rng.dirichlet(np.ones(G))), jnp.int32)


def _operands(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    return (jax.random.normal(k1, (M, K), jnp.float32).astype(dtype),
            jax.random.normal(k2, (G, K, N), jnp.float32).astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference_and_ragged_dot(dtype, mem_fill):
    lhs, rhs = _operands(dtype)
    tm = TM if dtype == jnp.float32 else 16  # bf16 packs 16 rows per sublane tile
    for name in CASES:
        sizes = _sizes(name)
        out = grouped_matmul_tpu(lhs, rhs, sizes, out_dtype=jnp.float32, interpret=mem_fill, tm=tm, tn=TN, tk=TK)
        ref = ref_grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32)
        rd = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
        # Same products (bf16 x bf16 is exact in fp32), fp32 sums over K in another order:
        # the reordering bound of a K-term sum. max(.., EPS32) keeps it nonzero when all is 0.
        atol = max(fp32_reorder_atol(K, ref), EPS32)
        np.testing.assert_allclose(out, ref, rtol=0, atol=atol, err_msg=name)
        np.testing.assert_allclose(out, rd, rtol=0, atol=atol, err_msg=name)
        end = int(sizes.sum())
        assert np.all(np.asarray(out[end:]) == 0), name  # rows in no group are zero, exactly
        assert np.all(np.isfinite(np.asarray(out))), name


def test_bf16_output(mem_fill):
    lhs, rhs = _operands(jnp.bfloat16)
    sizes = _sizes("empty groups, one spanning several tiles, trailing rows in no group")
    out = grouped_matmul_tpu(lhs, rhs, sizes, interpret=mem_fill, tm=16, tn=TN, tk=TK)
    assert out.dtype == jnp.bfloat16
    ref = ref_grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32)
    # fp32 sums that differ by the reordering bound, each rounded once to bf16: at most one
    # bf16 ulp (<= eps_bf16 * |value|) apart, plus the fp32 bound.
    atol = EPS_BF16 * np.abs(np.asarray(ref)) + fp32_reorder_atol(K, ref)
    assert np.all(np.abs(np.asarray(out, np.float32) - np.asarray(ref)) <= atol)


def test_work_list_visits_each_tile_once_per_group():
    # rows: g0 [0, 3), g1 empty, g2 [3, 23), g3 [23, 28); tm 8 over 32 rows (4 tiles)
    work = jax.jit(work_list, static_argnums=(1, 2))  # one compile for the three lists
    tile, group, lo, hi = work(jnp.array([3, 0, 20, 5], jnp.int32), 32, 8)
    assert tile.tolist() == [0, 0, 1, 2, 2, 3, 3]  # 4 tiles + G - 1 = 7 visits, in row order
    assert group.tolist() == [0, 2, 2, 2, 3, 3, 3]  # the spare visit keeps the last rhs block
    assert lo.tolist() == [0, 3, 3, 3, 23, 23, 0]
    assert hi.tolist() == [3, 23, 23, 23, 28, 28, 0]  # ... and keeps no rows
    # rows past the groups: tiles 1..3 hold no group's rows and are visited once each, to zero
    tile, group, lo, hi = work(jnp.array([5, 0, 0, 0], jnp.int32), 32, 8)
    assert tile.tolist() == [0, 1, 2, 3, 3, 3, 3]
    assert (hi - lo).tolist() == [5, 0, 0, 0, 0, 0, 0]
    # sizes summing past M are clamped to M (no error channel on device)
    tile, group, lo, hi = work(jnp.array([30, 30, 0, 0], jnp.int32), 32, 8)
    assert int(hi.max()) == 32 and tile.tolist()[:5] == [0, 1, 2, 3, 3]


def test_bad_shapes_name_the_argument():
    lhs, rhs = _operands(jnp.float32)
    with pytest.raises(ValueError, match="group_sizes must be"):
        grouped_matmul_tpu(lhs, rhs, jnp.zeros((G + 1,), jnp.int32))
    with pytest.raises(ValueError, match="rhs K=128 must equal lhs K=256"):
        grouped_matmul_tpu(lhs, rhs[:, :128], jnp.zeros((G,), jnp.int32))
    with pytest.raises(ValueError, match="rhs dtype bfloat16 must equal lhs dtype float32"):
        grouped_matmul_tpu(lhs, rhs.astype(jnp.bfloat16), jnp.zeros((G,), jnp.int32))
    with pytest.raises(ValueError, match="tk=96 must divide K=256"):
        grouped_matmul_tpu(lhs, rhs, jnp.zeros((G,), jnp.int32), tk=96)


@pytest.mark.parametrize("m, k, n, e, dtype", [
    (512, 1024, 2048, 8, jnp.bfloat16),  # prefill-sized bf16 expert projection: the second table row
    (24, 1024, 4096, 8, jnp.bfloat16),  # decode: the first row (tm 64), M padded to the tile
    (40, 64, 128, 4, jnp.float32),  # the tiny Mixtral's down projection split over tp = 2: blocks = all of K, N
])
def test_exports_for_tpu(m, k, n, e, dtype):
    """The kernel lowers to Mosaic (a tpu_custom_call) for TPU with default block sizes."""
    f = jax.jit(lambda lhs, rhs, sizes: grouped_matmul_tpu(lhs, rhs, sizes, out_dtype=jnp.float32))
    device = jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")  # Pallas asks which TPU it lowers for
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((e, k, n), dtype),
            jax.ShapeDtypeStruct((e,), jnp.int32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        exp = jax.export.export(f, platforms=["tpu"])(*args)
    text = exp.mlir_module()
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line and "stablehlo.custom_call" in line]
    assert len(calls) == 1
    tm = choose_blocks(m, n, k, dtype)[0]
    assert f"tensor<{-(-m // tm) * tm}x{n}xf32>" in calls[0]  # M padded to whole tiles


MIXTRAL = Path(__file__).resolve().parent / "data" / "mixtral_moe"  # 4 experts, top 2, D 64, F 128


def test_moe_model_through_the_kernel_equals_ragged_dot(monkeypatch):
    """The tiny Mixtral golden's logits with its expert projections on the Pallas kernel (TPU
    interpret mode) equal those on ragged_dot, the CPU default the model resolves."""
    import checkpoints
    from sharding import grouped_matmul as gmm
    monkeypatch.setenv(FILL_ENV, "zero")  # the kernel tests above cover both fills
    model, _ = checkpoints.load_model(MIXTRAL, "float32")
    assert model.grouped_matmul.name == "ragged_dot"
    prompts = [list(range(5, 17))]
    ref = dense_forward(model)(prompts)
    model.grouped_matmul = gmm.resolve("pallas_tpu_interpret")
    out = dense_forward(model)(prompts)
    for i, p in enumerate(prompts):
        # Same math, fp32 sums in another order; the longest reduction is F = 128.
        np.testing.assert_allclose(out[i, :len(p)], ref[i, :len(p)], rtol=0,
                                   atol=fp32_reorder_atol(128, ref[i, :len(p)]))


def test_moe_layer_split_over_tp_runs_per_shard(monkeypatch):
    """Experts' F split over tp = 2 (fake CPU devices): gate / up column-parallel, down
    row-parallel with a psum, the kernel run per shard under shard_map, equal to one device's
    ragged_dot."""
    from jaxserve.model import layers
    from sharding import grouped_matmul as gmm
    from sharding.mesh import make_mesh
    monkeypatch.setenv(FILL_ENV, "nan")
    E, D, F = 4, 64, 128
    ks = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(ks[0], (1, 12, D), jnp.float32)
    w = [jax.random.normal(k, s, jnp.float32) / np.sqrt(s[-2])
         for k, s in zip(ks[1:], [(D, E), (E, D, F), (E, D, F), (E, F, D)])]
    ref = layers.moe_mlp(x, *w, top_k=2, normalize=True)
    split = gmm.resolve("pallas_tpu_interpret").on_mesh(make_mesh(tp=2))
    out = jax.jit(lambda x, *w: layers.moe_mlp(x, *w, top_k=2, normalize=True, grouped_matmul=split))(x, *w)
    # Same math, fp32 sums in another order (down's F = 128 sum now two halves and a psum).
    np.testing.assert_allclose(out, ref, rtol=0, atol=fp32_reorder_atol(F, ref))


def test_backend_table():
    from sharding import grouped_matmul as gmm
    assert gmm.GROUPED_MATMUL.names == gmm.GMM_IMPLS
    assert tuple(gmm.QUANTIZED) == gmm.GMM_IMPLS  # every row runs quantized experts too
    assert gmm.resolve("auto").name == "ragged_dot"  # on CPU
    assert gmm.GROUPED_MATMUL.resolve("auto", platform="tpu").name == "pallas_tpu"
    with pytest.raises(ValueError, match="grouped_matmul: 'pallas_tpu' needs a TPU backend"):
        gmm.resolve("pallas_tpu")
