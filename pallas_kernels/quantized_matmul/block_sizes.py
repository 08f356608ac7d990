"""Block sizes of the quantized matmul kernels, as data.

Rows are matched first to last; the first whose every given key matches wins. Keys:
`max_m` (rows of x, M, at most this), `bits`. Values:

  TPU  bm  rows of x per block (rounded up to the sublane tiling, capped at M rounded up)
       bn  output columns per block (a multiple of 128, or all of N when N is smaller)
       bk  inputs per block (the largest divisor of K up to this that is a multiple of the
           group size and whose weight block is whole 128-lane rows; all of K if none is);
           "K": all of K, with bn the widest that keeps the weight block within 4 MiB
  GPU  bm, bn  powers of two, at least 16 (Triton's dot); the K loop steps one group (or,
               per channel, the largest power of two up to 128 dividing K) at a time

Decode (small M) is bandwidth-bound: wide bn and deep bk make each weight block one long DMA.
Prefill (large M) is compute-bound: square-ish blocks reuse each weight block over many rows.
These are first guesses, not measurements: no TPU or GPU was at hand when they were written.
scripts/bench_quantized_matmul.py is the place to tune them; change the numbers here.
"""

from __future__ import annotations

TPU_TABLE: tuple[dict, ...] = (
    # Decode: bk = all of K, bn up to 2048 within a 4 MiB weight block (tpu.choose_blocks):
    # ~16 grid steps for 4096 -> 14336 where (16, 512, 1024) blocks made 112.
    dict(max_m=64, bm=64, bn=2048, bk="K"),
    dict(bm=256, bn=256, bk=512),
)

GPU_TABLE: tuple[dict, ...] = (
    dict(max_m=16, bm=16, bn=64),
    dict(max_m=64, bm=64, bn=64),
    dict(bm=64, bn=128),
)


def lookup(table: tuple[dict, ...], *, m: int, bits: int) -> dict:
    """The first row of `table` matching M = m rows and `bits`, without its keys."""
    for row in table:
        if row.get("max_m", m) >= m and row.get("bits", bits) == bits:
            return {k: v for k, v in row.items() if k not in ("max_m", "bits")}
    raise ValueError(f"no block-size row matches m={m}, bits={bits}")
