"""Block sizes of the TPU grouped matmuls (tpu.py, and tpu_quantized.py over int8 / int4
experts), as data.

Rows are matched first to last; the first whose `max_m` (rows of lhs, M, at most this; absent:
any M) matches wins. tm: rows per tile (rounded to the sublane tiling, capped at M rounded up);
tn: output columns per tile (a multiple of 128, or all of N when N is smaller); tk: inputs per
tile (the largest divisor of K up to this that is a multiple of 128; all of K if none is; the
quantized kernel also wants a multiple of the quantization group whose int4 block is whole
128-lane rows, tpu_quantized.choose_quantized_blocks).

How the numbers were chosen (reasoning, not measurement: no TPU was at hand, so none of this
is timed; scripts/accelerator_check.py is where a TPU run would tune them):

- What a tile costs. The kernel visits each row tile once per expert it overlaps (tpu.py's
  work list: at most m_tiles + G - 1 visits) and every visit fetches that expert's [tk, tn]
  weight block. So the weights stream once per (visit, N tile): for M rows and G experts,
  about (M / tm + G) weight blocks per N tile against the ideal G. A larger tm re-fetches each
  expert's weights for fewer tiles; a smaller tm wastes less work on the rows another expert
  owns (a boundary tile computes all tm rows and keeps some: up to (G - 1) * tm extra rows).
- Decode (M = batch x top_k, at most ~256 rows): the step reads every routed expert's weights
  and is bandwidth-bound, so the aim is few, large weight DMAs: tn 512 x tk 1024 (1 MiB of bf16
  weight per block, 512 KiB int8) and tm 64, which keeps the boundary waste small when a
  handful of rows reach each of 8 experts while M / tm + G stays close to G.
- Prefill: compute-bound, so tm 128 rows reuse each fetched weight block 128 times (a v5e MXU
  pass is 128 x 128; v6e's 256 x 256 would want tm 256 once measured), with tn 256 x tk 512
  keeping the block square-ish.
- VMEM: double-buffered lhs and weight blocks, the output block and the fp32 accumulator. The
  decode row in bf16 is 2 x (64 x 1024 + 1024 x 512) x 2 B + 2 x 64 x 512 x 2 B + 64 x 512 x 4 B
  = 2.5 MiB, the prefill row 1.0 MiB (int8 weights: less; the quantized kernel adds its
  experts' [K/gs, tn] fp32 scale rows); both far under the 16 MiB the kernels ask for at least
  (vmem_limit_bytes, from the blocks) and v5e's 128 MiB VMEM. Room is left on purpose: a TPU run
  could raise tn / tk for decode before VMEM becomes the limit.
"""

from __future__ import annotations

TPU_TABLE: tuple[dict, ...] = (
    dict(max_m=256, tm=64, tn=512, tk=1024),  # decode: few rows per expert, wide weight tiles
    dict(tm=128, tn=256, tk=512),
)


def lookup(m: int) -> dict:
    for row in TPU_TABLE:
        if row.get("max_m", m) >= m:
            return {k: v for k, v in row.items() if k != "max_m"}
    raise ValueError(f"no grouped-matmul block-size row matches m={m}")
