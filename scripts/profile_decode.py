"""Per-part profile of the default engine's decode step: where a batched decode step's time goes.

For each row count (default 1, 8, 24, 48) the engine's own compiled step runs on a decode plan
of that many sequences at seeded contexts in [--context-min, --context-max] tokens (one new
token each), and so do its parts, each jitted alone at the step's shapes:

  step            the engine's compiled step (ModelRunner's executable, as execute runs it)
  host            build_inputs (the plan -> numpy arrays) plus the results back to numpy
  attention       every layer's KV write + attention (the model's `attend`, as the step runs it)
    kv read       the attention kernel alone, no write (its bytes: every row's KV, every layer)
    kv write      the scatter of the step's new K/V alone
  layers - attn   the layers with attention replaced by a pass-through: projections, MLP, norms, RoPE
    matmuls       the 7 projections of each layer alone (q, k, v, o, gate, up, down)
  head            the LM head ([S, D] x [D, V], fp32 logits)
  sampler         greedy sampling of [S, V] logits (the step's lax.cond on "any row samples")
  rest            step - (attention + layers - attn + head + sampler): embedding, final norm,
                  the logit gather, the conds the step skips, per-call overhead

Parts run interleaved (one call of each per round, --reps rounds) and each figure is the
median, so a load spike hits every part alike; on a shared machine read the shares, not the
absolute times. "GB/s" is the part's compulsory bytes (weights read once; KV read or written
once) over its time. The step's figure is the executable alone (inputs already built); "host"
is what execute adds around it.

  python scripts/profile_decode.py [--rows 1,8,24,48] [--context-min 600 --context-max 2000]
      [--reps 7] [--attention-impl auto|xla|cpu_native] [--matmul-impl xla|cpu_native] [--model PATH]
      [--hlo-ops 25]

--hlo-ops N also traces three runs of each step with XLA:CPU's per-op trace events
(--xla_cpu_enable_xprof_traceme, set here before jax starts) and prints the N HLO ops
(fusions, dots, loops, copies) that took the most thread time per step, summed over XLA's
threads (a `while` op's time includes the ops inside it, which are listed too). The trace
events cost something on every op even between traces, so take the part table from a run
without --hlo-ops.
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    p.add_argument("--rows", default="1,8,24,48", help="comma-separated decode batch sizes")
    p.add_argument("--context-min", type=int, default=600)
    p.add_argument("--context-max", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per row count")
    p.add_argument("--attention-impl", default="auto",
                   help="auto (the default engine's: cpu_native on the CPU), xla or cpu_native")
    p.add_argument("--matmul-impl", default="auto", help="float projections: auto, xla, cpu_native_packed or cpu_native (LoadConfig.matmul_impl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hlo-ops", type=int, default=0, help="also print the N costliest HLO ops of each step")
    a = p.parse_args(argv)
    a.rows = sorted({int(r) for r in a.rows.split(",")})
    if not 1 <= a.context_min <= a.context_max:
        p.error(f"--context-min/--context-max: need 1 <= min <= max, got {a.context_min}, {a.context_max}")
    if a.reps < 1 or min(a.rows) < 1:
        p.error("--reps and every --rows entry must be >= 1")
    from jaxserve.config import EngineConfig
    if max(a.rows) > EngineConfig().max_num_seqs:
        p.error(f"--rows: at most the default max_num_seqs ({EngineConfig().max_num_seqs}) decode rows a step, "
                f"got {max(a.rows)}")
    return a


def decode_plan(rows: int, contexts, page_size: int):
    """A StepPlan of `rows` decodes, row i at position contexts[i], each on its own pages (page 0
    is the pool's null page, so pages start at 1)."""
    from jaxserve.scheduler.plan import ScheduledSeq, StepPlan
    seqs, nxt = [], 1
    for i, ctx in enumerate(contexts):
        n = ctx // page_size + 1
        seqs.append(ScheduledSeq(seq_id=i, token_ids=(100 + i,), start_pos=int(ctx),
                                 block_table=tuple(range(nxt, nxt + n)), sample=True))
        nxt += n
    return StepPlan(tuple(seqs), rows, ()), nxt


def hlo_op_times(step, top: int, runs: int = 3) -> list[tuple[str, float, int]]:
    """(op name, ms per step summed over threads, calls per step) of the `top` costliest HLO
    ops of `step`, from a jax.profiler trace read back with jaxlib's own xplane reader."""
    import tempfile
    from collections import defaultdict

    import jax
    from jax._src.lib import _profile_data
    with tempfile.TemporaryDirectory(prefix="profile_decode_") as d:
        jax.profiler.start_trace(d)
        for _ in range(runs):
            step()
        jax.profiler.stop_trace()
        path = next(Path(d).rglob("*.xplane.pb"))
        data = _profile_data.ProfileData.from_file(str(path))
    agg = defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):  # XLA's intra-op threads: the HLO ops
                continue
            for ev in line.events:
                if ev.name.startswith("ThunkExecutor"):
                    continue
                agg[ev.name][0] += ev.duration_ns / 1e6
                agg[ev.name][1] += 1
    ops = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, round(ms / runs, 2), round(n / runs)) for name, (ms, n) in ops]


