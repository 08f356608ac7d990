"""One-shot accelerator check (issue 22): does each kernel give the right answer on this
device, and how close does it run to the memory bandwidth? Written for one 10-minute call on
an H200 (python3, jax 0.11 with CUDA); runs on a TPU too (the TPU kernels) and, with --smoke,
on CPU in interpret mode with tiny shapes (a test in the suite runs that).

Records are JSON lines, printed and appended to --out as each result comes, so a run cut
short keeps what it measured. Each case is its own try/except: a failure is a record with the
error, never the end of the run. Cases run in order of importance until --budget-s is spent;
the rest are recorded as skipped.

  env        jax version, backend, device, which Pallas backends import
  bandwidth  read (a reduction) and copy (x + 1) of a large buffer, bytes/s
  attention  at Llama-3-8B shapes (32 q heads, 8 KV heads, head dim 128): decode batch 64 at 4k
             (page 16 and 64, bf16 and int8), batch 256 at 1k, batch 16 at 32k, short ragged
             contexts after filling memory with finite junk, and a mixed step (a 1,024-token
             prefill and 63 decodes). Per case: max error against the reference (pass / fail),
             seconds per call from N calls inside one executable, GB/s and the fraction of the
             read and copy bandwidth; the `xla` path and dense contiguous-KV attention as baselines.
  qmatmul    int8 per channel, int8 g128, int4 g128 at 4096->14336, 14336->4096, 4096->4096,
             4096->1024 for M = 1, 16, 128: the kernel, bf16 x @ W.T and the XLA dequantize path.

  python3 scripts/accelerator_check.py --out results.jsonl      # on the device
  python3 scripts/accelerator_check.py --smoke                  # CPU, seconds

Before a device is lent: `--compile-for cuda:h200x1` (or any `jaxserve compile` topology, e.g.
v6e:1 in .venv-tpu) compiles every kernel case above at its real shapes for that chip on this
CPU machine, with the real compiler, and records per case the verdict, the compile seconds and,
on a GPU, ptxas's figures for each kernel (jaxserve/aot/ptxas_report.py): the cases a lent
device will run are known to compile before its minutes start (run in .venv-gpu / .venv-tpu).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels import kv_cache  # noqa: E402
from pallas_kernels.interpret import FILL_ENV  # noqa: E402
from pallas_kernels.quantized_matmul import reference as qref  # noqa: E402
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention  # noqa: E402
from sharding import ops  # noqa: E402
from sharding import quantized_matmul as qmm  # noqa: E402

# Llama-3-8B attention: 32 query heads on 8 KV heads, head dim 128.
N_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ATTN_TOL = {"bfloat16": 3e-2, "int8": 3e-2}  # bf16 probabilities / values: a few ulps of ~1
KERNEL_IMPL = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}  # the Pallas kernels each platform runs
QMM_TOL = 2e-2  # relative to max |y|: bf16 operands, fp32 sums (tests/test_quantized_matmul.py)


class Recorder:
    def __init__(self, out: Path | None, budget_s: float):
        self.out, self.t0, self.budget_s, self.records = out, time.monotonic(), budget_s, []

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def emit(self, rec: dict) -> dict:
        rec = {"t": round(time.monotonic() - self.t0, 2), **rec}
        line = json.dumps(rec, default=str)
        print(line, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(line + "\n")
        self.records.append(rec)
        return rec

    def case(self, kind: str, name: str, fn, min_left_s: float = 20.0) -> dict:
        """Run one case; its record, an error record, or a skip once the budget is spent."""
        if self.left() < min_left_s:
            return self.emit({"kind": kind, "case": name, "status": "skipped", "why": "time budget"})
        t = time.monotonic()
        try:
            rec = {"kind": kind, "case": name, **fn()}
        except Exception as e:  # one failing case must never lose the others
            rec = {"kind": kind, "case": name, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                   "trace": traceback.format_exc()[-1500:]}
        rec["case_s"] = round(time.monotonic() - t, 2)
        return self.emit(rec)


def looped(fn, n: int):
    """fn(*args) n times inside one executable. Each call's first input is nudged by a value
    computed from the previous output (0 in exact arithmetic, but XLA cannot prove it), so the
    calls are neither merged nor hoisted and no dispatch enters the figure."""
    def run(x, *rest):
        def body(_, carry):
            out = fn(x + carry.astype(x.dtype), *rest)
            return (jnp.ravel(out)[0] * 0).astype(jnp.float32)
        return lax.fori_loop(0, n, body, jnp.float32(0))
    return jax.jit(run)


def seconds_per_call(fn, args, n: int) -> float:
    """Seconds per call of fn from one executable running it n times (compile excluded)."""
    f = looped(fn, n)
    jax.block_until_ready(f(*args))  # compile + warm-up
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    return (time.perf_counter() - t) / n


# ---- environment and bandwidth -------------------------------------------------------------

def environment() -> dict:
    d = jax.devices()[0]
    backends = {}
    for name in ("mosaic_gpu", "triton", "tpu"):
        try:
            __import__(f"jax.experimental.pallas.{name}")
            backends[name] = "ok"
        except Exception as e:  # report, do not fail: the point is to see what this JAX has
            backends[name] = f"{type(e).__name__}: {e}"[:300]
    return {"status": "ok", "jax": jax.__version__, "backend": jax.default_backend(), "device": d.device_kind,
            "devices": jax.device_count(), "compute_capability": getattr(d, "compute_capability", None),
            "python": sys.version.split()[0], "pallas_backends": backends}


def bandwidth(nbytes: int, n: int) -> dict:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    read = seconds_per_call(lambda x: jnp.sum(x), (x,), n)  # reads every byte once
    copy = seconds_per_call(lambda x: x + 1, (x,), n)  # reads and writes every byte
    return {"status": "ok", "bytes": nbytes, "read_Bps": nbytes / read, "copy_Bps": 2 * nbytes / copy}


# ---- attention ---------------------------------------------------------------------------

def attention_case(seqs, page_size: int, kv: str, K: int, G: int, H: int, seed=0):
    """seqs: (context before the step, new tokens) per sequence. Caches hold exactly the pages
    the sequences own, scattered at random, plus the null page; one layer."""
    pages = [-(-(c + n) // page_size) for c, n in seqs]
    width = max(pages)
    num_pages = sum(pages) + 1
    kk, kvk, kq = jax.random.split(jax.random.key(seed), 3)
    shape = (1, num_pages, page_size, K, H)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kvk, shape, jnp.bfloat16)
    if kv == "int8":
        (k8, ks), (v8, vs) = kv_cache.quantize(k), kv_cache.quantize(v)
        k = kv_cache.QuantizedKV(k8, jnp.swapaxes(ks, -1, -2))
        v = kv_cache.QuantizedKV(v8, jnp.swapaxes(vs, -1, -2))
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = np.zeros((len(seqs), width), np.int32)
    positions, token_seq, used = [], [], 0
    for s, ((c, n), p) in enumerate(zip(seqs, pages)):
        tables[s, :p] = perm[used:used + p]
        used += p
        positions += range(c, c + n)
        token_seq += [s] * n
    T = len(positions)
    q = jax.random.normal(kq, (T, K * G, H), jnp.bfloat16)
    return (q, k, v, jnp.int32(0), jnp.asarray(positions, jnp.int32), jnp.asarray(token_seq, jnp.int32),
            jnp.asarray(tables))


def attention_bytes(seqs, K, H, kv: str) -> int:
    """Bytes the step must read: every key and value each sequence sees, once (scales too)."""
    per = kv_cache.bytes_per_token_head(H, "int8" if kv == "int8" else jnp.bfloat16)
    return 2 * sum(c + n for c, n in seqs) * K * per


def dense_decode(q, k, v):
    """Baseline: decode attention over contiguous [B, ctx, K, H] K/V (no pages)."""
    B, N, H = q.shape
    K = k.shape[2]
    s = jnp.einsum("bkgh,btkh->bkgt", q.reshape(B, K, N // K, H), k, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(s / math.sqrt(H), axis=-1).astype(v.dtype)
    return jnp.einsum("bkgt,btkh->bkgh", p, v).reshape(B, N, H)


def table_chunk(args) -> int:
    """Pages per chunk of the xla paths, whose block tables' width must divide by it."""
    return min(16, 1 << (args[-1].shape[1] - 1).bit_length())


