"""Block sizes of the ragged paged attention kernels, as data.

Rows are matched first to last; the first whose every given key matches wins, so put specific
rows above general ones. Keys: `max_tokens` (the step's token bucket T is at most this),
`page_size`, `head_dim`. Values:

  TPU  q_rows     query rows per grid step = tokens per block x query heads per KV head;
                  rounded to whole tokens and to the sublane tiling (16) by the kernel
       kv_tokens  keys per inner step = whole pages (rounded up to at least one page)
  GPU  kv_tokens  keys per inner step, a multiple of 64 (WGMMA N); a block is whole pages, or
                  a part of one page when pages are larger (GPU_KV_BLOCK, keyed by `kv_dtype`
                  and `head_dim`: SMEM holds two slots of K and V in the cache dtype, plus one
                  converted slot when the cache is not in the MMA dtype)
       kv_splits  programs sharing one (sequence, query tile, KV head)'s keys (flash-decoding
                  split-K), merged outside the kernel (GPU_SPLITS, keyed by `max_tokens`)
  The GPU query tile is fixed by the hardware: 64 rows = 64 // G tokens x G heads.

These are first guesses, not measurements: no TPU or GPU was at hand when they were written.
scripts/bench_attention.py is the place to tune them; change the numbers here, not the code.
"""

from __future__ import annotations

TPU_TABLE: tuple[dict, ...] = (
    # Decode-heavy small steps: few query rows per block, so a block spans few sequences
    # (every sequence in a block multiplies its keys against all the block's rows).
    dict(max_tokens=64, q_rows=32, kv_tokens=512),
    dict(max_tokens=512, q_rows=128, kv_tokens=512),
    dict(q_rows=256, kv_tokens=512),
)

GPU_KV_BLOCK: tuple[dict, ...] = (
    # fp32 pages are converted in SMEM: 2 x 2 x 128 x 128 x 4 B would not fit beside the rest.
    dict(kv_dtype="float32", head_dim=128, kv_tokens=64),
    # int8 pages at head_dim 128: with 128-key blocks ptxas for sm_90a gives the kernel 255
    # registers and spills 32 bytes a thread (the int8 -> bf16 conversion of a [128, 128] tile
    # lives in registers beside S); 64-key blocks take 248 and spill nothing (jaxserve compile
    # / scripts/accelerator_check.py --compile-for cuda:h200x1, Llama-3-8B shapes). Not timed.
    dict(kv_dtype="int8", head_dim=128, kv_tokens=64),
    dict(kv_tokens=128),
)

GPU_SPLITS: tuple[dict, ...] = (
    # Few tokens means few programs: split each sequence's keys so all SMs have work.
    dict(max_tokens=16, kv_splits=4),
    dict(max_tokens=128, kv_splits=2),
    dict(kv_splits=1),
)


_MATCH_KEYS = ("page_size", "head_dim", "kv_dtype")


def lookup(table: tuple[dict, ...], **key) -> dict:
    """The first row of `table` whose keys all match `key` (max_tokens as an upper bound)."""
    for row in table:
        ok = True
        for name, want in row.items():
            if name == "max_tokens":
                ok &= key["tokens"] <= want
            elif name in _MATCH_KEYS:
                ok &= key.get(name) == want
        if ok:
            return row
    raise ValueError(f"no block-size row matches {key}")
