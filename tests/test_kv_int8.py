"""The int8 KV cache: quantization error bounds, exact writes, the reference's dequantization,
the pool's capacity for the same bytes, and SmolLM2's perplexity with int8 KV against the
unquantized cache (within 1%) through the engine's paged attention path."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import int8_kv_attention_atol

from jaxserve.config import EngineConfig
from jaxserve.model.paged_attention import PagedMeta, init_paged_cache, make_paged_attend
from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention
from pallas_kernels.ragged_paged_attention.blocked import blocked_ragged_paged_attention

# A fixed English text, written for this test (about 630 SmolLM2 tokens; the first 512 are used).
TEXT = (
    "The first lighthouses were not towers at all but fires kept burning on hilltops near "
    "harbours, tended through the night by watchmen who were paid in grain, salt or a share of "
    "the cargo that arrived safely. Over the centuries those open fires moved onto stone "
    "platforms, then into enclosed lanterns, and finally into the tall white towers that still "
    "stand along many rocky coasts. Each change answered a practical problem. An open fire could "
    "be seen from far away on a clear evening, but rain and wind made it unreliable, and the "
    "smoke often hid the flame from the very ships it was meant to guide. Building a wall around "
    "the fire protected it from the weather, and raising it higher let sailors see it from a "
    "greater distance, because the curve of the earth hides low lights long before it hides tall "
    "ones.\n\n"
    "For a long time the fuel itself was the weak point. Wood burned quickly and unevenly, coal "
    "produced thick smoke, and candles gave only a feeble light no matter how many were lit "
    "together. Keepers experimented with whale oil, then with colza oil pressed from seeds, and "
    "later with paraffin, each of which burned brighter and cleaner than the one before. The "
    "greatest improvement, however, came not from a better flame but from a better way of "
    "directing it. Early reflectors were simple polished metal bowls placed behind a lamp. They "
    "helped, but they wasted most of the light by scattering it in every direction. In the early "
    "nineteenth century a French engineer designed a lens made of many rings of glass, each "
    "shaped to bend the light from a single lamp into a narrow horizontal beam. A lighthouse "
    "fitted with such a lens could be seen more than twenty miles out to sea, and the design was "
    "soon copied all over the world.\n\n"
    "Life for the keepers changed much more slowly than the technology they looked after. A "
    "typical station was staffed by two or three families who lived in small cottages at the foot "
    "of the tower, often far from the nearest village. Their days followed a strict routine. In "
    "the morning they cleaned the soot from the lantern glass, trimmed the wicks, and polished "
    "the brass fittings until they shone. In the afternoon they carried fuel up the narrow spiral "
    "stairs, repaired whatever the wind had damaged, and wrote careful notes in the station log "
    "about the weather, passing ships and any unusual events. At dusk the lamp was lit, and "
    "someone stayed awake through the night to make sure it never went out. On remote islands "
    "supply boats might not arrive for weeks during winter storms, so the keepers grew "
    "vegetables, kept goats and chickens, and learned to repair almost anything with the tools "
    "they had.\n\n"
    "Today nearly all lighthouses are automatic. Electric lamps switch on at sunset, sensors "
    "report faults to a control room on the mainland, and satellite navigation has made the beams "
    "far less important than they once were. Many of the old towers have become museums, holiday "
    "cottages or simple landmarks, visited by people who climb the stairs to enjoy the view and "
    "imagine what it was like to spend a stormy night alone at the top, watching over the dark "
    "water and waiting for the morning."
)


def test_quantize_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 4, 128)) * rng.uniform(0.01, 30, size=(64, 4, 1)), jnp.float32)
    x = x.at[0, 0].set(0.0)  # an all-zero vector: zeros back, no division by zero
    q, s = kv_cache.quantize(x)
    assert q.dtype == jnp.int8 and s.dtype == kv_cache.SCALE_DTYPE and s.shape == (64, 4)
    assert int(jnp.abs(q.astype(jnp.int32)).max()) <= 127
    err = jnp.abs(q.astype(jnp.float32) * s.astype(jnp.float32)[..., None] - x)
    # Rounding to the nearest code: |err| <= scale / 2. The scale is rounded to bf16 before
    # use, so the largest element may sit up to 2^-9 beyond code 127 and be clipped; the bound
    # keeps that sliver (0.5 + 127 * 2^-8 steps at worst).
    bound = s.astype(jnp.float32)[..., None] * (0.5 + 127 * 2.0**-8)
    assert bool(jnp.all(err <= bound))
    np.testing.assert_array_equal(q[0, 0], 0)


def test_int8_write_is_exact_and_drops_padding():
    kc, vc = kv_cache.init_cache(2, 3, 4, 2, 8, "int8")
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(3, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, 2, 8)), jnp.float32)
    # slots: page 2 offset 1 (= 9), page 0 offset 3 (= 3), padding (-1)
    kc2, vc2 = kv_cache.write_kv(kc, vc, 1, k, v, jnp.array([9, 3, -1]))
    for cache, x in ((kc2, k), (vc2, v)):
        q, s = kv_cache.quantize(x)
        want_q = np.zeros((2, 3, 4, 2, 8), np.int8)
        want_s = np.zeros((2, 3, 2, 4), np.float32)
        want_q[1, 2, 1], want_s[1, 2, :, 1] = q[0], s[0]
        want_q[1, 0, 3], want_s[1, 0, :, 3] = q[1], s[1]
        assert cache.values.shape == (2, 3, 4, 2 * 8)  # stored [L, P, page, K * H]
        np.testing.assert_array_equal(kv_cache.as_heads(cache, 8).values, want_q)
        np.testing.assert_array_equal(np.asarray(cache.scales, np.float32), want_s)


def test_lane_dense_scale_shapes():
    """The TPU layout's geometry (kv_cache's module doc): g = 128 / page pages a row, heads per
    device padded to 2, 4 or a multiple of 8, rows rounded up; pages of 128+ one page a row."""
    assert kv_cache.scale_shape(3, 100, 16, 4, lane_dense=False) == (3, 100, 4, 16)
    assert kv_cache.scale_shape(3, 100, 16, 1, lane_dense=True) == (3, 13, 2, 128)
    assert kv_cache.scale_shape(3, 100, 32, 3, lane_dense=True) == (3, 25, 4, 128)
    assert kv_cache.scale_shape(3, 100, 64, 12, lane_dense=True) == (3, 50, 16, 128)
    assert kv_cache.scale_shape(3, 100, 256, 8, lane_dense=True) == (3, 100, 8, 256)
    assert kv_cache.scale_shape(3, 100, 16, 8, lane_dense=True, shards=8) == (3, 13, 16, 128)  # 1 -> 2 a device
    with pytest.raises(ValueError, match="page_size 48"):
        kv_cache.scale_shape(3, 100, 48, 8, lane_dense=True)


@pytest.mark.parametrize("ps,K,shards", [(4, 3, 1), (16, 4, 2), (32, 1, 1)])
def test_lane_dense_write_and_reads_match_the_paged_layout(ps, K, shards):
    """The same writes into a paged and a lane-dense int8 cache: every page's scales read back
    equal (page_scales), the lane-dense array is to_lane_dense of the paged one, padding
    slots drop; kv_pages moves lane-dense pages into other pages of another cache exactly.
    shards = 2: each device's heads padded on its own (the write runs per device under tp)."""
    from jaxserve.engine import kv_pages
    L, P, H = 2, 13, 8
    rng = np.random.default_rng(ps + K)
    paged = kv_cache.init_cache(L, P, ps, K, H, "int8")
    dense = kv_cache.init_cache(L, P, ps, K, H, "int8", lane_dense_scales=True, shards=shards)
    slots = jnp.asarray(np.r_[rng.choice(P * ps, 40, replace=False), [-1, -1]], jnp.int32)
    k = jnp.asarray(rng.normal(size=(42, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(42, K, H)), jnp.float32)
    for layer in range(L):
        paged = kv_cache.write_kv(*paged, layer, k * (layer + 1), v, slots)
        if shards == 1:
            dense = kv_cache.write_kv(*dense, layer, k * (layer + 1), v, slots)
        else:  # per device: its heads into its own slice of the scale heads, as under shard_map
            kp, kd = K // shards, dense[0].scales.shape[2] // shards
            parts = []
            for d in range(shards):
                hs = slice(d * kp, (d + 1) * kp)
                local = tuple(kv_cache.QuantizedKV(c.values.reshape(L, P, ps, K, H)[..., hs, :].reshape(L, P, ps, -1),
                                                   c.scales[:, :, d * kd:(d + 1) * kd]) for c in dense)
                parts.append(kv_cache.write_kv(*local, layer, (k * (layer + 1))[:, hs], v[:, hs], slots))
            dense = tuple(kv_cache.QuantizedKV(
                jnp.concatenate([p[i].values.reshape(L, P, ps, kp, H) for p in parts], 3).reshape(L, P, ps, K * H),
                jnp.concatenate([p[i].scales for p in parts], 2)) for i in range(2))
    pages = jnp.arange(P)
    for pc, dc in zip(paged, dense):
        np.testing.assert_array_equal(np.asarray(dc.values), np.asarray(pc.values))
        np.testing.assert_array_equal(np.asarray(dc.scales), np.asarray(kv_cache.to_lane_dense(pc.scales, shards)))
        if shards == 1:
            np.testing.assert_array_equal(np.asarray(kv_cache.page_scales(dc.scales, pages, ps, K)),
                                          np.asarray(pc.scales))
    # A handover's page moves: pages 3, 5, 12 of `dense` into pages 1, 2, 9 of a fresh cache.
    src, dst = [3, 5, 12], [1, 2, 9]
    data = kv_pages.read(dense, src)
    moved = kv_pages.write(kv_cache.init_cache(L, P, ps, K, H, "int8", lane_dense_scales=True, shards=shards),
                           dst, (), data)
    for old, new in zip(dense, moved):
        np.testing.assert_array_equal(np.asarray(kv_cache.page_scales(new.scales, jnp.asarray(dst), ps)),
                                      np.asarray(kv_cache.page_scales(old.scales, jnp.asarray(src), ps)))
        np.testing.assert_array_equal(np.asarray(new.values[:, jnp.asarray(dst)]), np.asarray(old.values[:, jnp.asarray(src)]))
        others = np.setdiff1d(np.arange(1, P), dst)  # page 0, the null page, takes the padding row
        assert not np.asarray(kv_cache.page_scales(new.scales, jnp.asarray(others), ps)).any()


def _case(rng, kind):
    """One layer of 2, pages of 4, two sequences (decode at a page edge + a prefill chunk)."""
    L, P, ps, K, G, H = 2, 12, 4, 2, 3, 16
    k = rng.normal(size=(L, P, ps, K, H)).astype(np.float32)
    v = rng.normal(size=(L, P, ps, K, H)).astype(np.float32)
    kc, vc = jnp.asarray(k), jnp.asarray(v)
    if kind == "int8":
        (kq, ks), (vq, vs) = kv_cache.quantize(kc), kv_cache.quantize(vc)
        kc = kv_cache.QuantizedKV(kq, jnp.swapaxes(ks, -1, -2))
        vc = kv_cache.QuantizedKV(vq, jnp.swapaxes(vs, -1, -2))
    positions = jnp.array([4, 0, 1, 2, 3, 4, 5, -1], jnp.int32)
    token_seq = jnp.array([0, 1, 1, 1, 1, 1, 1, 0], jnp.int32)
    tables = jnp.array([[3, 7, 0, 0], [5, 9, 0, 0]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(8, K * G, H)), jnp.float32)
    return q, kc, vc, 1, positions, token_seq, tables


def test_reference_dequantizes_int8_pages():
    q, kc, vc, *rest = _case(np.random.default_rng(2), "int8")
    got = ref_ragged_paged_attention(q, kc, vc, *rest, kv_chunk_pages=2)
    kf = kv_cache.dequantize_pages(kc.values, kc.scales)
    vf = kv_cache.dequantize_pages(vc.values, vc.scales)
    want = ref_ragged_paged_attention(q, kf, vf, *rest, kv_chunk_pages=2)
    np.testing.assert_allclose(got[:7], want[:7], rtol=1e-5, atol=1e-5)  # the same fp32 math
    # And near the unquantized attention, within half a quantization step per element carried
    # through softmax . V (tolerances.int8_kv_attention_atol; the reference scales q by H^-1/2).
    q2, kc2, vc2, *rest2 = _case(np.random.default_rng(2), "float32")
    exact = ref_ragged_paged_attention(q2, kc2, vc2, *rest2, kv_chunk_pages=2)
    atol = int8_kv_attention_atol(q2, kc2, vc2, kf, vf, jnp.swapaxes(kc.scales, -1, -2),
                                  jnp.swapaxes(vc.scales, -1, -2), q2.shape[-1] ** -0.5)
    np.testing.assert_allclose(got[:7], exact[:7], atol=atol)


def test_blocked_path_dequantizes_int8_pages_like_the_reference():
    q, kc, vc, *rest = _case(np.random.default_rng(3), "int8")
    want = ref_ragged_paged_attention(q, kc, vc, *rest, kv_chunk_pages=2)
    got = blocked_ragged_paged_attention(q, kc, vc, *rest, kv_chunk_pages=2, q_block=4)
    np.testing.assert_allclose(got[:7], want[:7], rtol=1e-5, atol=1e-5)  # the same fp32 math


def test_pool_holds_at_least_1_9x_the_tokens(smollm2):
    cfg = smollm2.model.cfg  # head dim 64: (64 + 2) bytes per token and head vs 128 in bf16
    auto, int8 = EngineConfig(max_model_len=512), EngineConfig(max_model_len=512, kv_cache_dtype="int8")
    ratio = auto.kv_bytes_per_page(cfg, 2) / int8.kv_bytes_per_page(cfg, 2)
    assert ratio >= 1.9, ratio
    pages_auto = auto.scheduler_config(cfg, 2).num_pages
    pages_int8 = int8.scheduler_config(cfg, 2).num_pages
    assert pages_int8 >= 1.9 * pages_auto, (pages_int8, pages_auto)
    # The config's byte count is what the cache really allocates (scales included).
    for ecfg, dtype in ((auto, jnp.bfloat16), (int8, jnp.bfloat16)):
        cache = jax.eval_shape(lambda: init_paged_cache(cfg, 10, ecfg.page_size, dtype, ecfg.kv_cache_dtype))
        nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
        assert nbytes == 10 * ecfg.kv_bytes_per_page(cfg, 2)


def _paged_perplexity(model, tokens, kv_cache_dtype, chunk=128, page_size=16):
    """Perplexity of `tokens` through the engine's paged path (write, then the XLA reference
    attention over the cache), fed in prefill chunks of `chunk` tokens like the scheduler does."""
    cfg, n = model.cfg, len(tokens)
    pages = -(-n // page_size)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]  # page 0 is the null page
    cache = init_paged_cache(cfg, pages + 1, page_size, model.dtype, kv_cache_dtype)
    attend = make_paged_attend(cfg, kv_chunk_pages=pages, impl="xla")

    graphdef, state = nnx.split(model)  # weights as arguments, not constants to fold

    @jax.jit
    def step(state, cache, toks, pos):
        meta = PagedMeta(pos, page_size + pos, jnp.zeros_like(pos), table)
        return nnx.merge(graphdef, state)(toks[None], pos[None], cache, attend, meta)

    tokens = jnp.asarray(tokens, jnp.int32)
    nll = []
    for start in range(0, n, chunk):
        pos = jnp.arange(start, start + chunk, dtype=jnp.int32)
        logits, cache = step(state, cache, tokens[start:start + chunk], pos)
        logp = jax.nn.log_softmax(logits[0], axis=-1)
        nxt = tokens[start + 1:start + chunk + 1]
        nll.append(-jnp.take_along_axis(logp[:len(nxt)], nxt[:, None], axis=1)[:, 0])
    return math.exp(float(jnp.concatenate(nll).mean()))


def test_smollm2_perplexity_int8_within_1_percent(smollm2):
    tokens = smollm2.tokenizer.encode(TEXT)[:512]
    assert len(tokens) == 512
    ppl = _paged_perplexity(smollm2.model, tokens, "auto")
    ppl8 = _paged_perplexity(smollm2.model, tokens, "int8")
    assert ppl < 60, ppl  # ~31: the model reads the text as English (the harness is sound)
    assert abs(ppl8 / ppl - 1) < 0.01, (ppl, ppl8)


def test_engine_runs_with_int8_cache(tiny_model):
    from conftest import drain, make_engine

    from jaxserve.types import SamplingParams
    model, tok = tiny_model
    eng = make_engine(model, tok, kv_cache_dtype="int8")
    assert eng.runner.cache.k.values.dtype == jnp.int8
    assert eng.runner.cache.k.scales.dtype == kv_cache.SCALE_DTYPE
    for i in range(4):
        eng.add_request({"prompt_token_ids": list(range(3 + 7 * i, 20 + 7 * i))},
                        SamplingParams(temperature=0.0, max_tokens=6), request_id=str(i))
    drain(eng)
    assert all(len(eng.pop_finished(str(i)).outputs[0].token_ids) == 6 for i in range(4))
    assert eng.compiles_after_warmup == 0
