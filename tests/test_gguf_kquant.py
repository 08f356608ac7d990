"""`--quantize as-shipped` for GGUF Q5_0 / Q4_K / Q6_K (checkpoints/gguf_kquant.py): the
repacked weight dequantizes to the `gguf` package's own dequantize bit for bit.

The blocks are synthesized: random bytes (every bit pattern of the integer fields is a valid
block) with finite fp16 super-block scales written over the d / dmin fields. The gguf package
has no K-quant quantizer, and random bytes cover every 6-bit scale and min and every nibble,
which weights quantized from a smooth distribution would not.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from checkpoints.errors import CheckpointError
from checkpoints.gguf_quant import repack
from jaxserve.model import quant_linear as ql

Q = gguf.GGMLQuantizationType
# qtype -> (inputs a block, bytes a block, byte offsets of its fp16 scale fields)
LAYOUT = {Q.Q5_0: (32, 22, (0,)), Q.Q4_K: (256, 144, (0, 2)), Q.Q6_K: (256, 210, (208,))}


def synth_blocks(qtype, N: int, K: int, seed: int = 0) -> np.ndarray:
    inputs, nbytes, f16_at = LAYOUT[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N, K // inputs, nbytes), dtype=np.uint8)
    for off in f16_at:  # finite scales over a wide exponent range, both signs for d
        d = (rng.standard_normal((N, K // inputs)) * 2.0 ** rng.integers(-14, -2, (N, K // inputs)))
        raw[..., off:off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("qtype,bits,G,scale_dtype", [(Q.Q5_0, 8, 32, np.float16), (Q.Q4_K, 4, 32, np.float32),
                                                      (Q.Q6_K, 8, 16, np.float32)])
def test_kquant_blocks_repack_bit_exactly(qtype, bits, G, scale_dtype):
    N, K = 6, 512
    raw = synth_blocks(qtype, N, K)
    b, g, q, s, z = repack(qtype, (N, K), raw)
    assert (b, g, s.shape, s.dtype) == (bits, G, (N, K // G), scale_dtype)
    assert q.shape == ((N, K) if bits == 8 else (N, K // 2)) and (z is None) == (bits == 8)
    qw = ql.QuantizedWeight(q, s, z, bits=b, group_size=g, shape=(K, N), in_axes=(0,))
    want = gguf.quants.dequantize(raw, qtype).reshape(N, K)
    # Bit-exact: the scales and mins are fp32 products of fp16 with <= 8-bit integers, exact, and
    # the one rounding (Q4_K's u * d sc - dmin m) is the same fp32 operation on both sides.
    np.testing.assert_array_equal(np.asarray(ql._dequantize_nk(qw)), want)


def test_kquant_fp16_scales_would_round():
    """Why the K-quants keep fp32 scales: the same Q4_K blocks with d sc rounded to fp16 are no
    longer exact (relative error up to fp16's 2^-11 on a weight)."""
    N, K = 6, 512
    raw = synth_blocks(Q.Q4_K, N, K)
    _, g, q, s, z = repack(Q.Q4_K, (N, K), raw)
    qw = ql.QuantizedWeight(q, s.astype(np.float16), z.astype(np.float16), bits=4, group_size=g,
                            shape=(K, N), in_axes=(0,))
    got = np.asarray(ql._dequantize_nk(qw))
    want = gguf.quants.dequantize(raw, Q.Q4_K).reshape(N, K)
    assert not np.array_equal(got, want)


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.Q5_K])
def test_asymmetric_5bit_refused_saying_why(qtype):
    with pytest.raises(CheckpointError, match=rf"^GGUF quantization {qtype.name} cannot be repacked "
                                              r"\(asymmetric 5-bit: int8 here is symmetric .*--quantize none, int8 or int4$"):
        repack(qtype, (2, 256), np.zeros((2, 176), np.uint8))


def test_kquant_partial_superblock_refused():
    with pytest.raises(CheckpointError, match=r"Q4_K tensor of shape \(2, 288\): 288 inputs is not whole blocks of 256"):
        repack(Q.Q4_K, (2, 288), np.zeros((2, 162), np.uint8))


