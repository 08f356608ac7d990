"""The native small-M fp32 matmul (pallas_kernels/small_matmul/cpu_native.py, a C++ XLA FFI custom
call) against jnp.dot at HIGHEST precision: row counts from 1 to 48 across its 6-row register
blocks, K and N off its tile sizes (16-row chunks, 64-column tiles, 16-wide vectors, a scalar
tail), a stacked [L, K, N] weight with a traced layer index under one jit; its determinism (a
row's output bit-identical whatever its batch mates and the thread count); its refusals."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from other_build import assert_bit_identical_to_installed_build, only_in_the_other_build_leg
from tolerances import fp32_reorder_atol

from pallas_kernels.small_matmul import cpu_native as native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"{native.unavailable_reason()}")

# K = 75: four 16-row chunks and an 11-row rest; N = 203: three 64-column tiles, a 16-wide vector
# and 3 scalar columns (and with AVX2 an 8-wide one).
K, N = 75, 203


def _case(rng, M, L=None):
    x = rng.standard_normal((M, K), np.float32)
    w = rng.standard_normal((K, N) if L is None else (L, K, N), np.float32)
    return x, w


def _atol(x, w):
    # Only the summation order differs from the reference (the kernel: one fma chain over k in
    # order): within K * eps of the summed terms' magnitude, |x| @ |w| (Higham 3.1).
    return fp32_reorder_atol(K, np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))


@pytest.mark.parametrize("M", [1, 3, 8, 17, 48])
def test_matches_dot(M):
    x, w = _case(np.random.default_rng(M), M)
    got = jax.jit(native.small_matmul_cpu)(x, w)
    want = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=_atol(x, w))


def test_stacked_weight_with_traced_layer_one_executable():
    rng = np.random.default_rng(5)
    x, w = _case(rng, 5, L=3)
    x3 = x.reshape(5, 1, K)  # leading dims are flattened and restored
    f = jax.jit(lambda x, w, layer: native.small_matmul_cpu(x, w, layer))
    for layer in range(3):
        got = f(x3, w, jnp.int32(layer))
        want = jnp.dot(x, w[layer], precision=jax.lax.Precision.HIGHEST).reshape(5, 1, N)
        np.testing.assert_allclose(got, want, rtol=0, atol=_atol(x, w[layer]))
    assert f._cache_size() == 1  # the layer is traced: one executable for every layer

    def loop(x, w):  # as a decoder's layer loop calls it: the stacked weight as stored
        def body(i, out):
            return out.at[i].set(native.small_matmul_cpu(x, w, i))
        return jax.lax.fori_loop(0, 3, body, jnp.zeros((3, 5, N), jnp.float32))
    got = jax.jit(loop)(x, w)
    for layer in range(3):
        want = jnp.dot(x, w[layer], precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(got[layer], want, rtol=0, atol=_atol(x, w[layer]))


def test_a_rows_output_is_independent_of_batch_mates_and_threads():
    # Work is split only along N and every output is the same fma chain, so row 0 alone, in a
    # batch of 48 (other register blocks), with 1, 2 or 3 threads is bit-identical.
    rng = np.random.default_rng(9)
    x, w = _case(rng, 48)
    alone = np.asarray(native.small_matmul_cpu(x[:1], w, num_threads=1))
    for rows in (1, 2, 5, 48):
        for threads in (1, 2, 3):
            got = np.asarray(native.small_matmul_cpu(x[:rows], w, num_threads=threads))
            np.testing.assert_array_equal(got[:1], alone, err_msg=f"rows={rows} threads={threads}")


def test_a_packed_rows_output_is_the_same_in_a_decode_step_or_a_prefill_chunk():
    # Row 0 alone and among 6 rows (the chunked small-M loop), among 60 and 130 (the GEMM
    # loop), with one or two threads: bit-identical.
    rng = np.random.default_rng(10)
    x, w = _case(rng, 130)
    wp = native.pack(w)
    alone = np.asarray(native.small_matmul_packed_cpu(x[:1], wp, N, num_threads=1))
    for rows, threads in ((130, 1), (130, 2), (60, 2), (6, 2)):
        got = np.asarray(native.small_matmul_packed_cpu(x[:rows], wp, N, num_threads=threads))
        np.testing.assert_array_equal(got[:1], alone, err_msg=f"rows={rows} threads={threads}")


def packed_outputs() -> np.ndarray:
    """The packed kernel on SmolLM2's projection shapes at decode and prefill row counts (the
    one-row path, register blocks, the GEMM loop) and one shape off every tile: flat, for a
    bit-for-bit comparison between builds."""
    rng = np.random.default_rng(0)
    outs = []
    for M, k, n in ((1, 576, 192), (7, 576, 1536), (24, 1536, 576), (48, 576, 576), (100, K, N)):
        x, w = rng.standard_normal((M, k), np.float32), rng.standard_normal((k, n), np.float32)
        outs.append(np.asarray(native.small_matmul_packed_cpu(x, native.pack(w), n)).ravel())
    # A layer's q, k and v in one call (the decoder's einsums), at a decode and a prefill size.
    for M in (5, 100):
        x = rng.standard_normal((M, 576), np.float32)
        ws = [rng.standard_normal((576, n), np.float32) for n in (576, 192, 192)]
        ys = native.small_matmul_packed_many_cpu(x, [native.pack(w) for w in ws], (576, 192, 192))
        outs.extend(np.asarray(y).ravel() for y in ys)
    # bf16 weights (widened in registers) at a decode and a prefill size.
    for M in (3, 100):
        x, w = rng.standard_normal((M, 576), np.float32), rng.standard_normal((576, 1536), np.float32)
        wb = native.pack(jnp.asarray(w, jnp.bfloat16))
        outs.append(np.asarray(native.small_matmul_packed_cpu(x, wb, 1536)).ravel())
    return np.concatenate(outs)


@only_in_the_other_build_leg
def test_packed_is_bit_identical_across_builds(tmp_path):
    # One fma chain per output in k order whatever the vector width, register block or row
    # path: the AVX2 build's products equal the AVX-512 build's (or the other tuning's) bit for
    # bit, so a greedy decode's projections do not depend on the server's x86 build.
    assert_bit_identical_to_installed_build(packed_outputs, native, tmp_path)


def test_pack_layout():
    # pack() is a pure relayout: tile t, row k, lane j holds W[k, 64 t + j], zeros past N.
    w = np.arange(K * N, dtype=np.float32).reshape(K, N)
    p = np.asarray(native.pack(w))
    assert p.shape == (-(-N // 64), K, 64)
    for t in range(p.shape[0]):
        cols = min(64, N - 64 * t)
        np.testing.assert_array_equal(p[t, :, :cols], w[:, 64 * t:64 * t + cols])
        assert not p[t, :, cols:].any()


# Each loop of each build (the GEMM loop above 128 rows on AVX-512, 64 on AVX2 and scalar
# builds) and each register block: the AVX2 build's chunked loop takes rows 3 at a time, 1-row
# and 2-row blocks being other shapes (M = 2, 5 = 3 + 2, 7 = 3 + 3 + 1).
@pytest.mark.parametrize("M", [1, 2, 5, 7, 48, 49, 64, 65, 128, 130])
def test_packed_matches_dot_and_the_unpacked_kernel_bit_for_bit(M):
    # Same fma chain per output as the unpacked entry (k in order from 0), only the W layout
    # differs: equal to it bit for bit, and to jnp.dot HIGHEST within the reordering bound.
    # Above 128 rows with AVX-512 (130: panels of 48, 48, 34), above 64 with AVX2 (65: a panel
    # of 48 and one of 17) the packed kernel takes its GEMM loop (whole-K register blocks over
    # row panels): the same chain.
    x, w = _case(np.random.default_rng(100 + M), M)
    got = jax.jit(native.small_matmul_packed_cpu, static_argnums=2)(x, native.pack(w), N)
    want = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=_atol(x, w))
    np.testing.assert_array_equal(got, native.small_matmul_cpu(x, w))


@pytest.mark.parametrize("M", [8, 48, 130])
def test_packed_computes_only_the_live_rows_and_zeros_the_rest(M):
    # A step padded to its bucket passes its real token count (traced): those rows are the
    # full product's bit for bit (also across the switch to the GEMM loop: 130 rows with
    # 5, 12 or 129 live), the padding rows come out 0 whatever x holds there (NaN, or finite junk that
    # would overflow), and the count is clamped to [0, M].
    rng = np.random.default_rng(300 + M)
    x, w = _case(rng, M)
    wp = native.pack(w)
    full = np.asarray(native.small_matmul_packed_cpu(x, wp, N))
    f = jax.jit(lambda x, w, rows: native.small_matmul_packed_cpu(x, w, N, rows=rows))
    for fill in (np.nan, 3e38):
        for live in sorted({0, 1, 5, 12, 13, M - 1, M, M + 7, -3}):
            xn = x.copy()
            n = min(max(live, 0), M)
            xn[n:] = fill
            got = np.asarray(f(xn, wp, jnp.int32(live)))
            np.testing.assert_array_equal(got[:n], full[:n])
            np.testing.assert_array_equal(got[n:], 0.0)


def test_packed_stacked_with_traced_layer():
    rng = np.random.default_rng(6)
    x, w = _case(rng, 5, L=3)
    f = jax.jit(lambda x, w, layer: native.small_matmul_packed_cpu(x, w, N, layer))
    wp = native.pack(w)
    assert wp.shape == (3, -(-N // 64), K, 64)
    for layer in range(3):
        got = f(x, wp, jnp.int32(layer))
        want = jnp.dot(x, w[layer], precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(got, want, rtol=0, atol=_atol(x, w[layer]))


# q, k and v of a GQA layer: tiles 4 + 1 + 1 (the last off a tile), and one weight alone.
MANY_NS = ((N, 64, 50), (N,))


@pytest.mark.parametrize("ns", MANY_NS, ids=["three", "one"])
@pytest.mark.parametrize("M", [1, 5, 13, 48, 130])
def test_packed_many_equals_one_call_each_bit_for_bit(M, ns):
    # Products of one x in one call (a layer's q, k, v; gate, up): each output is the lone
    # call's bit for bit, stacked weights with a traced layer, on 1 or 2 threads (the tiles of
    # all products split over them together), with live rows (the padding zero whatever x holds
    # there) on either side of the switch to the GEMM loop (130 rows, 65 or 12 live).
    rng = np.random.default_rng(400 + M)
    x = rng.standard_normal((M, K), np.float32)
    ws = [native.pack(rng.standard_normal((2, K, n), np.float32)) for n in ns]
    many = jax.jit(lambda x, ws, layer, rows, threads: native.small_matmul_packed_many_cpu(
        x, ws, ns, layer, rows=rows, num_threads=threads), static_argnums=4)
    for layer, live, threads in ((0, M, 0), (1, M, 1), (1, M, 2), (0, min(M, 12), 2), (1, M // 2, 2)):
        xn = x.copy()
        xn[live:] = np.nan
        got = many(xn, ws, jnp.int32(layer), jnp.int32(live), threads)
        assert len(got) == len(ns)
        for y, w, n in zip(got, ws, ns):
            alone = np.asarray(native.small_matmul_packed_cpu(x[:live], w, n, jnp.int32(layer)))
            assert y.shape == (M, n) and y.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(y)[:live], alone, err_msg=f"layer={layer} live={live}")
            np.testing.assert_array_equal(np.asarray(y)[live:], 0.0)


def test_packed_many_refusals_name_the_field():
    x = jnp.zeros((2, K), jnp.float32)
    w = native.pack(jnp.zeros((K, N), jnp.float32))
    with pytest.raises(ValueError, match="one n per packed weight"):
        native.small_matmul_packed_many_cpu(x, [w, w], [N])
    with pytest.raises(ValueError, match="one n per packed weight"):
        native.small_matmul_packed_many_cpu(x, [], [])
    with pytest.raises(ValueError, match=r"ws_packed\[1\] .* is not pack"):
        native.small_matmul_packed_many_cpu(x, [w, w], [N, N + 64])
    with pytest.raises(ValueError, match=r"layer is needed exactly when ws_packed\[0\] is stacked"):
        native.small_matmul_packed_many_cpu(x, [w], [N], jnp.int32(0))


def test_packed_refusals_name_the_field():
    x = jnp.zeros((2, K), jnp.float32)
    with pytest.raises(ValueError, match="is not pack"):
        native.small_matmul_packed_cpu(x, native.pack(jnp.zeros((K, N), jnp.float32)), N + 64)
    with pytest.raises(ValueError, match=r"w_packed must be \[T, K, 64\]"):
        native.small_matmul_packed_cpu(x, jnp.zeros((K, N), jnp.float32), N)
    with pytest.raises(ValueError, match="x is bfloat16"):
        native.small_matmul_packed_cpu(x.astype(jnp.bfloat16), native.pack(jnp.zeros((K, N), jnp.float32)), N)


@pytest.mark.parametrize("x_shape,w_shape,x_dtype,layer,match", [
    ((2, K), (K, N), jnp.bfloat16, None, "x is bfloat16"),
    ((2, K), (K + 1, N), jnp.float32, None, "K = 75"),
    ((2, K), (N,), jnp.float32, None, r"w must be \[K, N\] or \[L, K, N\]"),
    ((2, K), (2, K, N), jnp.float32, None, "layer is needed"),
    ((2, K), (2, K, N), jnp.float32, 2, r"layer 2 out of range \[0, 2\)"),
])
def test_refusals_name_the_field(x_shape, w_shape, x_dtype, layer, match):
    with pytest.raises(ValueError, match=match):
        native.small_matmul_cpu(jnp.zeros(x_shape, x_dtype), jnp.zeros(w_shape, jnp.float32), layer)


def test_refuses_an_int8_weight():
    with pytest.raises(ValueError, match="w is int8"):
        native.small_matmul_cpu(jnp.zeros((1, K), jnp.float32), jnp.zeros((K, N), jnp.int8))


def test_engine_greedy_tokens_through_it_equal_the_default_path(monkeypatch):
    # matmul_impl="cpu_native" on the untied llama3_rope checkpoint (its projections and LM head
    # are contraction-first, so every one of them can take the kernel), steps of 1 and 8
    # tokens (<= MAX_ROWS; kept small for the suite's time): its greedy tokens must equal the default (XLA) engine's.
    from conftest import ROOT, byte_tokenizer, drain, make_engine

    import checkpoints
    from jaxserve import loading
    from jaxserve.types import SamplingParams
    from sharding import backends, float_matmul

    traced = []  # the products the kernel was given, recorded when the steps are traced

    def counting(x, w):
        traced.append((x.shape, w.shape))
        return native.small_matmul_cpu(x, w)

    def run(fm, pack=False):
        model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "llama3_rope", "float32")
        model.float_matmul = fm
        if pack:
            loading.pack_float_weights(model)
        eng = make_engine(model, byte_tokenizer(loaded.config.eos_token_ids), max_num_batched_tokens=8,
                          token_buckets=(1, 8))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        rng = np.random.default_rng(4)
        for i, n in enumerate((3, 11, 20, 1)):  # 11, 20: prompts chunked over several steps
            eng.add_request({"prompt_token_ids": rng.integers(3, 250, size=n).tolist()}, params, request_id=str(i))
        drain(eng)
        return [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(4)]

    default = run(None)
    row = float_matmul.FLOAT_MATMUL.row("cpu_native")
    native_run = run(float_matmul.FloatMatmul(backends.Backend(row.name, row.platforms, counting)))
    assert native_run == default
    # The projections and the LM head, at both step buckets.
    assert {rows for (rows, _), _ in traced} >= {1, 8}
    assert any(w[1] == 256 for _, w in traced), "the LM head [D, V=256] went through the kernel"
    # The packed row (W packed at load, stacked weights passed whole with the layer index), with
    # each layer's q, k, v and its gate, up in one call each.
    fused = []

    def many(x, ws, ns, layer, **kw):
        fused.append(tuple(ns))
        return native_many(x, ws, ns, layer, **kw)
    native_many = native.small_matmul_packed_many_cpu
    monkeypatch.setattr(native, "small_matmul_packed_many_cpu", many)
    assert run(float_matmul.resolve("cpu_native_packed"), pack=True) == default
    model = checkpoints.load_model(ROOT / "tests" / "data" / "llama3_rope", "float32")[0].cfg
    qkv = (model.num_heads * model.head_dim, *[model.num_kv_heads * model.head_dim] * 2)
    assert set(fused) == {qkv, (model.intermediate_size,) * 2}


def test_live_rows_are_refused_for_a_batch_of_more_than_one_sequence():
    # Live rows are the first tokens of one flat batch (the runner's [1, T] layout): with B > 1
    # "the first n rows" would cut across sequences, so the decoder refuses it, naming B.
    from conftest import ROOT

    import checkpoints
    from jaxserve import loading
    from sharding import float_matmul

    model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "llama3_rope", "float32")
    model.float_matmul = float_matmul.resolve("cpu_native_packed")
    loading.pack_float_weights(model)
    x = jnp.ones((2, 1, model.cfg.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="B = 1"):
        model.head(x, live_rows=jnp.int32(1))
    one = model.head(x[:1], live_rows=jnp.int32(1))
    np.testing.assert_array_equal(one, model.head(x[:1]))


def test_a_tied_embedding_packs_as_the_head_and_gives_its_rows_in_place():
    # A tied model's embedding [V, D] is packed as the LM head's [D, V] (XLA:CPU's dot
    # transposed the whole table each step of more than one row); the lookup reads its rows
    # from the tiles. Rows and flat_params must equal the table bit for bit, and the engine's
    # greedy tokens the default path's (the head through the kernel at 1 and 8 rows).
    from conftest import ROOT, byte_tokenizer, drain, make_engine

    import checkpoints
    from jaxserve import loading
    from jaxserve.model import quant_linear as ql
    from jaxserve.model.decoder import flat_params
    from jaxserve.types import SamplingParams
    from sharding import float_matmul

    def run(pack):
        model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "llama_mqa", "float32")
        assert model.cfg.tie_word_embeddings
        table = np.asarray(model.embed[...])
        if pack:
            model.float_matmul = float_matmul.resolve("cpu_native_packed")
            loading.pack_float_weights(model)
            packed = model.embed[...]
            assert isinstance(packed, ql.PackedFloatWeight) and packed.transposed
            np.testing.assert_array_equal(np.asarray(flat_params(model)["embed"]), table)
            tokens = jnp.asarray([[0, 5, 63, 64, table.shape[0] - 1], [1, 2, 3, 4, 200]])
            np.testing.assert_array_equal(np.asarray(ql.embedding_lookup(packed, tokens, jnp.float32)),
                                          table[np.asarray(tokens)])
        eng = make_engine(model, byte_tokenizer(loaded.config.eos_token_ids), max_num_batched_tokens=8,
                          token_buckets=(1, 8))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        rng = np.random.default_rng(5)
        for i, n in enumerate((3, 11, 20, 1)):
            eng.add_request({"prompt_token_ids": rng.integers(3, 250, size=n).tolist()}, params, request_id=str(i))
        drain(eng)
        return [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(4)]

    assert run(pack=True) == run(pack=False)


def test_matmul_impl_refusals_name_the_field():
    from sharding import float_matmul
    with pytest.raises(ValueError, match="matmul_impl: 'fast' is not available"):
        float_matmul.resolve("fast")
    with pytest.raises(ValueError, match="matmul_impl: 'cpu_native' runs on one device; this mesh has tp = 2"):
        float_matmul.resolve("cpu_native", tp=2)
    assert float_matmul.resolve("xla") is None


def test_auto_takes_the_packed_kernel_for_fp32_and_bf16_on_one_cpu_device_else_xla(monkeypatch, caplog):
    from sharding import backends, float_matmul
    backends.say_once_clear()
    monkeypatch.setattr(native, "vector_width", lambda: 16)  # an AVX-512 build, whatever this machine's
    with caplog.at_level(logging.INFO, logger="jaxserve.float_matmul"):
        assert float_matmul.resolve("auto").name == "cpu_native_packed"
        assert float_matmul.resolve("auto", tp=2) is None
        assert float_matmul.resolve("auto", dtype="bfloat16").name == "cpu_native_packed"
        assert float_matmul.resolve("auto", dtype="float16") is None
    said = caplog.text
    assert "matmul_impl 'auto' on cpu: 'cpu_native_packed'" in said
    assert "'xla' (the mesh has tp = 2" in said and "'xla' (the weights are float16" in said


@pytest.mark.parametrize("width", [16, 8])
def test_auto_takes_the_packed_kernel_for_each_measured_build_and_says_why(monkeypatch, caplog, width):
    # AVX-512 and AVX2 builds both measured faster than XLA's dot (float_matmul.AUTO_BY_VECTOR_WIDTH):
    # the start-up log names the build and the measurement.
    from sharding import backends, float_matmul
    backends.say_once_clear()
    monkeypatch.setattr(native, "vector_width", lambda: width)
    with caplog.at_level(logging.INFO, logger="jaxserve.float_matmul"):
        assert float_matmul.resolve("auto").name == "cpu_native_packed"
    build = float_matmul.AUTO_BY_VECTOR_WIDTH[width].build
    assert f"the native matmul library is an {build} build, which measured faster than xla" in caplog.text


def test_auto_takes_xla_for_a_build_never_measured_or_measured_slower(monkeypatch, caplog):
    # The library says its width; a scalar build has no row in the table, and a row whose build
    # lost to XLA is passed over too, each saying why, and still runs when asked for by name.
    from sharding import backends, float_matmul
    assert native.vector_width() in (1, 8, 16)
    backends.say_once_clear()
    monkeypatch.setattr(native, "vector_width", lambda: 1)
    with caplog.at_level(logging.INFO, logger="jaxserve.float_matmul"):
        assert float_matmul.resolve("auto") is None
    assert ("matmul_impl 'auto' on cpu: 'xla'; not 'cpu_native_packed': the native matmul library is built "
            "for 1-float vectors, a build never measured against xla") in caplog.text
    backends.say_once_clear()
    monkeypatch.setattr(native, "vector_width", lambda: 8)
    monkeypatch.setitem(float_matmul.AUTO_BY_VECTOR_WIDTH, 8,
                        float_matmul.BuildMeasurement("AVX2 + FMA", False, "slower on some machine"))
    with caplog.at_level(logging.INFO, logger="jaxserve.float_matmul"):
        assert float_matmul.resolve("auto") is None
    assert "not 'cpu_native_packed': its AVX2 + FMA build measured slower than xla (slower on some machine)" in caplog.text
    assert float_matmul.resolve("cpu_native_packed").name == "cpu_native_packed"  # still there when asked for


def test_flat_params_unpacks_packed_weights_and_a_mesh_gets_them_unpacked():
    # The loader packs the projections for the native kernel; every reader of the parameters
    # (flat_params: tests, tools, replicate_kv_heads) and a runner on a mesh see the logical
    # [L, K.., N..] arrays, bit for bit.
    from conftest import ROOT

    import checkpoints
    from jaxserve import loading
    from jaxserve.model import quant_linear as ql
    from jaxserve.model.decoder import flat_params, unpack_float_weights
    model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "llama3_rope", "float32")
    before = {k: np.asarray(v) for k, v in flat_params(model).items()}
    loading.pack_float_weights(model)
    stored = flat_params(model, unpack=False)
    assert isinstance(stored["layers.wo"], ql.PackedFloatWeight) and isinstance(stored["lm_head"], ql.PackedFloatWeight)
    after = flat_params(model)
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(np.asarray(after[k]), before[k], err_msg=k)
    unpack_float_weights(model)
    assert not any(isinstance(v, ql.PackedFloatWeight) for v in flat_params(model, unpack=False).values())
    assert model.float_matmul is None
