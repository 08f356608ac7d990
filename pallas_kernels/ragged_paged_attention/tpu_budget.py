"""SMEM and VMEM budgets of the TPU ragged paged attention kernel, per TPU generation.

The kernel (tpu.py) holds in SMEM, as scalar prefetch: the layer, three
int32 per sequence (query start, query length, first position), two per query block (the
range of sequences it touches) and the block tables. Tables are passed flattened to 1-D:
Mosaic pads a 2-D SMEM array's last two dimensions to its (8, 128) tile, so [S, W] tables
with W = 2048 (32k tokens at page 16) cost the same as 1-D, but with W = 8 (128 tokens) a
[256, 8] table would take 256 x 128 x 4 = 128 KiB for 8 KiB of data.

Its VMEM, per grid step (one query block of bq tokens x G heads = R rows, all K KV heads; H'
is the head dim rounded up to 128 lanes, so head dim 64 costs what 128 does wherever a head is
a block's last dimension):
  q block and out block   2 x 2 x K x R x H' x q_bytes     (in and out, each double-buffered)
  K and V pages           2 x 2 x nb x page' x K*H x kv_bytes  (K / V, two slots; page' =
                          page rounded up to the dtype's sublane tile: 8 fp32, 16 bf16, 32 int8;
                          K*H rounded up to 128 lanes)
  int8 scales             2 x 2 x nb x K' x 128 x 2   ([nb, K, page] bf16, a page's [K, page]
                          one tile: K to 16 sublanes, page to 128 lanes; the lane padding is the
                          ~8x of issue 22)
  m, l, acc               2 x K x R x 128 x 4 + K x R x H' x 4
  values in flight        per head (the kernel walks heads one at a time, its state in VMEM
                          refs): 4 x [R, bkv] fp32 (scores, p, the mask, their copies: Mosaic's
                          count at the table's blocks is 2.5 - 4.3 of them); the head's K tile,
                          its transpose and the masked V tile, 3 x bkv x H' x q_bytes; int8: the
                          dequantized fp32 K and V tiles, 2 x bkv x H' x 4, and the slot's
                          scales turned [nb, page, K] fp32, 2 x nb x page'' x K'' x 4 (page to 8
                          sublanes, K to 128 lanes)
Checked against the compiler's own count (libtpu 0.0.42.1; scripts/tpu_kernel_sweep.py's budget
rows: the smallest VMEM limit each config compiles under): at the table's blocks the estimate
is 0.97 - 1.34x of it on v5e (Llama-3 to Gemma 2, bf16 and int8, head dims 64 - 256), 1.04 -
1.10x on v6e, 0.99 on v5p; every table block compiles under the limit asked for on all three.
Before H' it was 0.79x for head dim 64 (K 16, G 1: 12.6 MiB estimated, 16.1 MiB needed on v5e,
and the 16 MiB limit it asked for did not compile). Blocks past the table's, given as
overrides, can need more than this counts: bq 128 x 32 pages x 2 (R 512, bkv 1024) needs 27.1
MiB on v5e and 28.6 on v5p but 40.0 on v6e, over the 34 MiB asked for (estimate 26.8); R 2048 x
bkv 2048 needs 164 MiB (estimate 121), refused by the 48 MiB ceiling anyway.
The kernel asks Mosaic for that sum plus 25% headroom (vmem_limit_bytes), at least the XLA
default scoped limit, and refuses a shape whose need exceeds the smallest VMEM of the
generations it targets, naming the numbers.

Limits: jax._src.pallas.mosaic.tpu_info (VMEM, SMEM per core) and XLA's default scoped VMEM
limit (--xla_tpu_scoped_vmem_limit_kib) per generation; HBM bandwidth from Cloud TPU specs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels import kv_cache

MiB = 1 << 20
_LANES = 128


@dataclass(frozen=True)
class TpuLimits:
    vmem_bytes: int  # VMEM per TensorCore
    scoped_default_bytes: int  # XLA's default scoped VMEM limit (what a kernel gets unasked)
    smem_bytes: int  # SMEM per TensorCore
    hbm_Bps: float  # HBM bandwidth per chip, bytes/s


LIMITS = {
    "v5e": TpuLimits(128 * MiB, 16 * MiB, 1 * MiB, 819e9),
    "v6e": TpuLimits(128 * MiB, 32 * MiB, 1 * MiB, 1640e9),
    "v5p": TpuLimits(64 * MiB, 16 * MiB, 1 * MiB, 2765e9),
}
# What a kernel compiled without knowing its chip may ask for: the smallest VMEM above.
MAX_VMEM_LIMIT = min(lim.vmem_bytes for lim in LIMITS.values()) * 3 // 4
MIN_SMEM = min(lim.smem_bytes for lim in LIMITS.values())


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _sublanes(itemsize: int) -> int:
    return 8 * 4 // itemsize  # rows per (sublane, lane) tile: 8 fp32, 16 bf16, 32 int8


@dataclass(frozen=True)
class AttentionBudget:
    smem_bytes: int
    vmem_bytes: int  # estimated need per grid step
    vmem_limit_bytes: int  # what the kernel asks Mosaic for
    kv_bytes_per_step: int  # HBM bytes of K/V (and scales) one KV block brings in

    def fits(self, gen: str) -> bool:
        lim = LIMITS[gen]
        return self.smem_bytes <= lim.smem_bytes and self.vmem_limit_bytes <= lim.vmem_bytes


def attention_budget(*, num_kv_heads: int, q_per_kv: int, head_dim: int, page_size: int, q_bytes: int,
                     kv_bytes: int, quantized: bool, bq: int, nb: int, num_seqs: int, pages_per_seq: int,
                     num_tokens: int) -> AttentionBudget:
    """The kernel's SMEM and VMEM for one configuration (see the module docstring)."""
    K, G, H = num_kv_heads, q_per_kv, head_dim
    R = bq * G
    bkv = nb * page_size
    n_blocks = -(-num_tokens // bq)
    smem = 4 * (1 + 3 * num_seqs + 2 * n_blocks + num_seqs * pages_per_seq)
    page_rows = _round_up(page_size, _sublanes(kv_bytes))
    Hl = _round_up(H, _LANES)  # a head as a block's last dimension: 64 pads to 128 lanes
    io = 2 * 2 * K * R * Hl * q_bytes
    kv = 2 * 2 * nb * page_rows * _round_up(K * H, _LANES) * kv_bytes
    scales = 2 * 2 * nb * _round_up(K, 16) * _round_up(page_size, _LANES) * 2 if quantized else 0
    state = 2 * K * R * _LANES * 4 + K * R * Hl * 4
    values = 4 * R * bkv * 4 + 3 * bkv * Hl * q_bytes
    if quantized:
        values += 2 * bkv * Hl * 4 + 2 * nb * _round_up(page_size, 8) * _round_up(K, _LANES) * 4
    need = io + kv + scales + state + values
    limit = max(_round_up(need * 5 // 4, MiB), 16 * MiB)
    # int8: each page brings its whole lane-dense scale row (kv_cache.scale_shape: g pages of
    # padded heads in 128 lanes), g times the page's own scales at pages under 128 tokens.
    scale_row = _round_up(page_size, _LANES) * kv_cache.padded_scale_heads(K) * 2
    kv_step = 2 * nb * page_size * K * H * kv_bytes + (2 * nb * scale_row if quantized else 0)
    return AttentionBudget(smem, need, limit, kv_step)


def check_attention_budget(budget: AttentionBudget) -> None:
    """Start-up refusal of a configuration no targeted TPU can hold, naming the numbers."""
    if budget.smem_bytes > MIN_SMEM:
        raise ValueError(f"TPU ragged paged attention: {budget.smem_bytes} bytes of SMEM metadata (block tables: "
                         f"max_num_seqs x pages per sequence x 4 bytes, plus 12 bytes a sequence) exceed "
                         f"{MIN_SMEM} bytes of SMEM; lower max_num_seqs or max_model_len, or raise page_size")
    if budget.vmem_limit_bytes > MAX_VMEM_LIMIT:
        raise ValueError(f"TPU ragged paged attention: a grid step needs ~{budget.vmem_bytes} bytes of VMEM "
                         f"(limit {budget.vmem_limit_bytes} with headroom) over the {MAX_VMEM_LIMIT} allowed; "
                         f"use smaller q_block / kv_pages_per_block")
