"""Benchmark decode attention over the paged KV cache: a Pallas kernel against the XLA reference.

Default shape (issue 4's target): batch 64 decode tokens, context 2048 each, 64 query heads on
8 KV heads (GQA 8:1), head dim 128, bf16, pages of 16 tokens scattered at random over the pool.
Reports the kernel's time, the bytes it must read (every key and value of every sequence once,
scales included for int8), the achieved bandwidth as a fraction of the device's copy bandwidth
(measured here with a large device-to-device copy, or --copy-bw), the XLA reference's time,
and the largest difference between the two outputs.

  python scripts/bench_attention.py                    # on a GPU (pallas_gpu) or TPU (pallas_tpu)
  python scripts/bench_attention.py --kv-cache-dtype int8 --page-size 64
  python scripts/bench_attention.py --small            # CPU smoke run: tiny shapes, interpret mode

Goal on an H200: >= 70% of copy bandwidth and >= 2x the XLA path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import kv_cache  # noqa: E402
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention  # noqa: E402
from sharding import ops  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-per-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    p.add_argument("--impl", default="auto", help=f"one of {ops.ATTENTION_IMPLS} or auto")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--copy-bw", type=float, default=None,
                   help="device copy bandwidth in bytes/s (default: measured; 4.3e12 on an H200)")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes and a kernel in interpret mode: a CPU smoke run")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    a = p.parse_args(argv)
    if a.small:
        a.batch, a.context, a.kv_heads, a.q_per_kv, a.head_dim, a.iters = 4, 80, 2, 2, 64, 1
        if a.kv_cache_dtype == "int8":
            a.page_size = 64  # the GPU kernel's smallest int8 page
        if a.impl == "auto" and jax.default_backend() == "cpu":
            a.impl = "pallas_gpu_interpret"
    return a


def build(a):
    """Caches with every sequence's `context` keys on randomly scattered pages, and one decode
    token per sequence at position context - 1."""
    dtype = jnp.dtype(a.dtype)
    K, G, H, ps = a.kv_heads, a.q_per_kv, a.head_dim, a.page_size
    pages_per_seq = -(-a.context // ps)
    num_pages = a.batch * pages_per_seq + 1  # + the null page
    shape = (1, num_pages, ps, K, H)
    kk, kv, kq = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    if a.kv_cache_dtype == "int8":
        (k8, ks), (v8, vs) = kv_cache.quantize(k), kv_cache.quantize(v)
        k = kv_cache.QuantizedKV(k8, jnp.swapaxes(ks, -1, -2))
        v = kv_cache.QuantizedKV(v8, jnp.swapaxes(vs, -1, -2))
    perm = np.random.default_rng(0).permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = jnp.asarray(perm.reshape(a.batch, pages_per_seq))
    q = jax.random.normal(kq, (a.batch, K * G, H), dtype)
    positions = jnp.full((a.batch,), a.context - 1, jnp.int32)
    token_seq = jnp.arange(a.batch, dtype=jnp.int32)
    return q, k, v, jnp.int32(0), positions, token_seq, tables


def kv_bytes(a) -> int:
    """Bytes of K and V the step must read: each sequence's context, all KV heads."""
    per = kv_cache.bytes_per_token_head(a.head_dim, "int8" if a.kv_cache_dtype == "int8" else jnp.dtype(a.dtype))
    return 2 * a.batch * a.context * a.kv_heads * per


def timed(f, args, iters) -> float:
    """Median seconds of `iters` calls after one warm-up (compile) call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def copy_bandwidth(iters: int) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of a 1 GiB buffer."""
    n = (1 << 30) // 4 if jax.default_backend() != "cpu" else (1 << 24) // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda x: x + 1)  # one read and one write of every element
    return 2 * x.nbytes / timed(f, (x,), max(iters, 3))


def main(argv=None) -> dict:
    a = parse_args(argv)
    impl = ops.check_impl(a.impl, num_heads=a.kv_heads * a.q_per_kv, num_kv_heads=a.kv_heads,
                          head_dim=a.head_dim, page_size=a.page_size, q_dtype=jnp.dtype(a.dtype),
                          kv_dtype="int8" if a.kv_cache_dtype == "int8" else jnp.dtype(a.dtype))
    args = build(a)
    kernel = jax.jit(lambda *x: ops.paged_attention(*x, impl=impl))
    chunk = 16 if (a.context // a.page_size) % 16 == 0 else 1
    ref = jax.jit(lambda *x: ref_ragged_paged_attention(*x, kv_chunk_pages=chunk))
    t_kernel = timed(kernel, args, a.iters)
    t_ref = timed(ref, args, a.iters)
    diff = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - ref(*args).astype(jnp.float32))))
    bw_copy = a.copy_bw or copy_bandwidth(a.iters)
    nbytes = kv_bytes(a)
    out = dict(device=str(jax.devices()[0].device_kind), impl=impl, batch=a.batch, context=a.context,
               kv_heads=a.kv_heads, q_per_kv=a.q_per_kv, head_dim=a.head_dim, page_size=a.page_size,
               dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, kernel_ms=t_kernel * 1e3,
               xla_ms=t_ref * 1e3, speedup_vs_xla=t_ref / t_kernel, kv_bytes=nbytes,
               kernel_bw_gbs=nbytes / t_kernel / 1e9, copy_bw_gbs=bw_copy / 1e9,
               fraction_of_copy_bw=nbytes / t_kernel / bw_copy, max_abs_diff=diff)
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{out['device']}  {impl}  batch {a.batch} x context {a.context}, {a.kv_heads * a.q_per_kv}:"
              f"{a.kv_heads} heads, head dim {a.head_dim}, page {a.page_size}, {a.dtype} / KV {a.kv_cache_dtype}")
        print(f"  kernel   {out['kernel_ms']:9.3f} ms   {out['kernel_bw_gbs']:8.1f} GB/s = "
              f"{100 * out['fraction_of_copy_bw']:.1f}% of copy bandwidth ({out['copy_bw_gbs']:.0f} GB/s)")
        print(f"  XLA ref  {out['xla_ms']:9.3f} ms   kernel speed-up {out['speedup_vs_xla']:.2f}x")
        print(f"  max |kernel - ref| = {diff:.3g}")
    return out


if __name__ == "__main__":
    main()
