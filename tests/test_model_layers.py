"""The model's building blocks against tiny cases computed by hand, and the dense cache path
against a cache-free full forward pass."""

import functools
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.model import layers
from jaxserve.model.dense_attention import attention_reference, init_dense_cache, make_dense_attend
from jaxserve.model.llama import Llama, flat_params
from tolerances import bf16_logits_atol, fp32_reorder_atol


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    base.update(kw)
    return ModelConfig(**base)


def test_rms_norm_by_hand():
    # x = [3, 4]: mean of squares = (9 + 16) / 2 = 12.5, rsqrt = 0.28284; times weight [1, 2].
    out = layers.rms_norm(jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(out, [3 / math.sqrt(12.5), 2 * 4 / math.sqrt(12.5)], rtol=1e-6)


def test_rope_by_hand():
    # head_dim 2, theta irrelevant (inv_freq[0] = 1): position p rotates (x1, x2) by angle p.
    cfg = tiny_cfg(head_dim=2, num_heads=1, num_kv_heads=1, hidden_size=2)
    inv = layers.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, [1.0])
    cos, sin = layers.rope_cos_sin(jnp.array([[0, 1, 2]]), inv)
    x = jnp.ones((1, 3, 1, 2))
    out = layers.apply_rope(x, cos, sin)[0, :, 0]
    # rotate (1, 1) by p: (cos p - sin p, sin p + cos p)
    want = [[math.cos(p) - math.sin(p), math.sin(p) + math.cos(p)] for p in range(3)]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_llama3_rope_scaling_bands():
    # original length 32, low 1, high 4 -> wavelengths > 32 are divided by factor 8,
    # wavelengths < 8 are untouched, the band between is interpolated.
    cfg = tiny_cfg(head_dim=16, rope_theta=10000.0, rope_scaling=RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))
    base = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    got = np.asarray(layers.rope_inv_freq(cfg))
    wavelen = 2 * np.pi / base
    for b, g, w in zip(base, got, wavelen):
        if w < 8:
            assert g == pytest.approx(b, rel=1e-6)
        elif w > 32:
            assert g == pytest.approx(b / 8, rel=1e-6)
        else:
            s = (32 / w - 1) / 3
            assert g == pytest.approx((1 - s) * b / 8 + s * b, rel=1e-5)


def test_attention_reference_by_hand():
    # One query head, one KV head, head_dim 1, two keys. q = 1, k = [0, ln 3 * sqrt(1)]:
    # scores [0, ln 3] -> softmax [1/4, 3/4]; v = [4, 8] -> 1 + 6 = 7.
    q = jnp.array([[[[1.0]]]])  # [B=1, T=1, N=1, H=1]
    k = jnp.array([[[[0.0]], [[math.log(3.0)]]]])  # [1, S=2, K=1, H=1]
    v = jnp.array([[[[4.0]], [[8.0]]]])
    out = attention_reference(q, k, v, jnp.array([[1]]), jnp.array([[0, 1]]))
    np.testing.assert_allclose(out[0, 0, 0, 0], 7.0, rtol=1e-6)
    # Causal: at position 0 only the first key is visible -> 4.
    out0 = attention_reference(q, k, v, jnp.array([[0]]), jnp.array([[0, 1]]))
    np.testing.assert_allclose(out0[0, 0, 0, 0], 4.0, rtol=1e-6)
    # Sliding window 1: at position 1 only key 1 is visible -> 8.
    outw = attention_reference(q, k, v, jnp.array([[1]]), jnp.array([[0, 1]]), sliding_window=1)
    np.testing.assert_allclose(outw[0, 0, 0, 0], 8.0, rtol=1e-6)


def test_attention_reference_groups_query_heads():
    # GQA: query heads 0,1 read KV head 0 and heads 2,3 read KV head 1 (HF's repeat_kv order).
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 3, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 3, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 3, 2, 8)), jnp.float32)
    pos = jnp.arange(3)[None]
    out = attention_reference(q, k, v, pos, pos)
    for n in range(4):
        kk, vv = k[0, :, n // 2], v[0, :, n // 2]
        for t in range(3):
            s = (kk[: t + 1] @ q[0, t, n]) / math.sqrt(8)
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(out[0, t, n], p @ vv[: t + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=1), dict(num_kv_heads=4),
                                dict(attention_bias=True, architecture="qwen2"),
                                dict(sliding_window=3, architecture="mistral"),
                                dict(tie_word_embeddings=True)])
