"""The step roofline for the benchmarks: what each engine step had to do, how fast this machine
can do it, and how close the run came.

    peaks = measure_peaks()                    GEMM GFLOP/s and read GB/s, measured now
    rec = StepRecorder(llm.engine, llm.loaded.model)           times every runner.execute, with its plan
    ... run the workload ...
    rec.stop(); table = rec.summary(peaks, wall_s)

The model of one step (a ragged batch of sequences, each adding n tokens after s cached ones):
  FLOPs  = 2 * (matmul weights, elements) * tokens          the layers' projections
         + 4 * L * N * H * sum over tokens of its context  QK^T and PV
         + 2 * D * V * logit rows                          the head (one row per sequence, plus drafts)
  bytes  = matmul weights' bytes (read once per step; the embedding table only where it is also
           the head) + KV bytes per cached position * sum over sequences of s + n
  roofline time = max(FLOPs / GEMM peak, bytes / read bandwidth)
Only the plan's real tokens count (padding up to the bucket is the engine's cost, not work), so
padding lowers the fraction. The run's fraction of the step roofline is the sum of the steps'
roofline times over the measured wall time.

Peaks are measured in the same process before the run and again after it, and the best of
each is used (`best_peaks`): GEMM as the best of a few fp32 1024^3 matmuls, bandwidth as the
best of a streaming sum and a matrix-vector product over 256 MiB (the decode step's own
pattern). On a busy machine a probe can land in a slow moment; a fraction above 1 (a step
faster than its "roofline") says the probes saw less than the machine gave the run.
"""

from __future__ import annotations

import time
from collections import defaultdict


def _best_seconds(fn, reps: int) -> float:
    fn()  # compile and warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


_PROBES = {}


def _probes():
    """The probes' jitted functions, made once: a second measurement reuses their executables
    (no compilation after an engine's warm-up)."""
    if not _PROBES:
        import jax
        import jax.numpy as jnp
        _PROBES.update(mm=jax.jit(lambda x, y: x @ y), total=jax.jit(jnp.sum), gemv=jax.jit(lambda x, m: x @ m),
                       ones=jax.jit(lambda: jnp.ones((16384, 4096), jnp.float32)),
                       vec=jax.jit(lambda: jnp.ones((16384,), jnp.float32)),
                       square=jax.jit(lambda: jnp.ones((1024, 1024), jnp.float32) * 0.5))
    return _PROBES


def measure_peaks(reps: int = 5) -> dict:
    p = _probes()
    n = 1024
    a, b = p["square"](), p["square"]()
    gemm = 2 * n ** 3 / _best_seconds(lambda: p["mm"](a, b).block_until_ready(), reps) / 1e9
    return {"gemm_gflops": round(gemm, 1), **measure_read_bandwidth(reps)}


def measure_read_bandwidth(reps: int = 5) -> dict:
    """GB/s of a streaming sum and of a matrix-vector product over 256 MiB of fp32 (XLA, on every
    core: one numpy thread reads far less on some machines), and the better of the two."""
    from jaxserve import huge_pages
    p = _probes()
    total, gemv = p["total"], p["gemv"]
    # 256 MiB of fp32: beyond the caches, a 480 MB L3 included (1 and 2 GiB read as fast there)
    w, v = p["ones"](), p["vec"]()
    # On 2 MiB pages, as the engine keeps its weights and KV cache (jaxserve/huge_pages.py): on
    # 4 KiB pages this probe read 27 GB/s where it read 30.6 on huge pages (2-core Intel Xeon),
    # a ceiling below what the engine itself can reach.
    huge_pages.back_with_huge_pages(w)
    nbytes = w.size * 4
    bw_sum = nbytes / _best_seconds(lambda: total(w).block_until_ready(), reps) / 1e9
    bw_gemv = nbytes / _best_seconds(lambda: gemv(v, w).block_until_ready(), reps) / 1e9
    w = v = None  # the 256 MiB go now, not when the caller's frame ends
    return {"read_gbs_sum": round(bw_sum, 2), "read_gbs_gemv": round(bw_gemv, 2),
            "read_gbs": round(max(bw_sum, bw_gemv), 2)}


def best_peaks(before: dict, after: dict) -> dict:
    """Each figure's best of two measurements (before and after the run), both kept."""
    best = {k: max(before[k], after[k]) for k in before}
    best["before"], best["after"] = before, after
    return best


