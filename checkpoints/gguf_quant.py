"""GGUF Q8_0 / Q4_0 / Q4_1 blocks (and, through gguf_kquant.py, Q5_0 / Q4_K / Q6_K) repacked straight into the int8 / int4 layouts (no float
round trip: integers and fp16 scales are moved, never recomputed; only Q4_0's zero, -8 d, is
derived, and a power-of-two multiple of an fp16 value is exact in fp16).

GGUF blocks cover 32 consecutive inputs of one row (HF [out, in] layout, which is also our
storage layout, pallas_kernels/quantized_matmul/reference.py):
  Q8_0  34 bytes: d f16, qs int8[32]                    W = d * qs
  Q4_0  18 bytes: d f16, qs u8[16]                      W = d * (u - 8)
  Q4_1  20 bytes: d f16, m f16, qs u8[16]               W = d * u + m
with byte j of qs holding input j (low nibble) and input j + 16 (high nibble): exactly our
int4 packing for G = 32, so the packed bytes are copied as they are.

llama.cpp permutes the q/k rows of `llama` models for interleaved RoPE; we un-permute the
packed rows and their scales (whole rows move, nothing inside a row changes), as
gguf_loader.unpermute_rope_rows does for floats.
"""

from __future__ import annotations

import numpy as np

from checkpoints import gguf_kquant
from checkpoints.errors import CheckpointError
from checkpoints.gguf_loader import Q, GGUFCheckpoint, unpermute_rope_rows
from jaxserve.model import family

_BLOCK = 32
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
_DECODED = {Q.Q5_0: (8, 32, gguf_kquant.q5_0), Q.Q4_K: (4, 32, gguf_kquant.q4_k),
            Q.Q6_K: (8, 16, gguf_kquant.q6_k)}  # qtype -> (bits, G, decoder)
_BLOCK_INPUTS = {Q.Q4_K: gguf_kquant.QK_K, Q.Q6_K: gguf_kquant.QK_K}
REPACKABLE = tuple(_BLOCK_BYTES) + tuple(_DECODED)
_WHY_NOT = {Q.Q5_1: "asymmetric 5-bit: int8 here is symmetric (no zero point) and int4 holds 4 bits",
            Q.Q5_K: "asymmetric 5-bit: int8 here is symmetric (no zero point) and int4 holds 4 bits"}


def repack(qtype: Q, shape: tuple[int, int], raw: np.ndarray):
    """One GGUF tensor's raw blocks -> (bits, group_size, q, scale [N, K/G], zero | None), or
    None for a float tensor. shape is (rows N, cols K). Scales are fp16 as stored, except the
    K-quants' fp32 products (gguf_kquant.py says why)."""
    if qtype in FLOAT_TYPES:
        return None
    if qtype not in REPACKABLE:
        why = f" ({_WHY_NOT[qtype]})" if qtype in _WHY_NOT else ""
        raise CheckpointError(f"GGUF quantization {qtype.name} cannot be repacked{why}; as-shipped supports "
                              f"{[t.name for t in REPACKABLE]}; load with --quantize none, int8 or int4")
    N, K = shape
    block = _BLOCK_INPUTS.get(qtype, _BLOCK)
    if K % block:
        raise CheckpointError(f"GGUF {qtype.name} tensor of shape {shape}: {K} inputs is not whole "
                              f"blocks of {block}")
    if qtype in _DECODED:
        bits, G, decode = _DECODED[qtype]
        q, *scales = decode(raw, N, K)
        return bits, G, q, scales[0], scales[1] if len(scales) > 1 else None
    nb = K // _BLOCK
    blocks = np.ascontiguousarray(raw).reshape(N, nb, _BLOCK_BYTES[qtype])
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0]  # [N, K/32]
    if qtype == Q.Q8_0:
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(N, K)
        return 8, _BLOCK, q, d, None
    if qtype == Q.Q4_1:
        z = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0]
        q = np.ascontiguousarray(blocks[:, :, 4:]).reshape(N, K // 2)
    else:  # Q4_0
        with np.errstate(over="raise"):
            try:
                z = d * np.float16(-8)
            except FloatingPointError:
                raise CheckpointError("GGUF Q4_0 scale too large for an fp16 zero point (-8 d)") from None
        q = np.ascontiguousarray(blocks[:, :, 2:]).reshape(N, K // 2)
    return 4, _BLOCK, q, d, z


def quantized_getter(ckpt: GGUFCheckpoint):
    """get_quantized(hf_name) for checkpoints.quantize.build_params: the tensor's blocks
    repacked in storage layout ([N, K/32] scales), q/k rows un-permuted; None for float."""
    names = ckpt._hf_to_gguf

    def get(hf_name: str):
        qtype, shape, raw = ckpt.expert_raw(hf_name) or ckpt.raw_tensor(names[hf_name])
        try:
            got = repack(qtype, shape, raw)
        except CheckpointError as e:
            raise CheckpointError(f"GGUF tensor {names[hf_name]!r}: {e}") from None
        if got is None:
            return None
        bits, G, q, d, z = got
        if family.get(ckpt.config.architecture).gguf_permuted_qk:
            n = (ckpt.config.num_heads if hf_name.endswith("q_proj.weight")
                 else ckpt.config.num_kv_heads if hf_name.endswith("k_proj.weight") else None)
            if n is not None:
                q, d = unpermute_rope_rows(q, n), unpermute_rope_rows(d, n)
                z = None if z is None else unpermute_rope_rows(z, n)
        return (bits, G, np.ascontiguousarray(q), np.ascontiguousarray(d),
                None if z is None else np.ascontiguousarray(z))

    return get