def test_incremental_decode_matches_full_forward(kw):
    """Prefill of a prefix then one-token decode steps give the logits of one full pass."""
    cfg = tiny_cfg(**kw)
    llama = Llama(cfg, rngs=nnx.Rngs(1))
    attend = make_dense_attend(cfg)
    # Jitted: run eagerly, every call traced and compiled the layer scan anew (~5 s a case).
    model = nnx.jit(lambda m, *a: m(*a, attend, a[1]))
    model = functools.partial(model, llama)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    pos = jnp.arange(9, dtype=jnp.int32)[None]
    full, _ = model(tokens, pos, init_dense_cache(cfg, 1, 16, jnp.float32))
    # Prefill 5 tokens padded to 8 (padding at position -1), then decode 4 one at a time.
    ptoks = jnp.zeros((1, 8), jnp.int32).at[0, :5].set(tokens[0, :5])
    ppos = jnp.full((1, 8), -1, jnp.int32).at[0, :5].set(jnp.arange(5))
    cache = init_dense_cache(cfg, 1, 16, jnp.float32)
    logits, cache = model(ptoks, ppos, cache)
    # The same math over a cached prefix: only summation order differs (fp32 reordering bound
    # of the longest reduction, the hidden size).
    tol = fp32_reorder_atol(cfg.hidden_size, full)
    np.testing.assert_allclose(logits[0, :5], full[0, :5], rtol=0, atol=tol)
    for t in range(5, 9):
        step_pos = jnp.array([[t]], jnp.int32)
        logits, cache = model(tokens[:, t:t + 1], step_pos, cache)
        np.testing.assert_allclose(logits[0, 0], full[0, t], rtol=0, atol=tol)


def test_logit_index_selects_positions():
    cfg = tiny_cfg()
    model = Llama(cfg, rngs=nnx.Rngs(3))
    attend = make_dense_attend(cfg)
    tokens = jnp.arange(6, dtype=jnp.int32)[None]
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    full, _ = model(tokens, pos, init_dense_cache(cfg, 1, 8, jnp.float32), attend, pos)
    picked, _ = model(tokens, pos, init_dense_cache(cfg, 1, 8, jnp.float32), attend, pos,
                      jnp.array([[5, 2]], jnp.int32))
    np.testing.assert_allclose(picked[0], full[0, jnp.array([5, 2])], rtol=1e-6)


def test_bfloat16_model_close_to_float32():
    cfg = tiny_cfg()
    m32 = Llama(cfg, rngs=nnx.Rngs(4))
    arrays = {k: np.asarray(v) for k, v in flat_params(m32).items()}
    m16 = Llama.from_arrays(cfg, arrays, dtype=jnp.bfloat16)
    attend = make_dense_attend(cfg)
    tokens = jnp.arange(7, dtype=jnp.int32)[None]
    pos = jnp.arange(7, dtype=jnp.int32)[None]
    l32, _ = m32(tokens, pos, init_dense_cache(cfg, 1, 8, jnp.float32), attend, pos)
    l16, _ = m16(tokens, pos, init_dense_cache(cfg, 1, 8, jnp.bfloat16), attend, pos)
    assert l16.dtype == jnp.float32  # logits are always fp32
    # bf16 rounds every weight and activation on the way by <= 2^-8 relative.
    np.testing.assert_allclose(l16, l32, atol=bf16_logits_atol(cfg, l32))


def test_from_arrays_rejects_wrong_shape():
    cfg = tiny_cfg()
    arrays = {k: np.asarray(v) for k, v in flat_params(Llama(cfg)).items()}
    arrays["final_norm"] = np.ones((31,), np.float32)
    with pytest.raises(ValueError, match=r"final_norm.*\(31,\).*\(32,\)"):
        Llama.from_arrays(cfg, arrays)
