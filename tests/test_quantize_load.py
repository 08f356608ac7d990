"""Quantized checkpoints: quantize-on-load (int8 / int4 round to nearest), GGUF Q8_0 / Q4_0 / Q4_1
blocks repacked with no float round trip, and pre-quantized Orbax checkpoints.

Here the checkpoints' side: what the loaders produce, checked against the float weights they
come from (`dequantize_params` rebuilds exactly the weights the quantized matmuls compute
with). The model running quantized weights (accuracy, engine, entry points) is
tests/test_quantized_model.py; the matmuls are tests/test_quantized_matmul.py.
"""

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from checkpoints.errors import CheckpointError
from checkpoints.gguf_loader import GGUFCheckpoint, unpermute_rope_rows
from checkpoints.gguf_quant import quantized_getter, repack
from checkpoints.name_table import hf_to_params
from checkpoints.orbax_io import load_orbax, save_orbax
from checkpoints.quantize import (PER_CHANNEL, QuantizeSpec, build_params, dequantize_params,
                                  load_quantized_params, quantize_int4)
from jaxserve.config import ConfigError
from jaxserve.model import quant_linear as ql
from jaxserve.model.llama import Llama, param_shapes
from quant_text import logits

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "llama_mqa"
Q = gguf.GGMLQuantizationType

# ---- GGUF blocks -----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype,bits", [(Q.Q8_0, 8), (Q.Q4_0, 4), (Q.Q4_1, 4)])
def test_gguf_blocks_repack_exactly(qtype, bits):
    w = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    b, G, q, s, z = repack(qtype, (12, 96), raw)
    assert (b, G, s.shape, s.dtype) == (bits, 32, (12, 3), np.float16)
    assert q.shape == ((12, 96) if bits == 8 else (12, 48)) and (z is None) == (bits == 8)
    qw = ql.QuantizedWeight(q, s, z, bits=b, group_size=G, shape=(96, 12), in_axes=(0,))
    np.testing.assert_array_equal(np.asarray(ql._dequantize_nk(qw)), gguf.quants.dequantize(raw, qtype))


def test_gguf_float_and_unsupported_types():
    assert repack(Q.F32, (2, 32), np.zeros((2, 32), np.float32)) is None
    with pytest.raises(CheckpointError, match="Q5_K cannot be repacked"):
        repack(Q.Q5_K, (2, 256), np.zeros((2, 176), np.uint8))
    with pytest.raises(CheckpointError, match="IQ4_NL cannot be repacked; as-shipped supports"):
        repack(Q.IQ4_NL, (2, 32), np.zeros((2, 18), np.uint8))


class _FakeGGUF:
    """Just what quantized_getter reads: the name map, raw tensors and the config."""

    def __init__(self, tensors, config):
        self._hf_to_gguf = {n: n for n in tensors}
        self.tensors, self.config = tensors, config

    def raw_tensor(self, name):
        return self.tensors[name]

    def expert_raw(self, name):
        return None  # no MoE experts here


def test_qk_rows_unpermuted_on_packed_blocks():
    """llama q/k rows are un-permuted by moving packed rows and their scales: the result
    dequantizes to exactly the un-permuted float rows."""
    from jaxserve.config import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    tensors = {}
    for name, qt in (("model.layers.0.self_attn.q_proj.weight", Q.Q4_1), ("model.layers.0.self_attn.k_proj.weight", Q.Q8_0)):
        rows = 64 if "q_proj" in name else 32
        tensors[name] = (qt, (rows, 64), gguf.quants.quantize(w[:rows], qt))
    get = quantized_getter(_FakeGGUF(tensors, cfg))
    for name, (qt, shape, raw) in tensors.items():
        b, G, q, s, z = get(name)
        qw = ql.QuantizedWeight(q, s, z, bits=b, group_size=G, shape=(64, shape[0]), in_axes=(0,))
        n_heads = 4 if "q_proj" in name else 2
        want = unpermute_rope_rows(gguf.quants.dequantize(raw, qt).reshape(shape), n_heads)
        np.testing.assert_array_equal(np.asarray(ql._dequantize_nk(qw)), want)


# ---- quantize-on-load, tiny HF checkpoint -------------------------------------------------