class StepCost:
    """FLOPs and bytes of a step plan for one model and KV cache."""

    def __init__(self, model, cache, num_slots: int):
        import jax
        from jaxserve.model.llama import flat_params
        cfg = model.cfg
        self.cfg = cfg
        # As stored (a packed weight's bytes are what the kernel reads; unpacking here would also
        # compile eager copies after the engine's warm-up).
        params = flat_params(model, unpack=False)
        D = cfg.hidden_size
        # The head reads [D, V] once per step; it is the embedding table itself when tied.
        nbytes = {k: sum(x.nbytes for x in jax.tree.leaves(v)) for k, v in params.items()}
        self.weight_bytes = sum(b for k, b in nbytes.items() if k != "embed" or cfg.tie_word_embeddings)
        N, K, H, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        # The layers' projections (q, k, v, o; gate, up, down); norms and biases are not matmuls.
        self.matmul_elems = cfg.num_layers * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
        self.kv_bytes_per_pos = sum(x.nbytes for x in jax.tree.leaves(cache)) / num_slots

    def of(self, plan) -> tuple[float, float]:
        c = self.cfg
        tokens = plan.num_tokens
        ctx_sum = 0  # sum over tokens of the positions each attends to
        kv_positions = 0
        logit_rows = 0
        for s in plan.seqs:
            n, p = s.num_tokens, s.start_pos
            ctx_sum += n * p + n * (n + 1) // 2
            kv_positions += p + n
            logit_rows += 1 + s.draft_len
        flops = (2 * self.matmul_elems * tokens + 4 * c.num_layers * c.num_heads * c.head_dim * ctx_sum
                 + 2 * c.hidden_size * c.vocab_size * logit_rows)
        return float(flops), float(self.weight_bytes + self.kv_bytes_per_pos * kv_positions)


class StepRecorder:
    """Wraps engine.runner.execute (which returns host arrays, so a call's time is the step's)
    and keeps (bucket, real tokens, rows, seconds, FLOPs, bytes) per step."""

    def __init__(self, engine, model):
        runner = engine.runner
        sched = engine.scheduler_config
        self.cost = StepCost(model, runner.cache, sched.num_pages * sched.page_size)
        self.runner = runner
        self.steps: list[tuple] = []
        self._orig = runner.execute

        def timed(plan, rows):
            t0 = time.perf_counter()
            out = self._orig(plan, rows)
            dt = time.perf_counter() - t0
            flops, nbytes = self.cost.of(plan)
            self.steps.append((runner.bucket_for(plan.num_tokens), plan.num_tokens, len(plan.seqs), dt,
                               flops, nbytes))
            return out

        runner.execute = timed

    def stop(self) -> None:
        self.runner.execute = self._orig

    def summary(self, peaks: dict, wall_s: float) -> dict:
        gemm, bw = peaks["gemm_gflops"] * 1e9, peaks["read_gbs"] * 1e9
        by = defaultdict(lambda: [0, 0, 0, 0.0, 0.0, 0.0, 0.0])
        for T, n, rows, dt, flops, nbytes in self.steps:
            b = by[T]
            roof = max(flops / gemm, nbytes / bw)
            for i, v in enumerate((1, n, rows, dt, flops, nbytes, roof)):
                b[i] += v
        buckets = []
        for T in sorted(by):
            steps, n, rows, dt, flops, nbytes, roof = by[T]
            buckets.append({"bucket": T, "steps": steps, "tokens": n, "mean_rows": round(rows / steps, 1),
                            "seconds": round(dt, 3), "ms_per_step": round(1e3 * dt / steps, 1),
                            "gflops": round(flops / dt / 1e9, 1), "gbs": round(nbytes / dt / 1e9, 2),
                            "roofline_s": round(roof, 3), "roofline_fraction": round(roof / dt, 3)})
        in_steps = sum(b["seconds"] for b in buckets)
        roof = sum(by[T][6] for T in by)
        return {"peaks": peaks, "buckets": buckets, "step_seconds": round(in_steps, 3),
                "roofline_s": round(roof, 3),
                "roofline_fraction": round(roof / wall_s, 3) if wall_s else None,
                "roofline_fraction_in_steps": round(roof / in_steps, 3) if in_steps else None}


def format_table(summary: dict) -> str:
    p = summary["peaks"]
    lines = [f"step roofline: GEMM peak {p['gemm_gflops']:.0f} GFLOP/s, read bandwidth {p['read_gbs']:.1f} GB/s "
             f"(sum {p['read_gbs_sum']:.1f}, gemv {p['read_gbs_gemv']:.1f}), measured in this run",
             f"{'bucket':>6} {'steps':>6} {'tokens':>7} {'rows':>5} {'time s':>8} {'ms/step':>8} "
             f"{'GFLOP/s':>8} {'GB/s':>6} {'roof s':>7} {'frac':>5}"]
    for b in summary["buckets"]:
        lines.append(f"{b['bucket']:>6} {b['steps']:>6} {b['tokens']:>7} {b['mean_rows']:>5} {b['seconds']:>8.2f} "
                     f"{b['ms_per_step']:>8.1f} {b['gflops']:>8.1f} {b['gbs']:>6.2f} {b['roofline_s']:>7.2f} "
                     f"{b['roofline_fraction']:>5.2f}")
    lines.append(f"fraction of the step roofline: {summary['roofline_fraction']:.3f} of the wall time "
                 f"({summary['roofline_fraction_in_steps']:.3f} of the time inside steps)")
    return "\n".join(lines)
