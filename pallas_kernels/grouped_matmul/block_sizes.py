"""Block sizes of the TPU grouped matmul, as data.

Rows are matched first to last; the first whose `max_m` (rows of lhs, M, at most this; absent:
any M) matches wins. tm: rows per tile (rounded to the sublane tiling, capped at M rounded up);
tn: output columns per tile (a multiple of 128, or all of N when N is smaller); tk: inputs per
tile (the largest divisor of K up to this that is a multiple of 128; all of K if none is).

Each row tile is visited once per group it overlaps, so a smaller tm wastes less work on the
rows masked out at group boundaries (up to G - 1 extra tile visits) but reuses each rhs tile
over fewer rows. First guesses, not measurements: no TPU was at hand when they were written.
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
