"""Isolation benchmark of the native small-M fp32 matmul: packed W ([N/64, K, 64]) vs unpacked
([K, N]) vs XLA's dot, SmolLM2-135M's projection shapes, M = 1 .. 48 rows.

Each timed call runs a chain of up to 16 products against distinct W copies, the next 16 of a
pool of them (--mbytes of W, by default twice this machine's L3 as sysfs gives it, at least 64
MB), so W comes from DRAM as in a decode step over the model's 540 MB of weights, not from cache
(a fixed 64 MB measured L3 on a 480 MB-L3 Xeon: XLA's dot 31 GB/s at one row, 22 from DRAM);
product i's input depends on product i-1's output (x + 0 * y[:, :1]) so XLA runs them in order
as a layer loop would. The three impls are timed interleaved (one call of each per round),
medians over --rounds; GB/s = bytes of W read / time.
Machine load moves these figures 20-50%: read the columns of one row against each other.

  PYTHONPATH=$PWD python scripts/bench_small_matmul.py [--rows 1,4,8,24,48] [--rounds 9]
      [--shapes 576x1536,576x49152] [--hot]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

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


def l3_mbytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> float | None:
    """This machine's L3 in MB (10^6 bytes; sysfs, cpu0), or None where sysfs does not say."""
    for index in sorted(cache_dir.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()  # "491520K", "32M"
                return float(size[:-1]) * {"K": 1e-3 * 1.024, "M": 1.048576, "G": 1073.741824}[size[-1]]
        except (OSError, ValueError, KeyError):
            return None
    return None


CHAIN = 16  # products a timed call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,24,48")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mbytes", type=float, default=None,
                    help="MB of W copies to cycle through (default: twice the L3, at least 64)")
    ap.add_argument("--hot", action="store_true", help="one W copy (cache-resident) instead of DRAM")
    ap.add_argument("--shapes", default=SHAPES, help="K x N of each product, comma-separated")
    a = ap.parse_args()
    if a.mbytes is None:
        l3 = l3_mbytes()
        a.mbytes = max(64.0, 2 * l3) if l3 else 64.0
        print(f"L3 {f'{l3:.0f} MB' if l3 else 'unknown'}: cycling through {a.mbytes:.0f} MB of W copies")
    print(f"load {os.getloadavg()[0]:.2f}; {'hot (one W)' if a.hot else f'cold (a pool of >= {a.mbytes:.0f} MB of W)'}")
    print(f"{'K x N':>11} {'M':>3} | {'ms/product  xla  unpacked  packed':>34} | {'GB/s  xla  unpacked  packed':>28}")
    rng = np.random.default_rng(0)
    for k, n in (tuple(int(d) for d in shape.split("x")) for shape in a.shapes.split(",")):
        nbytes = k * n * 4
        pool = 8 if a.hot else max(2, int(np.ceil(a.mbytes * 1e6 / nbytes)))
        copies = min(pool, CHAIN)
        # One random W and distinct copies of it (w0 + 0 * i: a buffer each): what defeats the
        # cache is the number of buffers, not their contents.
        w0 = jnp.asarray(rng.standard_normal((k, n), np.float32))
        base = [w0 + 0.0 * i for i in range(1 if a.hot else pool)]
        ws = [base[i % len(base)] for i in range(pool)]
        wps = [native.pack(w) for w in base]
        wps = [wps[i % len(wps)] for i in range(pool)]
        calls = itertools.count()

        def next_chain(w):  # the next `copies` of the pool, wrapping: untouched for pool / copies calls
            start = next(calls) * copies % pool
            return [w[(start + i) % pool] for i in range(copies)]
        impls = {
            "xla": (chain(lambda x, w: jnp.dot(x, w)), ws),
            "unpacked": (chain(native.small_matmul_cpu), ws),
            "packed": (chain(lambda x, w: native.small_matmul_packed_cpu(x, w, n)), wps),
        }
        for m in (int(r) for r in a.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            ref = None
            for name, (f, w) in impls.items():  # compile, and check agreement once
                y = np.asarray(f(x, w[:copies]))
                ref = y if ref is None else ref
                assert np.allclose(y, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max()), name
            times = {name: [] for name in impls}
            for _ in range(a.rounds):
                for name, (f, w) in impls.items():
                    chain_w = next_chain(w)
                    t0 = time.perf_counter()
                    f(x, chain_w).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) / copies for name, t in times.items()}
            ms = "  ".join(f"{med[nm] * 1e3:8.4f}" for nm in impls)
            gbs = "  ".join(f"{nbytes / med[nm] / 1e9:6.1f}" for nm in impls)
            print(f"{k:>5}x{n:<5} {m:>3} | {ms:>34} | {gbs:>28}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
