"""The engine's paged forward exported for TPU (jax.export, no TPU needed): the KV cache goes
from the step's arguments to the TPU attention kernel with no relayout. On TPU, HBM arrays
are tiled over their last two dimensions, so a reshape, transpose or concatenate of the cache
outside the kernel would copy every layer's cache on every call (issue 22); the cache is
stored as the kernel reads it, [L, P, page, K * H], and donated to the step."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model.llama import KVCache, Llama
from jaxserve.model.paged_attention import PagedMeta, init_paged_cache
from sharding import ops

L, PAGES, PS, K, H, T, S = 2, 24, 16, 2, 64, 32, 4


def _exported(kv_cache_dtype, monkeypatch):
    # Resolving "pallas_tpu" refuses off a TPU backend at start-up; exporting for TPU takes the
    # table row's callable directly, with no check.
    kernel = ops.ATTENTION.row("pallas_tpu").fn
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=L,
                      num_heads=4, num_kv_heads=K, head_dim=H, max_position_embeddings=256, tie_word_embeddings=True)
    model = Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cache = init_paged_cache(cfg, PAGES, PS, jnp.bfloat16, kv_cache_dtype)

    def attend(layer, q, k, v, cache, meta):  # make_paged_attend's, minus its start-up check
        k_cache, v_cache = ops.write_kv(cache.k, cache.v, layer, k[0], v[0], meta.slot_mapping)
        out = kernel(q[0], k_cache, v_cache, layer, meta.positions, meta.token_seq, meta.block_tables,
                     sliding_window=None, soft_cap=None, kv_chunk_pages=16, max_decode_run=1)
        return out[None], KVCache(k_cache, v_cache)

    def step(state, cache, tokens, positions, meta):
        h, cache = nnx.merge(graphdef, state).hidden(tokens[None], positions[None], cache, attend, meta)
        return h, cache

    i32 = jax.ShapeDtypeStruct((T,), jnp.int32)
    meta = PagedMeta(i32, i32, i32, jax.ShapeDtypeStruct((S, 8), jnp.int32))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, cache))
    f = jax.jit(step, donate_argnums=(1,))
    device = jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")  # Pallas asks which TPU it lowers for
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.export.export(f, platforms=["tpu"])(*abstract, i32, i32, meta), cache


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tpu_step_reads_the_cache_in_place(kv_cache_dtype, monkeypatch):
    exp, cache = _exported(kv_cache_dtype, monkeypatch)
    text = exp.mlir_module()
    values = cache.k.values if kv_cache_dtype == "int8" else cache.k
    assert values.shape == (L, PAGES, PS, K * H)  # stored as the kernel reads it
    elem = "i8" if kv_cache_dtype == "int8" else "bf16"
    cache_type = f"tensor<{L}x{PAGES}x{PS}x{K * H}x{elem}>"
    heads_type = f"tensor<{L}x{PAGES}x{PS}x{K}x{H}x{elem}>"
    assert text.count("tpu_custom_call") >= 1
    assert cache_type in text and heads_type not in text  # never viewed [.., K, H]
    # No op outside the kernel moves the cache's bytes around: no reshape / transpose /
    # concatenate / copy with the cache's type among its operands or results.
    movers = [line for line in text.splitlines()
              if re.search(r"stablehlo\.(reshape|transpose|concatenate|copy|bitcast_convert)\b", line)
              and cache_type in line]
    assert movers == [], movers
    # The cache reaches the kernel: each layer's custom call takes arguments of the cache's type.
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line and "stablehlo.custom_call" in line]
    assert calls and all(cache_type in line for line in calls)
    # Donated: the step's cache arguments alias its outputs (updated in place).
    n_cache = len(jax.tree.leaves(cache))
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main.count("tf.aliasing_output") + main.count("jax.buffer_donor") >= n_cache, main[:2000]