def padded_tables(args, chunk: int):
    """`args` with the block tables padded to a multiple of `chunk` with null pages."""
    width = args[-1].shape[1]
    return args[:-1] + (jnp.pad(args[-1], ((0, 0), (0, -width % chunk))),)


def run_attention(name, seqs, ps, kv, impl, bw, n, K, G, H, junk_bytes=0, dense=True) -> dict:
    if junk_bytes:  # fill free device memory with finite junk, then free it for the case's buffers
        junk = jnp.full((junk_bytes // 2,), 7.0, jnp.bfloat16).block_until_ready()
        del junk
    args = attention_case(seqs, ps, kv, K, G, H)
    chunk = table_chunk(args)
    args = padded_tables(args, chunk)
    kernel = functools.partial(ops.paged_attention, impl=impl, kv_chunk_pages=chunk)
    xla = functools.partial(ops.paged_attention, impl="xla", kv_chunk_pages=chunk)
    ref = jax.jit(functools.partial(ref_ragged_paged_attention, kv_chunk_pages=chunk))
    got = np.asarray(jax.jit(kernel)(*args), np.float32)
    want = np.asarray(ref(*args), np.float32)
    err = float(np.max(np.abs(got - want)))
    tol = ATTN_TOL[kv]
    nbytes = attention_bytes(seqs, K, H, kv)
    rec = {"status": "pass" if err <= tol and np.isfinite(got).all() else "fail", "impl": impl,
           "max_err": err, "tol": tol, "bytes": nbytes}
    for label, f in (("kernel", kernel), ("xla", xla)):
        s = seconds_per_call(f, args, n)
        rec[f"{label}_s"] = s
        rec[f"{label}_GBps"] = nbytes / s / 1e9
        if bw:
            rec[f"{label}_frac_read"] = nbytes / s / bw["read_Bps"]
            rec[f"{label}_frac_copy"] = nbytes / s / bw["copy_Bps"]
    if dense and kv == "bfloat16" and all(nt == 1 for _, nt in seqs) and len({c for c, _ in seqs}) == 1:
        B, ctx = len(seqs), seqs[0][0] + 1
        kk, kv_ = jax.random.split(jax.random.key(1))
        kd = jax.random.normal(kk, (B, ctx, K, H), jnp.bfloat16)
        vd = jax.random.normal(kv_, (B, ctx, K, H), jnp.bfloat16)
        s = seconds_per_call(dense_decode, (args[0], kd, vd), n)
        rec["dense_s"], rec["dense_GBps"] = s, nbytes / s / 1e9
    return rec


def attention_cases(smoke: bool):
    """(name, seqs, page size, kv dtype, extra kwargs), most important first."""
    if smoke:  # tiny: the harness, not the figures
        # One case (the interpreted kernel compiles twice, checked and looped: ~10 s a case).
        return [("short_ragged_junk", [(4, 1), (0, 1), (15, 1), (40, 3)], 16, "bfloat16", {"junk_bytes": 1 << 20})]
    rng = np.random.default_rng(0)
    short = [(int(c), 1) for c in rng.integers(0, 40, 64)] + [(int(c), int(n)) for c, n in
                                                               zip(rng.integers(0, 30, 8), rng.integers(2, 9, 8))]
    return [
        ("decode_b64_ctx4k_p16_bf16", [(4095, 1)] * 64, 16, "bfloat16", {}),
        ("short_ragged_after_junk", short, 16, "bfloat16", {"junk_bytes": 32 << 30}),
        ("decode_b64_ctx4k_p64_bf16", [(4095, 1)] * 64, 64, "bfloat16", {}),
        ("decode_b64_ctx4k_p64_int8", [(4095, 1)] * 64, 64, "int8", {}),
        ("mixed_prefill1024_plus_63_decodes", [(0, 1024)] + [(4095, 1)] * 63, 16, "bfloat16", {}),
        ("decode_b256_ctx1k_p16_bf16", [(1023, 1)] * 256, 16, "bfloat16", {}),
        ("decode_b16_ctx32k_p16_bf16", [(32767, 1)] * 16, 16, "bfloat16", {}),
    ]


# ---- quantized matmul ----------------------------------------------------------------------

def qmm_case(M, N, K, bits, G, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    if bits == 8:
        q, z = jnp.asarray(rng.integers(-127, 128, (N, K)), jnp.int8), None
    else:
        q = jnp.asarray(rng.integers(0, 256, (N, K // 2)), jnp.uint8)
        z = jnp.asarray(rng.standard_normal((N, K // G)) * 0.05, jnp.float32)
    s = jnp.asarray(rng.random((N, K // G)) * 0.01 + 1e-3, jnp.float32)
    return x, q, s, z


def qmm_name(M, N, K, bits, G) -> str:
    return f"M{M}_{K}to{N}_int{bits}_g{G if G != K else 'ch'}"


def qmm_kernel(impl: str, bits: int, G: int):
    return lambda x, q, s, z: qmm.resolve(impl)(x, q, s, z, out_dtype=None, bits=bits, group_size=G)


def run_qmm(M, N, K, bits, G, impl, bw, n) -> dict:
    x, q, s, z = qmm_case(M, N, K, bits, G)
    kw = dict(bits=bits, group_size=G)
    kernel = qmm_kernel(impl, bits, G)
    xla = lambda x, q, s, z: qref.xla_quantized_matmul(x, q, s, z, **kw)  # noqa: E731
    w = qref.dequantize(q, s, z, bits=bits, group_size=G).astype(jnp.bfloat16)  # [N, K]
    got = np.asarray(jax.jit(kernel)(x, q, s, z), np.float32)
    want = np.asarray(qref.ref_quantized_matmul(x, q, s, z, **kw), np.float32)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    nbytes = q.nbytes + s.nbytes + (z.nbytes if z is not None else 0) + x.nbytes + M * N * 2
    rec = {"status": "pass" if err <= QMM_TOL else "fail", "impl": impl, "rel_err": err, "tol": QMM_TOL,
           "bytes": nbytes}
    for label, f, a in (("kernel", kernel, (x, q, s, z)), ("xla_dequant", xla, (x, q, s, z)),
                        ("bf16", lambda x, w: x @ w.T, (x, w))):
        t = seconds_per_call(f, a, n)
        rec[f"{label}_s"] = t
        rec[f"{label}_GBps"] = (nbytes if label != "bf16" else w.nbytes + x.nbytes) / t / 1e9
        if bw and label == "kernel":
            rec["kernel_frac_read"] = nbytes / t / bw["read_Bps"]
    return rec


def qmm_cases(smoke: bool):
    if smoke:
        return [(3, 256, 256, 4, 128)]
    shapes = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)]  # (K in, N out)
    quants = [(8, None), (8, 128), (4, 128)]
    return [(M, N, K, bits, G or K) for M in (1, 16, 128) for K, N in shapes for bits, G in quants]


# ---- compile-only, for a chip this machine does not have -------------------------------------


def compile_case(target, dumps, fn, make_args) -> dict:
    """Lower `fn` at the shapes `make_args` would build (nothing is allocated: jax.eval_shape)
    on the target's first device and compile it with the target's compiler."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxserve.aot import ptxas_report
    from sharding import backends
    mesh = Mesh(np.array(target.devices[:1]), ("x",))
    place = NamedSharding(mesh, PartitionSpec())
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place), jax.eval_shape(make_args))
    with backends.targeting(target.platform, target.devices[:1]), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(fn).lower(*shapes)
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile(**({} if dumps is None else {"compiler_options": dumps.compiler_options()}))
        except Exception:
            if dumps is not None:
                dumps.kernels("")  # what the refused compile dumped is not the next case's
            raise
    rec = {"status": "compiled", "compile_s": round(time.perf_counter() - t0, 2),
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
    if dumps is not None:
        rec["ptxas"] = ptxas_report.summarize(dumps.kernels(compiled.as_text()))["kernels"]
    return rec


def compile_main(a, rec: Recorder) -> None:
    import contextlib

    from jaxserve.aot import ptxas_report
    from jaxserve.aot.targets import resolve_target
    target = resolve_target(a.compile_for)
    impl = KERNEL_IMPL[target.platform]
    K, G, H = KV_HEADS, N_HEADS // KV_HEADS, HEAD_DIM
    rec.emit({"kind": "env", "name": "compile_for", "status": "ok", "topology": target.topology,
              "chip": target.chip.name, "jax": jax.__version__})
    with (ptxas_report.dumping() if target.platform == "gpu" else contextlib.nullcontext()) as dumps:
        if a.only in (None, "attention"):
            for name, seqs, ps, kv, _ in attention_cases(False):
                case = functools.partial(attention_case, seqs, ps, kv, K, G, H)
                chunk = table_chunk(jax.eval_shape(case))  # shapes only: nothing is built

                def make(case=case, chunk=chunk):
                    return padded_tables(case(), chunk)
                fn = functools.partial(ops.paged_attention, impl=impl, kv_chunk_pages=chunk)
                rec.case("attention", name, lambda fn=fn, make=make: compile_case(target, dumps, fn, make), 0)
        if a.only in (None, "qmatmul"):
            for M, N, Kd, bits, Gq in qmm_cases(False):
                fn, make = qmm_kernel(impl, bits, Gq), functools.partial(qmm_case, M, N, Kd, bits, Gq)
                rec.case("qmatmul", qmm_name(M, N, Kd, bits, Gq),
                         lambda fn=fn, make=make: compile_case(target, dumps, fn, make), 0)


# ---- main --------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shapes, seconds")
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here as results come")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting cases after this (default 540)")
    p.add_argument("--iters", type=int, default=None, help="calls per timed executable (default 20)")
    p.add_argument("--only", choices=("attention", "qmatmul"), default=None)
    p.add_argument("--compile-for", default=None, metavar="TOPOLOGY",
                   help="compile every case for this chip (e.g. cuda:h200x1, v6e:1) instead of running")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rec = Recorder(a.out, a.budget_s or (120.0 if a.smoke else 540.0))
    if a.compile_for:
        rec.budget_s = a.budget_s or 3600.0  # compiling on this machine: no device minutes to save
        compile_main(a, rec)
        return emit_summary(rec, ("compiled", "error", "skipped"))
    backend = jax.default_backend()
    if a.smoke:
        # The harness, not the kernels (their tests are test_pallas_attention.py and
        # test_quantized_matmul.py): the TPU attention interpreter compiles in a third of the
        # GPU one's time; the matmul is the GPU kernel, the one an H200 run checks.
        attn_impl, qmm_impl, n, bw_bytes = "pallas_tpu_interpret", "pallas_gpu_interpret", a.iters or 1, 1 << 22
        K, G, H = 2, 2, 64
    else:
        attn_impl = qmm_impl = KERNEL_IMPL.get(backend, "xla")
        n, bw_bytes = a.iters or 20, 1 << 30
        K, G, H = KV_HEADS, N_HEADS // KV_HEADS, HEAD_DIM
    rec.case("env", "environment", environment, min_left_s=0)
    bw_rec = rec.case("bandwidth", f"{bw_bytes >> 20}MiB", lambda: bandwidth(bw_bytes, n), min_left_s=0)
    bw = bw_rec if bw_rec.get("status") == "ok" else None
    if a.only in (None, "attention"):
        for name, seqs, ps, kv, kw in attention_cases(a.smoke):
            saved = os.environ.get(FILL_ENV)
            if a.smoke and kw.get("junk_bytes"):
                # No device memory to fill on CPU: the interpreter's zero fill stands in for it.
                os.environ[FILL_ENV] = "zero"
            rec.case("attention", name, functools.partial(run_attention, name, seqs, ps, kv, attn_impl, bw, n,
                                                          K, G, H, **kw))
            if saved is None:
                os.environ.pop(FILL_ENV, None)
            else:
                os.environ[FILL_ENV] = saved
    if a.only in (None, "qmatmul"):
        for M, N, Kd, bits, Gq in qmm_cases(a.smoke):
            rec.case("qmatmul", qmm_name(M, N, Kd, bits, Gq),
                     functools.partial(run_qmm, M, N, Kd, bits, Gq, qmm_impl, bw, n))
    return emit_summary(rec, ("pass", "fail", "error", "skipped"))


def emit_summary(rec: Recorder, statuses) -> list[dict]:
    rec.emit({"kind": "summary", **{s: sum(r.get("status") == s for r in rec.records) for s in statuses}})
    return rec.records


if __name__ == "__main__":
    records = main()
    sys.exit(1 if any(r.get("status") in ("fail", "error") for r in records) else 0)
