"""Quantized MoE experts: ways to run the grouped matmul over int8 / int4 experts, timed and
their compiled temporaries measured (the numbers behind pallas_kernels/grouped_matmul/xla.py).

For lhs [M, K] fp32 rows sorted by expert, E experts [K -> N] (default 8 x 1024 -> 2816):
  dequant+ragged_dot   every expert dequantized to fp32, then jax.lax.ragged_dot (the path
                       before the quantized grouped matmul)
  ragged_dot(int)      ragged_dot on the int8 codes converted to fp32, the per-channel scale
                       applied to each output row by its expert (int8 per channel only)
  all experts (xla.py) the XLA path's decode form: every expert's cached row chunks, all rows
  work list (xla.py)   the XLA path's prefill form: (row tile, expert) visits, tile 64
  (xla.py picks the first up to ALL_EXPERTS_MAX_ROWS rows, the second above)
  float ragged_dot     float experts (no quantization), for scale
Each result is checked against ref_quantized_grouped_matmul first.

  python scripts/bench_quantized_experts.py [--bits 8] [--group-size 64] [--m 16,64,256,1024]

One JSON line per (path, M), with the load average, since timings on a shared machine are
inflated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.grouped_matmul.reference import ref_quantized_grouped_matmul  # noqa: E402
from pallas_kernels.grouped_matmul import xla as gmm_xla  # noqa: E402
from pallas_kernels.quantized_matmul.reference import dequantize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=2816)
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8)
    ap.add_argument("--group-size", type=int, default=64, help="0: int8 per channel")
    ap.add_argument("--m", default="16,64,256,1024", help="rows (tokens x top_k), comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    E, K, N, bits = a.experts, a.k, a.n, a.bits
    gs = a.group_size or K
    rng = np.random.default_rng(0)
    if bits == 8:
        q, zero = jnp.asarray(rng.integers(-127, 128, (E, N, K)), jnp.int8), None
    else:
        q = jnp.asarray(rng.integers(0, 256, (E, N, K // 2)), jnp.uint8)
        zero = jnp.asarray(rng.normal(size=(E, N, K // gs)) * 0.01, jnp.float16)
    scale = jnp.asarray(rng.random((E, N, K // gs)) * 0.01, jnp.float16)
    w_float = jnp.swapaxes(dequantize(q, scale, zero, bits=bits, group_size=gs), 1, 2)

    def dequant_ragged(x, sizes, q, scale, zero, w_float):
        w = jnp.swapaxes(dequantize(q, scale, zero, bits=bits, group_size=gs), 1, 2)
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)

    def ragged_int(x, sizes, q, scale, zero, w_float):
        y = jax.lax.ragged_dot(x, jnp.swapaxes(q.astype(jnp.float32), 1, 2), sizes, preferred_element_type=jnp.float32)
        e = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=x.shape[0])
        return y * scale[e, :, 0].astype(jnp.float32)

    def all_experts(x, sizes, q, scale, zero, w_float):
        return gmm_xla.all_experts_form(x, q, scale, zero, sizes, bits=bits, group_size=gs)

    def work_list(x, sizes, q, scale, zero, w_float):
        return gmm_xla.work_list_form(x, q, scale, zero, sizes, bits=bits, group_size=gs, tm=gmm_xla.WORK_LIST_TILE)

    def float_ragged(x, sizes, q, scale, zero, w_float):
        return jax.lax.ragged_dot(x, w_float, sizes, preferred_element_type=jnp.float32)

    paths = {"dequant+ragged_dot": dequant_ragged, "all experts (xla.py)": all_experts,
             "work list (xla.py)": work_list, "float ragged_dot": float_ragged}
    if bits == 8 and gs == K:
        paths["ragged_dot(int)"] = ragged_int
    for m in (int(v) for v in a.m.split(",")):
        x = jnp.asarray(rng.normal(size=(m, K)), jnp.float32)
        sizes = jnp.asarray(rng.multinomial(m, np.ones(E) / E), jnp.int32)
        ref = ref_quantized_grouped_matmul(x, q, scale, zero, sizes, bits=bits, group_size=gs, out_dtype=jnp.float32)
        for name, fn in paths.items():
            # Weights are arguments, not constants XLA could fold at compile time.
            args = (x, sizes, q, scale, zero, w_float if fn is float_ragged else None)
            c = jax.jit(fn).lower(*args).compile()
            out = jax.block_until_ready(c(*args))
            err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
            ts = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(c(*args))
                ts.append(time.perf_counter() - t0)
            print(json.dumps(dict(path=name, bits=bits, group_size=gs, m=m, experts=E, k=K, n=N,
                                  best_ms=round(min(ts) * 1e3, 2), median_ms=round(float(np.median(ts)) * 1e3, 2),
                                  temp_mib=round(c.memory_analysis().temp_size_in_bytes / 2**20, 1),
                                  rel_err=float(f"{err:.1e}"), load=[round(v, 1) for v in os.getloadavg()])),
                  flush=True)


if __name__ == "__main__":
    main()