def test_stacks_of_mixed_block_types(caplog):
    """A stacked weight whose layers ship different block types (Gemma 3 Q4_K_M's ffn_down: Q4_K
    and Q6_K; attn_v: Q8_0 and Q5_0): int8 layers of group sizes 32 and 16 stack at g16 (each
    g32 scale repeated: the same weights), int4 with int8 has no one exact layout and stays
    float (gguf's exact dequantize) with a warning naming the weight. Every parameter equals
    the float load bit for bit."""
    from checkpoints.name_table import expected_hf_names, hf_to_params
    from checkpoints.quantize import QuantizeSpec, build_params
    from jaxserve.config import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=256, intermediate_size=256, num_layers=2,
                      num_heads=2, num_kv_heads=2, head_dim=128, max_position_embeddings=64,
                      tie_word_embeddings=False)
    shapes = expected_hf_names(cfg)
    # per layer: w_down Q8_0 then Q6_K (-> int8 g16); wo Q4_K then Q6_K (-> float); the rest Q5_0
    pick = {"mlp.down_proj": (Q.Q8_0, Q.Q6_K), "self_attn.o_proj": (Q.Q4_K, Q.Q6_K)}
    raw = {}
    for i, (n, shape) in enumerate(sorted(shapes.items())):
        if len(shape) != 2 or "layers" not in n:
            continue
        N, K = shape
        layer = int(n.split(".")[2])
        qt = next((t[layer] for k, t in pick.items() if k in n), Q.Q5_0)
        if qt == Q.Q8_0:
            blocks = gguf.quants.quantize(np.random.default_rng(i).standard_normal((N, K)).astype(np.float32), qt)
        else:
            blocks = synth_blocks(qt, N, K, seed=i)
        raw[n] = (qt, blocks)

    def get_float(n):
        if n in raw:
            return gguf.quants.dequantize(raw[n][1], raw[n][0]).reshape(shapes[n])
        return np.random.default_rng(len(n)).standard_normal(shapes[n]).astype(np.float32)

    def get_quantized(n):
        return repack(raw[n][0], shapes[n], raw[n][1]) if n in raw else None

    with caplog.at_level("WARNING", logger="jaxserve.checkpoints"):
        got = build_params(cfg, set(shapes), get_float, QuantizeSpec("as-shipped"), get_quantized)
    want = hf_to_params(cfg, set(shapes), get_float)
    down, wo = got["layers.w_down"], got["layers.wo"]
    assert isinstance(down, ql.QuantizedWeight) and (down.bits, down.group_size, down.scale.dtype) == (8, 16, np.float32)
    assert not isinstance(wo, ql.QuantizedWeight)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["layers.wo"]
    assert "['int4/g32', 'int8/g16']" in caplog.records[0].getMessage()
    assert (got["layers.wq"].bits, got["layers.wq"].group_size, got["layers.wq"].scale.dtype) == (8, 32, np.float16)
    for k, v in got.items():
        w = v.dequantize() if isinstance(v, ql.QuantizedWeight) else v
        np.testing.assert_array_equal(np.asarray(w), want[k], err_msg=k)
    # the g16 stack through the CPU matmul path (layer 1: the Q6_K one) equals the float product
    # up to fp32 summation order over K = 256 inputs (~sqrt(256) * 2^-24 relative per output)
    import dataclasses
    one = dataclasses.replace(down, q=down.q[1], scale=down.scale[1], zero=None)
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    from sharding.quantized_matmul import resolve
    y = np.asarray(ql.einsum("bi,io->bo", x, one, matmul=resolve("xla")))
    np.testing.assert_allclose(y, x @ want["layers.w_down"][1], rtol=1e-5, atol=1e-5 * np.abs(y).max())


@pytest.mark.parametrize("impl", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_q6_k_group_of_16_through_the_kernels(impl):
    """Q6_K is the only block type giving int8 groups of 16: the TPU and GPU kernels (interpret
    mode) equal the reference on it up to fp32 summation order over K = 256 inputs (a few
    2^-24 per product, ~sqrt(256) of them: 1e-5 relative is generous, a wrong group is ~1)."""
    import jax.numpy as jnp

    from pallas_kernels.quantized_matmul.reference import ref_quantized_matmul
    from sharding.quantized_matmul import quantized_matmul
    N, K = 128, 256
    _, G, q, s, _ = repack(Q.Q6_K, (N, K), synth_blocks(Q.Q6_K, N, K, seed=2))
    x = np.random.default_rng(3).standard_normal((1, K)).astype(np.float32)
    ref = np.asarray(ref_quantized_matmul(x, q, s, None, bits=8, group_size=G))
    y = np.asarray(quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), None, bits=8, group_size=G,
                                    impl=impl))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