def timed_rounds(fns: dict, reps: int) -> dict:
    """Each fn once per round, in order, `reps` rounds (after one warm call each): medians in ms."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def profile_rows(lm, runner, rows: int, contexts, reps: int, hlo_ops: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.engine.runner import RowInfo
    from jaxserve.model import layers
    from jaxserve.model import quant_linear as ql
    from jaxserve.model.decoder import KVCache
    from jaxserve.model.paged_attention import PagedMeta
    from jaxserve.model.sampler import sample
    from jaxserve.types import SamplingParams

    cfg = runner.model_cfg
    ps = runner.sched.page_size
    plan, _ = decode_plan(rows, contexts, ps)
    info = [RowInfo(SamplingParams(max_tokens=16, temperature=0.0), seed=0, step=0, prompt_ids=(), output_ids=())
            for _ in plan.seqs]
    T, inputs, _ = runner.build_inputs(plan, info)
    S = runner.seqs_for(T)
    exe = runner._executables[T]
    dev_inputs = jax.device_put(inputs)
    L, N, K, H, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    model = nnx.merge(runner._graphdef, runner._state)
    stacked = {n: getattr(model.layers, n)[...] for n in model.layer_names}
    meta = PagedMeta(dev_inputs.positions, dev_inputs.slot_mapping, dev_inputs.token_seq, dev_inputs.block_tables)
    key = jax.random.key(0)
    q = jax.random.normal(key, (1, T, N, H), jnp.float32)
    kv = jax.random.normal(key, (1, T, K, H), jnp.float32)
    attend = runner._attend

    def step():
        runner.cache, out = exe(runner._state, runner.cache, dev_inputs)
        jax.block_until_ready(out)

    def host():
        _, inp, _ = runner.build_inputs(plan, info)
        d = jax.device_put(inp)
        jax.block_until_ready(d)
        return [np.asarray(x) for x in (d.tokens, d.positions)]

    @jax.jit
    def _attention(cache, meta, q, kv):
        def body(c, i):
            out, c = attend(i, q, kv, kv, c, meta)
            return c, out[0, :1, :1, :1]
        return jax.lax.scan(body, cache, jnp.arange(L, dtype=jnp.int32))
    attn_donating = jax.jit(_attention.__wrapped__, donate_argnums=(0,))

    def attention():
        runner.cache, o = attn_donating(runner.cache, meta, q, kv)
        jax.block_until_ready(o)

    from sharding import ops
    kernel = ops.resolve(runner.cfg.attention_impl).fn

    @jax.jit
    def _kv_read(cache, meta, q):
        def body(acc, i):
            out = kernel(q[0], cache.k, cache.v, i, meta.positions, meta.token_seq, meta.block_tables,
                         sliding_window=cfg.sliding_window, soft_cap=cfg.attn_logit_softcap,
                         kv_chunk_pages=runner.cfg.kv_chunk_pages, max_decode_run=1 + runner.spec_k)
            return acc + out[:1, :1, :1], None
        return jax.lax.scan(body, jnp.zeros((1, 1, 1), jnp.float32), jnp.arange(L, dtype=jnp.int32))[0]

    def kv_read():
        jax.block_until_ready(_kv_read(runner.cache, meta, q))

    @jax.jit
    def _kv_write(cache, slots, kv):
        def body(c, i):
            k, v = ops.write_kv(c.k, c.v, i, kv[0], kv[0], slots)
            return KVCache(k, v), None
        return jax.lax.scan(body, cache, jnp.arange(L, dtype=jnp.int32))[0]
    kv_write_d = jax.jit(_kv_write.__wrapped__, donate_argnums=(0,))

    def kv_write():
        runner.cache = kv_write_d(runner.cache, meta.slot_mapping, kv)
        jax.block_until_ready(runner.cache)

    dummy = KVCache(jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.float32))

    # The step hands the packed matmul its real token count (the bucket's padding comes last and
    # is skipped: ModelRunner's live_tokens); so do the parts below.
    def live_count(positions):
        return jnp.sum(positions >= 0, dtype=jnp.int32)

    @jax.jit
    def _layers(state, tokens, positions):
        m = nnx.merge(runner._graphdef, state)
        h, _ = m.hidden(tokens[None], positions[None], dummy, lambda i, q, k, v, c, meta: (q, c), None,
                        jnp.zeros((1, S), jnp.int32), live_tokens=live_count(positions))
        return h

    def no_attn():
        jax.block_until_ready(_layers(runner._state, dev_inputs.tokens, dev_inputs.positions))

    x = jax.random.normal(key, (1, T, D), jnp.float32)
    mm = model.quantized_matmul
    # The projections as the step runs them (Decoder.hidden / _layer): packed float weights stay
    # whole, indexed by layer (a scan over their per-layer slices would copy every weight each
    # step and time the copy), q, k and v as one call (ql.einsums) and the MLP through
    # layers.gated_mlp (SwiGLU's fused gate/up).
    proj = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    packed_w = {n: a for n, a in stacked.items() if n in proj and isinstance(a, ql.PackedFloatWeight)}
    sliced_w = {n: a for n, a in stacked.items() if n in proj and n not in packed_w}

    @jax.jit
    def _matmuls(sliced, packed, x, positions):
        fm = None if model.float_matmul is None else model.float_matmul.live(live_count(positions))

        def body(x, xs):
            w, idx = xs
            w = {**w, **{n: dataclasses.replace(a, layer=idx) for n, a in packed.items()}}
            q, k, v = ql.einsums(("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh"), x, (w["wq"], w["wk"], w["wv"]),
                                 matmul=mm, float_matmul=fm)
            o = ql.einsum("btnh,nhd->btd", q, w["wo"], matmul=mm, float_matmul=fm)
            d = layers.gated_mlp(x, w["w_gate"], w["w_up"], w["w_down"], cfg.hidden_act, matmul=mm,
                                 float_matmul=fm)
            return x + 1e-3 * (o + d + k.sum() + v.sum()), None
        return jax.lax.scan(body, x, (sliced, jnp.arange(L, dtype=jnp.int32)))[0]

    def matmuls():
        jax.block_until_ready(_matmuls(sliced_w, packed_w, x, dev_inputs.positions))

    hs = jax.random.normal(key, (1, S, D), jnp.float32)

    @jax.jit
    def _head(state, h):
        return nnx.merge(runner._graphdef, state).head(h)[0]

    def head():
        jax.block_until_ready(_head(runner._state, hs))

    logits = _head(runner._state, hs)
    _sample = jax.jit(sample)

    def sampler():
        jax.block_until_ready(_sample(logits, dev_inputs.sampling))

    res = timed_rounds(dict(step=step, host=host, attention=attention, kv_read=kv_read, kv_write=kv_write,
                            no_attn=no_attn, matmuls=matmuls, head=head, sampler=sampler), reps)

    # Compulsory bytes of each part.
    from jaxserve.model.llama import flat_params
    params = flat_params(lm.model, unpack=False)  # as stored: packed weights' own bytes
    nbytes = {k: sum(x.nbytes for x in jax.tree.leaves(v)) for k, v in params.items()}
    mat = sum(nbytes["layers." + k] for k in proj)
    layer_bytes = sum(b for k, b in nbytes.items() if k.startswith("layers."))
    head_bytes = nbytes["embed"] if cfg.tie_word_embeddings else nbytes["lm_head"]
    cache_leaves = jax.tree.leaves(runner.cache)
    per_pos = sum(x.nbytes for x in cache_leaves) / (runner.sched.num_pages * ps)  # all layers, K and V
    kv_read_bytes = per_pos * sum(c + 1 for c in contexts)
    kv_write_bytes = per_pos * rows
    weights = layer_bytes + head_bytes
    part_bytes = dict(step=weights + kv_read_bytes + kv_write_bytes, host=0, attention=kv_read_bytes + kv_write_bytes,
                      kv_read=kv_read_bytes, kv_write=kv_write_bytes, no_attn=layer_bytes, matmuls=mat,
                      head=head_bytes, sampler=4 * S * cfg.vocab_size)
    step_ms = res["step"][0]
    rest = step_ms - (res["attention"][0] + res["no_attn"][0] + res["head"][0] + res["sampler"][0])
    out = {"rows": rows, "bucket": T, "contexts_mean": round(float(np.mean(contexts))), "parts": {}}
    for k, (med, lo, hi) in res.items():
        out["parts"][k] = {"ms": round(med, 2), "min": round(lo, 2), "max": round(hi, 2),
                           "share": round(med / step_ms, 3),
                           "gbs": round(part_bytes[k] / (med * 1e-3) / 1e9, 2) if part_bytes[k] else None}
    out["parts"]["rest"] = {"ms": round(rest, 2), "share": round(rest / step_ms, 3), "gbs": None}
    out["step_bytes_mb"] = round(part_bytes["step"] / 1e6, 1)
    out["load"] = round(os.getloadavg()[0], 1)
    if hlo_ops:
        out["hlo_ops"] = hlo_op_times(step, hlo_ops)
    return out


LABELS = (("step", "step (compiled executable)"), ("host", "host: build_inputs + transfers"),
          ("attention", "attention: KV write + attend, all layers"), ("kv_read", "  kv read (attention kernel alone)"),
          ("kv_write", "  kv write (scatter alone)"), ("no_attn", "layers without attention"),
          ("matmuls", "  the 7 projections alone"), ("head", "LM head [S,D]x[D,V]"),
          ("sampler", "sampler (greedy)"), ("rest", "rest (step - the four parts above)"))


def format_table(r: dict) -> str:
    lines = [f"rows {r['rows']} (bucket {r['bucket']}, mean context {r['contexts_mean']}, "
             f"compulsory bytes {r['step_bytes_mb']:.0f} MB, load {r['load']})",
             f"  {'part':<42} {'ms':>8} {'share':>6} {'GB/s':>6}"]
    for k, label in LABELS:
        p = r["parts"][k]
        gbs = f"{p['gbs']:6.1f}" if p["gbs"] else "     -"
        lines.append(f"  {label:<42} {p['ms']:8.2f} {p['share']:6.2f} {gbs}")
    if r.get("hlo_ops"):
        lines.append("  costliest HLO ops of the step (ms per step over XLA's threads, calls per step):")
        lines += [f"    {ms:8.2f} ms {n:6d}x  {name}" for name, ms, n in r["hlo_ops"]]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if a.hlo_ops:
        if "jax" in sys.modules and not os.environ.get("XLA_FLAGS", "").count("xprof_traceme"):
            raise SystemExit("profile_decode: --hlo-ops must set XLA_FLAGS before jax starts; run it as a script")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    from jaxserve import loading
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine

    lm = loading.load(a.model, "float32", matmul_impl=a.matmul_impl)
    rng = np.random.default_rng(a.seed)
    plans = {r: rng.integers(a.context_min, a.context_max + 1, r).tolist() for r in a.rows}
    ps = 16
    # The default engine's buckets for these row counts, so each runs in the bucket the default
    # engine gives it, with the same S = min(bucket, max_num_seqs) rows (max_num_seqs and the
    # token budget set to the largest of these buckets: no other bucket is compiled); a pool
    # that holds the largest plan.
    default = EngineConfig().buckets()
    buckets = sorted({next(b for b in default if b >= r) for r in a.rows})
    need = max(sum(c // ps + 1 for c in ctx) for ctx in plans.values()) + 2
    cfg = EngineConfig(page_size=ps, num_pages=need, attention_impl=a.attention_impl, max_num_seqs=buckets[-1],
                       max_num_batched_tokens=buckets[-1], token_buckets=tuple(buckets))
    e = Engine(lm.model, lm.tokenizer, cfg, ())
    e.warmup(progress=False)
    out = []
    for r in a.rows:
        res = profile_rows(lm, e.runner, r, plans[r], a.reps, a.hlo_ops)
        print(format_table(res), flush=True)
        out.append(res)
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
