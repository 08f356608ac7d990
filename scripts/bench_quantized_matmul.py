"""Quantized matmul speed against bf16, as a fraction of this device's copy bandwidth.

For x [M, K] bf16 times W [K -> N] (default 4096 -> 14336, a Llama MLP projection) at M = 1 .. 64:
bf16 (jnp.dot), int8 per channel, int8 g128 and int4 g128 through the seam (impl "auto":
pallas_gpu on a GPU, pallas_tpu on a TPU, xla on CPU). Each quantized result is first checked
against the reference on the device (the kernels have only run in interpret mode before), then
timed. Bytes per call = weights + scales (+ zeros) + x + y; the copy bandwidth is measured in
the same run (a jitted elementwise pass over 1 GiB: read + write).

  python scripts/bench_quantized_matmul.py [--k 4096] [--n 14336] [--m 1,2,4,8,16,32,64]

One JSON line per (format, M), then RESULT {summary}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.quantized_matmul.reference import ref_quantized_matmul  # noqa: E402
from sharding.quantized_matmul import check_quant_impl, quantized_matmul  # noqa: E402


def timed(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    a = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    return 2 * a.nbytes / timed(f, a, repeats=5)


def operands(N, K, bits, G, seed=0):
    rng = np.random.default_rng(seed)
    if bits == 8:
        q = jnp.asarray(rng.integers(-127, 128, (N, K), dtype=np.int8))
        z = None
    else:
        q = jnp.asarray(rng.integers(0, 256, (N, K // 2), dtype=np.uint8))
        z = jnp.asarray(rng.standard_normal((N, K // G)) * 0.01, jnp.float16)
    s = jnp.asarray(rng.random((N, K // G)) * 1e-3 + 1e-4, jnp.float16 if G < K else jnp.float32)
    return q, s, z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    K, N = args.k, args.n
    impl = check_quant_impl(args.impl)
    bw = copy_bandwidth()
    rng = np.random.default_rng(1)
    w_bf16 = jnp.asarray(rng.standard_normal((K, N)) * 0.02, jnp.bfloat16)
    formats = {"int8/channel": (8, K), "int8/g128": (8, 128), "int4/g128": (4, 128)}
    weights = {name: operands(N, K, bits, G) for name, (bits, G) in formats.items()}
    rows, summary = [], {"device": str(jax.devices()[0]), "impl": impl, "K": K, "N": N,
                         "copy_bandwidth_gb_s": round(bw / 1e9, 1)}
    for M in (int(m) for m in args.m.split(",")):
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        t = timed(jax.jit(lambda x, w: x @ w), x, w_bf16, repeats=args.repeats)
        nbytes = w_bf16.nbytes + x.nbytes + M * N * 2
        rows.append(dict(format="bf16", M=M, us=round(t * 1e6, 1), gb_s=round(nbytes / t / 1e9, 1),
                         fraction_of_copy_bw=round(nbytes / t / bw, 3)))
        bf16_t = t
        for name, (bits, G) in formats.items():
            q, s, z = weights[name]
            f = jax.jit(lambda x, q, s, z, bits=bits, G=G: quantized_matmul(
                x, q, s, z, bits=bits, group_size=G, impl=impl))
            y = f(x, q, s, z)
            ref = ref_quantized_matmul(x, q, s, z, bits=bits, group_size=G)
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32)))
                        / jnp.max(jnp.abs(ref.astype(jnp.float32))))
            t = timed(f, x, q, s, z, repeats=args.repeats)
            nbytes = sum(a.nbytes for a in (q, s, z) if a is not None) + x.nbytes + M * N * 2
            rows.append(dict(format=name, M=M, us=round(t * 1e6, 1), gb_s=round(nbytes / t / 1e9, 1),
                             fraction_of_copy_bw=round(nbytes / t / bw, 3),
                             speedup_vs_bf16=round(bf16_t / t, 2), max_rel_err=float(f"{err:.2e}")))
        for r in rows[-1 - len(formats):]:
            print(json.dumps(r), flush=True)
    summary["rows"] = rows
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
