"""Every TPU Pallas kernel through the real TPU compiler (Mosaic + XLA:TPU in libtpu) at real
model shapes, on a CPU machine: no TPU needed, only a jax with libtpu installed
(`pip install "jax[tpu]"`). Compile-only devices come from
jax.experimental.topologies; one chip is enough, every kernel here is single-device (tp > 1 is
run as the per-chip shard's shapes).

Kernels and shapes (per chip):
  rpa    pallas_kernels/ragged_paged_attention/tpu.py: Llama-3.1-8B and Mixtral-8x7B (K 8, G 4),
         Llama-3.1-70B at tp 1 (K 8, G 8) and tp 8 (K 1, G 8), Qwen3-30B-A3B (K 4, G 8),
         Gemma-3-27B (K 16, G 2, sliding window 1024 and its global layers), Gemma-2-9B (head dim
         256, soft cap 50, window 4096), Gemma-3-270M (K 1, G 4, head dim 256, window 512), an
         MHA model with head dim 64 (G 1); bf16 and int8 KV, pages of 16 / 32 / 64, a decode
         step (T = 32) and a prefill step (T = 1024); few pages, one layer.
  qmm    pallas_kernels/quantized_matmul/tpu.py: each model's projections (q, k/v, o, gate/up,
         down; tp 8's column / row shards for 70B) at M = 1, 16, 256, int8 per channel and
         int4 g128 (Llama-3.1-8B also int8 / int4 g32, GGUF Q8_0 / Q4_0's blocks).
  gmm    pallas_kernels/grouped_matmul/tpu.py (bf16 experts) and tpu_quantized.py (int8 per
         channel, int4 g128): Qwen3-30B-A3B (128 experts, top 8, 2048 <-> 768) and
         Mixtral-8x7B (8 experts, top 2, 4096 <-> 14336, and tp 8's 1792 shards), a decode
         step (16 tokens x top k rows) and a prefill step (256 tokens x top k).
  budget the attention kernel's VMEM estimate (tpu_budget.py) against the compiler's own
         count: each listed config compiled once with its VMEM limit forced to 1 MiB, and the
         "Scoped allocation with size X" of XLA's refusal read back.

  JAX_PLATFORMS=cpu python scripts/tpu_kernel_sweep.py [--gens v5e,v6e,v5p] [--quick]
      [--kernels rpa,qmm,gmm,budget] [--json OUT]

Prints a table (kernel, shape, gen, ok / the error's first line, compile seconds, the VMEM the
kernel asks for, XLA's HBM temp bytes), then counts per kernel x gen; --json writes it all.
Exit status 1 when any case failed. ALLOW_MULTIPLE_LIBTPU_LOAD is set so that a second
compile-only process (another sweep, `jaxserve compile`) does not trip libtpu's lockfile.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import kv_cache  # noqa: E402
from pallas_kernels.grouped_matmul import tpu as gmm_tpu  # noqa: E402
from pallas_kernels.grouped_matmul import tpu_quantized as gmm_tpu_q  # noqa: E402
from pallas_kernels.quantized_matmul import tpu as qmm_tpu  # noqa: E402
from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu  # noqa: E402
from pallas_kernels.ragged_paged_attention import tpu_budget  # noqa: E402

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
BF16, I8, U8, I32 = jnp.bfloat16, jnp.int8, jnp.uint8, jnp.int32
MiB = 1 << 20

# ---- the models, per chip ---------------------------------------------------------------

# Attention: (KV heads K, query heads per KV head G, head dim H, sliding window, soft cap).
ATTENTION = {
    "llama3.1-8b": (8, 4, 128, None, None),  # = Mixtral-8x7B's attention (32 / 8 heads, 128)
    "llama3.1-70b-tp1": (8, 8, 128, None, None),
    "llama3.1-70b-tp8": (1, 8, 128, None, None),
    "qwen3-30b-a3b": (4, 8, 128, None, None),
    "gemma3-27b-local": (16, 2, 128, 1024, None),  # its sliding layers; soft caps none
    "gemma3-27b-global": (16, 2, 128, None, None),
    "gemma2-9b": (8, 2, 256, 4096, 50.0),  # head dim 256, attention soft cap 50
    "gemma3-270m": (1, 4, 256, 512, None),
    "mha-h64": (16, 1, 64, None, None),  # GQA ratio 1, head dim 64
}
DECODE_T, PREFILL_T = 32, 1024
PAGE_SIZES = (16, 32, 64)
ATTN_SEQS, ATTN_PAGES_PER_SEQ = 8, 8  # block tables [8, 8]: SMEM stays small; VMEM is per block

# Dense projections: (hidden D, q dim, kv dim, intermediate F, tp).
DENSE = {
    "llama3.1-8b": (4096, 4096, 1024, 14336, 1),
    "llama3.1-70b-tp1": (8192, 8192, 1024, 28672, 1),
    "llama3.1-70b-tp8": (8192, 8192, 1024, 28672, 8),
    "qwen3-30b-a3b": (2048, 4096, 512, None, 1),  # its MLPs are experts (gmm)
    "gemma3-27b": (5376, 4096, 2048, 21504, 1),
    "mixtral-8x7b": (4096, 4096, 1024, None, 1),  # attention = Llama-3.1-8B's (deduplicated)
}
QMM_M = (1, 16, 256)
QMM_FORMATS = {"int8-pc": (8, None), "int4-g128": (4, 128)}  # (bits, group; None = per channel)
QMM_GGUF = {"int8-g32": (8, 32), "int4-g32": (4, 32)}  # Llama-3.1-8B only

# Experts: (experts E, top k, hidden D, expert intermediate F, tp).
MOE = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 1),
    "mixtral-8x7b-tp1": (8, 2, 4096, 14336, 1),
    "mixtral-8x7b-tp8": (8, 2, 4096, 14336, 8),
}
MOE_TOKENS = {"decode": 16, "prefill": 256}
GMM_FORMATS = {"bf16": None, "int8-pc": (8, None), "int4-g128": (4, 128)}


# --quick: one case for each kernel path and each fix (about 30 s of compiles per generation).
QUICK_ATTENTION = {("llama3.1-8b", DECODE_T, 16, "bfloat16"), ("llama3.1-8b", DECODE_T, 32, "int8"),
                   ("llama3.1-70b-tp8", PREFILL_T, 16, "bfloat16"), ("gemma2-9b", DECODE_T, 16, "bfloat16"),
                   ("mha-h64", DECODE_T, 16, "int8")}
QUICK_QMM = {("llama3.1-8b", "down", "int4-g128", 1), ("llama3.1-8b", "down", "int4-g128", 16),
             ("llama3.1-8b", "gate/up", "int8-pc", 1), ("gemma3-27b", "down", "int4-g128", 16)}
QUICK_GMM = {("mixtral-8x7b-tp1", "decode", "down", "bf16"), ("mixtral-8x7b-tp1", "decode", "down", "int4-g128"),
             ("qwen3-30b-a3b", "decode", "down", "int8-pc")}


@dataclasses.dataclass
class Case:
    kernel: str
    shape: str
    make: Callable  # sds -> (fn, args)
    quick: bool = False


# ---- case builders ----------------------------------------------------------------------

def attention_case(model, T, ps, kv, *, window=None, cap=None, q_block=None, nb=None):
    K, G, H, _, _ = ATTENTION[model]

    def make(sds):
        L, S, W = 1, ATTN_SEQS, ATTN_PAGES_PER_SEQ
        P = S * W + 1

        def cache():
            if kv == "int8":
                # Scales lane-dense, as the runner stores them for this kernel (kv_cache.scale_shape).
                return kv_cache.QuantizedKV(sds((L, P, ps, K * H), I8),
                                            sds(kv_cache.scale_shape(L, P, ps, K, lane_dense=True), BF16))
            return sds((L, P, ps, K * H), BF16)

        fn = functools.partial(rpa_tpu.ragged_paged_attention_tpu, sliding_window=window, soft_cap=cap,
                               q_block=q_block, kv_pages_per_block=nb)
        return fn, (sds((T, K * G, H), BF16), cache(), cache(), sds((), I32), sds((T,), I32),
                    sds((T,), I32), sds((S, W), I32))

    extra = "".join(f" {k}={v}" for k, v in (("win", window), ("cap", cap), ("bq", q_block), ("nb", nb)) if v)
    return f"{model} K{K} G{G} H{H} T{T} p{ps} {kv}{extra}", make


def attention_cases(every_page: bool = False) -> list[Case]:
    """Every model with both KV dtypes at both step sizes; Llama-3.1-8B at every page size, the
    others at one page size each, rotating so that every (KV dtype, step, page) meets three
    models (every_page: all models at all page sizes, 3x the compiles)."""
    cases = []
    for i, (model, (*_, window, cap)) in enumerate(ATTENTION.items()):
        for a, kv in enumerate(("bfloat16", "int8")):
            for b, T in enumerate((DECODE_T, PREFILL_T)):
                pages = PAGE_SIZES if every_page or model == "llama3.1-8b" else \
                    (PAGE_SIZES[(i + a + b) % len(PAGE_SIZES)],)
                for ps in pages:
                    quick = (model, T, ps, kv) in QUICK_ATTENTION
                    cases.append(Case("rpa", *attention_case(model, T, ps, kv, window=window, cap=cap),
                                      quick=quick))
    # Window and soft cap on a model that has neither, so every combination appears.
    for kv in ("bfloat16", "int8"):
        for T in (DECODE_T, PREFILL_T):
            cases.append(Case("rpa", *attention_case("llama3.1-8b", T, 32, kv, window=1024, cap=30.0)))
    return cases


def qmm_case(label, M, N, K, bits, G):
    G = G or K

    def make(sds):
        q = sds((N, K // 2), U8) if bits == 4 else sds((N, K), I8)
        z = sds((N, K // G), BF16) if bits == 4 else None
        fn = functools.partial(qmm_tpu.quantized_matmul_tpu, bits=bits, group_size=G)
        return fn, (sds((M, K), BF16), q, sds((N, K // G), BF16), z)

    return f"{label} M{M} {K}->{N}", make


def projections(D, qd, kvd, F, tp):
    """(name, N, K) of one layer's projections on one chip: q / kv / gate / up split by output
    columns, o / down by inputs (sharding/rules.py)."""
    out = [("q", qd // tp, D), ("kv", max(kvd // tp, 128), D), ("o", D, qd // tp)]
    if F:
        out += [("gate/up", F // tp, D), ("down", D, F // tp)]
    return out


def qmm_cases() -> list[Case]:
    cases, seen = [], set()
    for model, dims in DENSE.items():
        formats = dict(QMM_FORMATS, **(QMM_GGUF if model == "llama3.1-8b" else {}))
        for name, N, K in projections(*dims):
            for fmt, (bits, G) in formats.items():
                for M in QMM_M:
                    if (N, K, M, fmt) in seen:
                        continue
                    seen.add((N, K, M, fmt))
                    quick = (model, name, fmt, M) in QUICK_QMM
                    label, make = qmm_case(f"{model} {name} {fmt}", M, N, K, bits, G)
                    cases.append(Case("qmm", label, make, quick=quick))
    return cases


def gmm_case(label, M, E, N, K, fmt):
    def make(sds):
        lhs, sizes = sds((M, K), BF16), sds((E,), I32)
        if fmt == "bf16":
            return gmm_tpu.grouped_matmul_tpu, (lhs, sds((E, K, N), BF16), sizes)
        bits, G = GMM_FORMATS[fmt]
        G = G or K
        q = sds((E, N, K // 2), U8) if bits == 4 else sds((E, N, K), I8)
        z = sds((E, N, K // G), BF16) if bits == 4 else None
        fn = functools.partial(gmm_tpu_q.quantized_grouped_matmul_tpu, bits=bits, group_size=G)
        return fn, (lhs, q, sds((E, N, K // G), BF16), z, sizes)

    kernel = "gmm" if fmt == "bf16" else "gmm_q"
    return kernel, f"{label} {fmt} M{M} E{E} {K}->{N}", make


def gmm_cases() -> list[Case]:
    cases = []
    for model, (E, top_k, D, F, tp) in MOE.items():
        for step, tokens in MOE_TOKENS.items():
            M = tokens * top_k
            for name, N, K in (("gate/up", F // tp, D), ("down", D, F // tp)):
                for fmt in GMM_FORMATS:
                    quick = (model, step, name, fmt) in QUICK_GMM
                    kernel, label, make = gmm_case(f"{model} {name}", M, E, N, K, fmt)
                    cases.append(Case(kernel, label, make, quick=quick))
    return cases


# (model, T, page, kv, q_block, kv_pages_per_block): the table's rows at real shapes, and larger
# blocks up to and past the budget's 48 MiB ceiling.
BUDGET_CONFIGS = [
    ("llama3.1-8b", DECODE_T, 16, "bfloat16", None, None),
    ("llama3.1-8b", PREFILL_T, 16, "bfloat16", None, None),
    ("llama3.1-8b", PREFILL_T, 16, "int8", None, None),
    ("llama3.1-8b", PREFILL_T, 32, "int8", None, None),
    ("llama3.1-70b-tp1", PREFILL_T, 16, "bfloat16", None, None),
    ("gemma3-27b-local", PREFILL_T, 16, "bfloat16", None, None),
    ("gemma2-9b", DECODE_T, 16, "bfloat16", None, None),
    ("gemma2-9b", PREFILL_T, 16, "bfloat16", None, None),
    ("gemma2-9b", PREFILL_T, 64, "int8", None, None),
    ("mha-h64", PREFILL_T, 16, "bfloat16", None, None),
    ("llama3.1-8b", PREFILL_T, 16, "bfloat16", 128, 64),
    ("llama3.1-70b-tp1", PREFILL_T, 16, "bfloat16", 64, 64),
    ("llama3.1-70b-tp1", 2048, 16, "bfloat16", 256, 128),  # tests/test_tpu_budget.py's refusal
]
BUDGET_QUICK = (0,)  # on the first generation only


# ---- compiling --------------------------------------------------------------------------

def first_line(e: BaseException) -> str:
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else type(e).__name__
    m = re.search(r"Scoped allocation with size \S+ and limit \S+", text)
    if m and m.group(0) not in head:
        head += " " + m.group(0)
    return head[:300]


def vmem_asked(hlo_text: str) -> int | None:
    """The largest VMEM limit a tpu_custom_call in the lowered module asks for (its backend
    config's scoped_memory_configs size)."""
    sizes = [int(s) for s in re.findall(r"scoped_memory_configs\\22: \[\{[^\]]*?\\22size\\22: (\d+)", hlo_text)]
    return max(sizes) if sizes else None


def compile_one(fn, args, mesh):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(fn).lower(*args)
        return lowered, lowered.compile()


def run_case(case: Case, gen: str, mesh) -> dict:
    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    row = dict(kernel=case.kernel, shape=case.shape, gen=gen)
    t0 = time.perf_counter()
    try:
        fn, args = case.make(sds)
        lowered, compiled = compile_one(fn, args, mesh)
        mem = compiled.memory_analysis()
        row.update(ok=True, error=None, vmem_limit_bytes=vmem_asked(lowered.as_text()),
                   temp_bytes=int(mem.temp_size_in_bytes), peak_bytes=int(getattr(mem, "peak_memory_in_bytes", 0)))
    except Exception as e:  # noqa: BLE001 - a refusal is a result
        row.update(ok=False, error=first_line(e), vmem_limit_bytes=None, temp_bytes=None, peak_bytes=None)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _scoped_size(e: BaseException) -> int | None:
    m = re.search(r"Scoped allocation with size ([\d.]+)([KMG])", str(e))
    return int(float(m.group(1)) * {"K": 1 << 10, "M": MiB, "G": 1 << 30}[m.group(2)]) if m else None


def budget_row(cfg, gen: str, mesh, max_tries: int = 10, bisect: int = 3) -> dict:
    """The budget's estimate for one attention config next to the compiler's own VMEM need: the
    smallest VMEM limit the kernel compiles under.

    XLA reports, when a kernel's scoped VMEM runs out, the size reached at the allocation that
    failed, not the total (llama3.1-8b's prefill block on v5e: 7.00M under a 2 MiB limit, 9.00M
    under 8, 10.45M under 9 and 10), and that size is not always a lower bound either (v5p
    compiled a block under 34 MiB after reporting 35.14M under a smaller limit). So the forced
    limit first climbs to each reported size until the kernel compiles, then `bisect` halvings
    between the last limit that failed and the first that compiled narrow it down."""
    model, T, ps, kv, q_block, nb = cfg
    label, make = attention_case(model, T, ps, kv, q_block=q_block, nb=nb)
    captured = {}
    original = tpu_budget.attention_budget
    limit = [1 * MiB]

    def forced(**kw):  # the kernel's own estimate, captured, with its VMEM limit forced
        b = original(**kw)
        captured["b"] = b
        return dataclasses.replace(b, vmem_limit_bytes=limit[0])

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    fn, args = make(sds)
    inner = fn.func.__wrapped__  # a fresh trace each time, not jit's cached one

    def attempt():
        """None if it compiled, else (the reported size or None, the error)."""
        try:
            compile_one(functools.partial(inner, **fn.keywords), args, mesh)
            return None
        except Exception as e:  # noqa: BLE001
            return _scoped_size(e), e

    measured, err, tries, failed_at = None, None, 0, 0
    rpa_tpu.tpu_budget.attention_budget = forced
    t0 = time.perf_counter()
    try:
        while tries < max_tries:
            tries += 1
            res = attempt()
            if res is None:
                measured = limit[0]
                break
            size, e = res
            over = re.search(r"Used ([\d.]+)M of ([\d.]+)M vmem", str(e))
            if over:  # the whole kernel's VMEM against the chip's: over it at any limit
                measured, err = int(float(over.group(1)) * MiB), f"over the chip: {over.group(0)}"
                break
            if size is None:
                err = first_line(e)
                break
            failed_at = limit[0]
            limit[0] = max(limit[0] + 64 * 1024, size + 20 * 1024)
        else:
            err = f"no compile within {max_tries} limits (last {limit[0]} bytes)"
        if measured and not err:
            lo, hi = failed_at, measured
            for _ in range(bisect):
                if hi - lo <= 64 * 1024:
                    break
                limit[0] = (lo + hi) // 2
                tries += 1
                if attempt() is None:
                    hi = limit[0]
                else:
                    lo = limit[0]
            measured = hi
    finally:
        rpa_tpu.tpu_budget.attention_budget = original
    b = captured.get("b")
    lim = tpu_budget.LIMITS[gen]
    row = dict(kernel="budget", shape=label, gen=gen, estimate_bytes=b and b.vmem_bytes,
               limit_bytes=b and b.vmem_limit_bytes, compiler_bytes=measured, error=err, tries=tries,
               seconds=round(time.perf_counter() - t0, 1),
               budget_admits=bool(b and b.vmem_limit_bytes <= tpu_budget.MAX_VMEM_LIMIT),
               fits_chip=None if measured is None else measured <= lim.vmem_bytes)
    if b and measured and not err:
        row["ratio"] = round(b.vmem_bytes / measured, 2)
        row["limit_holds"] = b.vmem_limit_bytes >= measured  # the kernel's own ask holds its need
    return row


# ---- output -----------------------------------------------------------------------------

def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:.1f}M" if n >= MiB else f"{n / 1024:.0f}K"


