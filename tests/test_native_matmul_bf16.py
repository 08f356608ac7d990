"""bf16 weights in the native packed matmul (pallas_kernels/native/small_matmul_cpu.cc widens each
bf16 W vector to fp32 in registers as it reads it): its product is the fp32 kernel's on the
widened weight, bit for bit (a bf16 is the top half of its fp32, so the widening is exact and
the fma chain is unchanged), across the chunked and GEMM loops, live rows, stacked layers and
the many-products entry; what it refuses; `auto`'s choice for a bf16 model; and the engine on a
bf16 model through it against the dense path through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.small_matmul import cpu_native as native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"{native.unavailable_reason()}")

# K = 75, N = 203: chunks, tiles, vectors and scalar columns all have a remainder.
K, N = 75, 203


def _bf16_case(rng, M, L):
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((L, K, N)), jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("M", [1, 2, 5, 7, 48, 65, 130])
def test_bf16_packed_is_the_fp32_product_of_the_widened_weight_bit_for_bit(M):
    # 1-64 rows: the chunked loop (its register blocks and prefetch shares); 65 and 130: the GEMM
    # loop on the AVX2 build (on AVX-512 above 128). Two of three layers, traced, and a live-row
    # count short of M (the padding rows must come out zero on both).
    x, w = _bf16_case(np.random.default_rng(M), M, L=3)
    wb, wf = native.pack(w), native.pack(w.astype(jnp.float32))
    assert wb.dtype == jnp.bfloat16 and wb.nbytes * 2 == wf.nbytes  # half the bytes read
    live = jnp.int32(max(1, M - 1))
    f = jax.jit(lambda x, p, layer: native.small_matmul_packed_cpu(x, p, N, layer, rows=live))
    for layer in (0, 2):
        got = np.asarray(f(x, wb, jnp.int32(layer)))
        np.testing.assert_array_equal(got, np.asarray(f(x, wf, jnp.int32(layer))))
        assert not got[int(live):].any()


def test_bf16_and_fp32_weights_in_one_packed_many_call():
    # A layer's products of one x, each its own dtype: each equals its own single call.
    rng = np.random.default_rng(3)
    x, w = _bf16_case(rng, 9, L=1)
    wf = jnp.asarray(rng.standard_normal((1, K, 64)), jnp.float32)
    ws = (native.pack(w), native.pack(wf), native.pack(w[:, :, :130]))
    ns = (N, 64, 130)
    ys = native.small_matmul_packed_many_cpu(x, ws, ns, jnp.int32(0))
    for y, wp, n in zip(ys, ws, ns):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(native.small_matmul_packed_cpu(x, wp, n, jnp.int32(0))))


def test_refusals_name_the_field():
    x, w = _bf16_case(np.random.default_rng(0), 2, L=1)
    with pytest.raises(ValueError, match="takes a float32 x; x is bfloat16"):
        native.small_matmul_packed_cpu(x.astype(jnp.bfloat16), native.pack(w[0]), N)
    with pytest.raises(ValueError, match="takes a float32 or bfloat16 w_packed; it is float16"):
        native.small_matmul_packed_cpu(x, native.pack(w[0].astype(jnp.float16)), N)
    with pytest.raises(ValueError, match=r"takes a float32 or bfloat16 ws_packed\[1\]; it is int8"):
        native.small_matmul_packed_many_cpu(x, (native.pack(w[0]), native.pack(w[0].astype(jnp.int8))), (N, N))
    with pytest.raises(ValueError, match="w is bfloat16"):  # the unpacked kernel reads fp32 only
        native.small_matmul_cpu(x, w[0])
    from sharding import float_matmul
    with pytest.raises(ValueError, match="matmul_impl: 'cpu_native' reads fp32 weights; these are bfloat16"):
        float_matmul.resolve("cpu_native", dtype="bfloat16")


def test_a_bf16_model_packs_its_weights_and_the_engine_equals_the_dense_path():
    # The tiny untied llama3_rope checkpoint loaded in bf16 with matmul_impl auto: its projections
    # and LM head packed in bf16 (half the bytes), and the paged engine's greedy tokens through
    # them (chunked prompts, steps of 1 and 8 rows) equal the dense generator's through them.
    from conftest import ROOT, byte_tokenizer, drain, make_engine

    from jaxserve import loading
    from jaxserve.engine.dense_generator import DenseGenerator
    from jaxserve.model import quant_linear as ql
    from jaxserve.types import SamplingParams

    lm = loading.load(ROOT / "tests" / "data" / "llama3_rope", "bfloat16")
    if lm.model.float_matmul is None:
        pytest.skip("auto took xla here: this build was never measured (a scalar build)")
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = getattr(lm.model.layers, name)[...]
        assert isinstance(w, ql.PackedFloatWeight) and w.dtype == jnp.bfloat16, name
    assert isinstance(lm.model.lm_head[...], ql.PackedFloatWeight)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (3, 11, 20)]
    dense = DenseGenerator(lm.model, ())
    want = [list(dense.generate(p, params)) for p in prompts]
    eng = make_engine(lm.model, byte_tokenizer(lm.config.eos_token_ids), max_num_batched_tokens=8,
                      token_buckets=(1, 8))
    for i, p in enumerate(prompts):
        eng.add_request({"prompt_token_ids": p}, params, request_id=str(i))
    drain(eng)
    assert [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(len(prompts))] == want
