"""Isolation benchmark of the native small-M fp32 matmul: packed W ([N/64, K, 64]) vs unpacked
([K, N]) vs XLA's dot, SmolLM2-135M's projection shapes, M = 1 .. 48 rows.

Each timed call runs a chain of C products against C distinct W copies (C x K x N x 4 bytes >=
--mbytes, twice the 32 MB L3 by default), so W comes from DRAM as in a decode step over the
model's 540 MB of weights, not from cache; product i's input depends on product i-1's output
(x + 0 * y[:, :1]) so XLA runs them in order as a layer loop would. The three impls are timed
interleaved (one call of each per round), medians over --rounds; GB/s = bytes of W read / time.
Machine load moves these figures 20-50%: read the columns of one row against each other.

  PYTHONPATH=$PWD python scripts/bench_small_matmul.py [--rows 1,4,8,24,48] [--rounds 9]
      [--shapes 576x1536,576x49152] [--hot]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.small_matmul import cpu_native as native

SHAPES = "576x1536,1536x576,576x576,576x192"  # up/gate, down, q/o, k/v (the LM head: 576x49152)


def chain(mm):
    def f(x, ws):
        out = None
        for w in ws:
            xi = x if out is None else x + 0.0 * out[:, :1]
            out = mm(xi, w)
        return out
    return jax.jit(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,24,48")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mbytes", type=float, default=64.0)
    ap.add_argument("--hot", action="store_true", help="one W copy (cache-resident) instead of DRAM")
    ap.add_argument("--shapes", default=SHAPES, help="K x N of each product, comma-separated")
    a = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}; {'hot (one W)' if a.hot else f'cold (>= {a.mbytes:g} MB of W a call)'}")
    print(f"{'K x N':>11} {'M':>3} | {'ms/product  xla  unpacked  packed':>34} | {'GB/s  xla  unpacked  packed':>28}")
    rng = np.random.default_rng(0)
    for k, n in (tuple(int(d) for d in shape.split("x")) for shape in a.shapes.split(",")):
        nbytes = k * n * 4
        copies = 8 if a.hot else max(2, int(np.ceil(a.mbytes * 1e6 / nbytes)))
        base = [jnp.asarray(rng.standard_normal((k, n), np.float32)) for _ in range(1 if a.hot else copies)]
        ws = [base[i % len(base)] for i in range(copies)]
        wps = [native.pack(w) for w in base]
        wps = [wps[i % len(wps)] for i in range(copies)]
        impls = {
            "xla": (chain(lambda x, w: jnp.dot(x, w)), ws),
            "unpacked": (chain(native.small_matmul_cpu), ws),
            "packed": (chain(lambda x, w: native.small_matmul_packed_cpu(x, w, n)), wps),
        }
        for m in (int(r) for r in a.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            ref = None
            for name, (f, w) in impls.items():  # compile, and check agreement once
                y = np.asarray(f(x, w))
                ref = y if ref is None else ref
                assert np.allclose(y, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max()), name
            times = {name: [] for name in impls}
            for _ in range(a.rounds):
                for name, (f, w) in impls.items():
                    t0 = time.perf_counter()
                    f(x, w).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) / copies for name, t in times.items()}
            ms = "  ".join(f"{med[nm] * 1e3:8.4f}" for nm in impls)
            gbs = "  ".join(f"{nbytes / med[nm] / 1e9:6.1f}" for nm in impls)
            print(f"{k:>5}x{n:<5} {m:>3} | {ms:>34} | {gbs:>28}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