def print_table(rows):
    w = max([len(r["shape"]) for r in rows] + [5])
    print(f"{'kernel':6} {'shape':{w}} {'gen':4} {'s':>6} {'vmem':>7} {'temp':>7}  result")
    for r in rows:
        res = "ok" if r["ok"] else r["error"]
        print(f"{r['kernel']:6} {r['shape']:{w}} {r['gen']:4} {r['compile_s']:6.1f} "
              f"{fmt_bytes(r['vmem_limit_bytes']):>7} {fmt_bytes(r['temp_bytes']):>7}  {res}")


def summarize(rows) -> list[dict]:
    out = {}
    for r in rows:
        s = out.setdefault((r["kernel"], r["gen"]), dict(kernel=r["kernel"], gen=r["gen"], ok=0, failed=0, times=[]))
        s["ok" if r["ok"] else "failed"] += 1
        s["times"].append(r["compile_s"])
    res = []
    for s in out.values():
        t = s.pop("times")
        res.append(dict(s, min_s=min(t), median_s=float(np.median(t)), max_s=max(t)))
    return res


def print_budget(rows):
    if not rows:
        return
    w = max(len(r["shape"]) for r in rows)
    print("\nVMEM: tpu_budget estimate vs the compiler's scoped allocation")
    print(f"{'shape':{w}} {'gen':4} {'estimate':>9} {'limit':>7} {'compiler':>9} {'est/cmp':>7}  verdict")
    for r in rows:
        if r["compiler_bytes"] is None or r["error"]:
            verdict = ("refused" if not r["budget_admits"] else "ADMITTED") + ", " + r["error"]
        else:
            verdict = ("admitted" if r["budget_admits"] else "refused") + \
                      (", fits the chip" if r["fits_chip"] else ", over the chip's VMEM") + \
                      ("" if r.get("limit_holds", True) else ", LIMIT BELOW NEED")
        print(f"{r['shape']:{w}} {r['gen']:4} {fmt_bytes(r['estimate_bytes']):>9} {fmt_bytes(r['limit_bytes']):>7} "
              f"{fmt_bytes(r['compiler_bytes']):>9} {r.get('ratio', '-'):>7}  {verdict}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gens", default="v5e,v6e,v5p", help="TPU generations (v5e, v6e, v5p)")
    ap.add_argument("--quick", action="store_true", help="a representative subset (under 3 minutes)")
    ap.add_argument("--kernels", default="rpa,qmm,gmm,budget", help="rpa, qmm, gmm (float + quantized), budget")
    ap.add_argument("--every-page", action="store_true",
                    help="attention: every model at every page size (default: Llama-3.1-8B at all, others rotate)")
    ap.add_argument("--filter", default="", help="only cases whose shape contains this")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    gens = [g.strip() for g in args.gens.split(",") if g.strip()]
    for g in gens:
        if g not in TOPOLOGIES:
            ap.error(f"--gens: {g!r} not in {sorted(TOPOLOGIES)}")
    kinds = set(args.kernels.split(","))
    cases = ((attention_cases(args.every_page) if "rpa" in kinds else []) + (qmm_cases() if "qmm" in kinds else [])
             + (gmm_cases() if "gmm" in kinds else []))
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.filter:
        cases = [c for c in cases if args.filter in c.shape]
    budget_cfgs = ([BUDGET_CONFIGS[i] for i in BUDGET_QUICK] if args.quick else BUDGET_CONFIGS) \
        if "budget" in kinds else []

    from jax.experimental import topologies
    from tqdm import tqdm

    rows, budget_rows = [], []
    n_budget = len(budget_cfgs) * (1 if args.quick else len(gens))
    bar = tqdm(total=len(gens) * len(cases) + n_budget, unit="case", file=sys.stderr)
    t_start = time.perf_counter()
    for gen in gens:
        topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[gen], platform="tpu")
        mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
        for case in cases:
            bar.set_postfix_str(f"{gen} {case.kernel} {case.shape}"[:60])
            rows.append(run_case(case, gen, mesh))
            bar.update()
        for cfg in budget_cfgs if (gen == gens[0] or not args.quick) else ():
            bar.set_postfix_str(f"{gen} budget {cfg[0]}")
            budget_rows.append(budget_row(cfg, gen, mesh))
            bar.update()
    bar.close()

    print_table(rows)
    summary = summarize(rows)
    print(f"\n{'kernel':6} {'gen':4} {'ok':>4} {'fail':>4}  compile s (min / median / max)")
    for s in summary:
        print(f"{s['kernel']:6} {s['gen']:4} {s['ok']:4d} {s['failed']:4d}  "
              f"{s['min_s']:.1f} / {s['median_s']:.1f} / {s['max_s']:.1f}")
    print_budget(budget_rows)
    wall = time.perf_counter() - t_start
    print(f"\n{len(rows)} compiles, {sum(not r['ok'] for r in rows)} failed, {len(budget_rows)} budget checks, "
          f"{wall:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            gens=gens, quick=args.quick, jax=jax.__version__, wall_s=round(wall, 1), summary=summary,
            results=rows, budget=budget_rows), indent=1))
    return 1 if any(not r["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