@pytest.mark.parametrize("mode,group", [("int8", None), ("int8", PER_CHANNEL), ("int4", None), ("int4", 64)])
def test_tiny_hf_quantize_on_load(mode, group):
    fp = checkpoints.load_params(TINY)
    qp = load_quantized_params(TINY, QuantizeSpec(mode, group)).params
    shapes = param_shapes(fp.config)
    quantized = {k for k, v in qp.items() if isinstance(v, ql.QuantizedWeight)}
    # every projection and (tied) the embedding table, which is the LM head
    assert quantized == {"embed", "layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate",
                         "layers.w_up", "layers.w_down"}
    for k, v in qp.items():
        assert (v.full_shape if k in quantized else v.shape) == shapes[k]
    wq = qp["layers.wq"]
    # default groups: int4 32; int8 the largest of 128 / 64 / 32 dividing every input width (64)
    assert wq.bits == int(mode[-1]) and wq.group_size == (group or (32 if mode == "int4" else 64))
    assert wq.q.shape == ((2, 64, 64) if mode == "int8" else (2, 64, 32))  # [L, N*H, D(/2)]
    # fp32 scales when one group spans the whole row (here D = 64 = G), else fp16
    assert wq.scale.dtype == (np.float32 if mode == "int8" and wq.group_size == wq.in_features else np.float16)
    assert qp["layers.w_down"].scale.shape == (2, 64, 1 if group == PER_CHANNEL else 128 // wq.group_size)
    deq = dequantize_params(qp)
    for k in quantized:
        rel = np.abs(deq[k] - fp.params[k]).max() / np.abs(fp.params[k]).max()
        assert rel < (0.01 if mode == "int8" else 0.1), (k, rel)
    # Random weights have no redundancy to absorb rounding (SmolLM2's perplexity, below, is
    # the accuracy test); measured relative L2 logit errors: int8 0.024, int4 0.33-0.38.
    ids = list(range(5, 40))
    a, b = logits(Llama.from_arrays(fp.config, fp.params), ids), logits(Llama.from_arrays(fp.config, deq), ids)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < (0.05 if mode == "int8" else 0.6)


def test_quantize_errors_name_the_problem():
    with pytest.raises(CheckpointError, match="as-shipped needs a quantized checkpoint"):
        load_quantized_params(TINY, QuantizeSpec("as-shipped"))
    # The spec is load configuration: its errors name the config field (and are ConfigErrors).
    with pytest.raises(ConfigError, match="^quantize: 'int3' is not supported"):
        QuantizeSpec("int3")
    with pytest.raises(ConfigError, match="^quantize_group_size: int4 group size 48"):
        QuantizeSpec("int4", 48)
    with pytest.raises(CheckpointError, match="int4 group size 128 does not divide the input width 64"):
        load_quantized_params(TINY, QuantizeSpec("int4", 128))
    with pytest.raises(CheckpointError, match="int4 group size 32 does not divide"):
        quantize_int4(np.zeros((4, 48), np.float32), 32)


def test_orbax_round_trip_gives_identicallogits(tmp_path):
    loaded = load_quantized_params(TINY, QuantizeSpec("int4", 32))
    save_orbax(tmp_path / "ck", loaded.config, loaded.params, quantize="int4")
    back = load_orbax(tmp_path / "ck")
    assert back.config == loaded.config and back.quantize == "int4" and back.load_s > 0
    for k, v in loaded.params.items():
        w = back.params[k]
        assert type(w) is type(v)
        for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(w)):
            assert np.asarray(a).dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(v, ql.QuantizedWeight):
            assert (w.bits, w.group_size, w.shape, w.in_axes) == (v.bits, v.group_size, v.shape, v.in_axes)
    ids = list(range(3, 30))
    la = logits(Llama.from_arrays(loaded.config, loaded.params), ids)  # the quantized model
    lb = logits(Llama.from_arrays(back.config, back.params), ids)
    np.testing.assert_array_equal(la, lb)
    with pytest.raises(CheckpointError, match="already exists"):
        save_orbax(tmp_path / "ck", loaded.config, loaded.params)


# ---- SmolLM2 as shipped (Q4_1 projections, Q8_0 embedding) ----------------------------------

@pytest.fixture(scope="module")
def smol():
    """The default GGUF opened once: fp32 (dequantized) and as-shipped parameters, and the
    as-shipped ones dequantized back."""
    ck = GGUFCheckpoint(checkpoints.default_model_path())
    names = set(ck._hf_to_gguf)
    fp32 = hf_to_params(ck.config, names, ck.hf_tensor)
    shipped = build_params(ck.config, names, ck.hf_tensor, QuantizeSpec("as-shipped"), quantized_getter(ck))
    return ck, fp32, shipped, dequantize_params(shipped)


def test_smollm2_as_shipped_is_the_gguf_bit_for_bit(smol):
    ck, fp32, shipped, shipped_f = smol
    kinds = {k: (v.bits, v.group_size) for k, v in shipped.items() if isinstance(v, ql.QuantizedWeight)}
    assert kinds.pop("embed") == (8, 32)  # Q8_0
    assert set(kinds.values()) == {(4, 32)} and len(kinds) == 7  # Q4_1
    nbytes = sum(x.nbytes for v in shipped.values() for x in jax.tree.leaves(v))
    assert nbytes < 100e6  # 96.6 MB, against 538 MB in fp32
    for k, v in shipped_f.items():
        np.testing.assert_array_equal(v, fp32[k], err_msg=k)


def test_smollm2_real_weights_through_the_seam(smol):
    """Layer 0's shipped weights (fp16 scales, un-permuted q rows) through the quantized einsum
    equal the float einsum on the same weights dequantized."""
    _, fp32, shipped, _ = smol
    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 3, 576)), jnp.float32)
    for name, spec in (("layers.wq", "btd,dnh->btnh"), ("layers.w_gate", "btd,df->btf")):
        w = jax.tree.map(lambda a: jnp.asarray(a[0]), shipped[name])
        got = ql.einsum(spec, x, w)
        want = jnp.einsum(spec, x, fp32[name][0], precision="highest")
        assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) < 1e-5
    tokens = jnp.array([[1, 504, 3300]])
    np.testing.assert_array_equal(ql.embedding_lookup(shipped["embed"], tokens, jnp.float32),
                                  jnp.take(fp32["embed"], tokens, axis=0))


def test_smollm2_orbax_load_skips_conversion(smol, tmp_path):
    ck, _, shipped, _ = smol
    save_orbax(tmp_path / "smol", ck.config, shipped, quantize="as-shipped")
    back = load_orbax(tmp_path / "smol")
    print(f"\nOrbax load of SmolLM2 as shipped: {back.load_s:.2f} s")
    for k, v in shipped.items():
        for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(back.params[k])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.load_s < 10
