"""GGUF Q5_0 and the K-quants Q4_K / Q6_K decoded to their integers and scales, for
`--quantize as-shipped` (gguf_quant.repack calls these). Only integers are moved; every scale
is a product the format defines (an fp16 super-block scale times a small integer), computed in
fp32, where it is exact, so the repacked weight dequantizes to gguf's own fp32 dequantize bit
for bit. Block layouts (ggml's, little-endian; K = the row's inputs, all blocks of one row):

  Q5_0  22 bytes / 32 inputs: d f16, qh u32 (bit j = input j's 5th bit), qs u8[16]
        (low nibble input j, high nibble input j + 16)           W = d * (q - 16), q in 0..31
        -> int8, G = 32, scale = d (fp16, as stored).
  Q4_K  144 bytes / 256 inputs: d f16, dmin f16, scales u8[12] (eight 6-bit scales sc and
        eight 6-bit mins m, packed below), qs u8[128] as 4 chunks of 32 bytes: chunk c's low
        nibbles are sub-block 2c's 32 inputs, its high nibbles sub-block 2c + 1's.
                                                                   W = d sc_s * u - dmin m_s
        -> int4, G = 32, scale = d sc_s, zero = -dmin m_s (fp32). The nibbles are re-paired
        into our order (low nibble input j, high nibble input j + 16 of a group).
  Q6_K  210 bytes / 256 inputs: ql u8[128], qh u8[64], scales i8[16], d f16; input i of the
        super-block has its low 4 bits in ql and high 2 bits in qh (indexing below);
                                                            W = d sc_t * (q - 32), q in 0..63
        -> int8, G = 16 (one scale per 16 inputs), scale = d sc_t (fp32).

Why fp32 scales for the K-quants: d sc has up to 11 + 7 significant bits (fp16 d, |sc| < 128),
more than fp16's 11, so an fp16 scale would round. In fp32 (24 bits) the scale, the min and
their products with the integers are exact (Q4_K: 11 + 6 + 4 = 21 bits; Q6_K: 11 + 7 + 5 = 23,
|q - 32| <= 32), and gguf dequantizes with the same fp32 products, so the only rounding left is
Q4_K's final `d sc u - dmin m`: the same operation on the same operands on both sides.
The price is memory: Q4_K as int4/g32 with fp32 scale and zero is 6 bits a weight (Q4_K: 4.5);
Q6_K as int8/g16 with fp32 scales is 10 bits a weight (Q6_K: 6.56).

Q5_1 and Q5_K are not here: they are asymmetric 5-bit (W = d q + m), which needs a zero point
the int8 layout does not have (int8 is symmetric) and 5 bits the int4 layout does not hold.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q5_0": 22, "Q4_K": 144, "Q6_K": 210}


def _blocks(raw: np.ndarray, N: int, K: int, inputs: int, nbytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(N, K // inputs, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes a value [..., 2] -> float16 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def q5_0(raw: np.ndarray, N: int, K: int):
    """-> (q int8 [N, K] in -16..15, scale float16 [N, K/32])."""
    b = _blocks(raw, N, K, 32, 22)
    d = _f16(b[..., 0:2])
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, K/32, 1]
    qs = b[..., 6:]  # [N, K/32, 16]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # inputs 0..15, then 16..31
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [N, K/32, 32]
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 16
    return q.astype(np.int8).reshape(N, K), d


def q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A super-block's 12 scale bytes [..., 12] -> (sc, m) uint8 [..., 8], each 6 bits:
    bytes 0-3 hold sc 0-3 in their low 6 bits, bytes 4-7 m 0-3; sub-blocks 4-7 keep their
    low 4 bits in bytes 8-11 (sc low nibble, m high nibble) and their top 2 bits in the top
    2 bits of bytes 0-3 (sc) and 4-7 (m)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def q4_k(raw: np.ndarray, N: int, K: int):
    """-> (packed uint8 [N, K/2] in our int4 order for G = 32, scale, zero float32 [N, K/32])."""
    b = _blocks(raw, N, K, QK_K, 144)
    d = _f16(b[..., 0:2]).astype(np.float32)[..., None]  # [N, S, 1]
    dmin = _f16(b[..., 2:4]).astype(np.float32)[..., None]
    sc, m = q4_k_scales(b[..., 4:16])  # [N, S, 8]
    qs = b[..., 16:].reshape(N, K // QK_K, 4, 32)
    u = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, K // 32, 32)  # sub-block 2c, 2c + 1
    packed = u[..., :16] | (u[..., 16:] << 4)  # our order: input j low, input j + 16 high
    scale = (d * sc.astype(np.float32)).reshape(N, K // 32)
    zero = -(dmin * m.astype(np.float32)).reshape(N, K // 32)
    return packed.reshape(N, K // 2), scale, zero


def q6_k(raw: np.ndarray, N: int, K: int):
    """-> (q int8 [N, K] in -32..31, scale float32 [N, K/16]). Input i = 128 h + r of a
    super-block (h = 0, 1): low 4 bits from ql[64 h + r % 64] (low nibble for r < 64, high
    nibble above), high 2 bits from qh[32 h + r % 32] at bit 2 (r // 32)."""
    b = _blocks(raw, N, K, QK_K, 210)
    S = K // QK_K
    ql = b[..., 0:128].reshape(N, S, 2, 64)
    qh = b[..., 128:192].reshape(N, S, 2, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)  # [N, S, 16]
    d = _f16(b[..., 208:210]).astype(np.float32)[..., None]
    low = np.stack([ql & 15, ql >> 4], axis=3).reshape(N, S, 2, 128)
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3).reshape(N, S, 2, 128)
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    scale = (d * sc.astype(np.float32)).reshape(N, K // 16)
    return q.astype(np.int8).reshape(N, K), scale
