"""Batch-1 greedy decode speed of the dense path and of the paged engine, with the
memory-bandwidth ceiling it implies.

A decode step must read every weight (and the KV cache it attends to) once, so on a
memory-bound machine tokens/s <= read bandwidth / bytes per step. The bandwidth is measured in
the same run, so the ceiling is this machine's, today, by bench_offline's probe
(scripts/step_roofline.py: the best of XLA's streaming sum and matrix-vector product over
256 MiB, on every core as the engine's step runs). Until 2026-12-07 it was numpy's one-thread
sum, which on a 2-core Intel Xeon read 17 GB/s where both cores read 30: the engine then ran at
140% of its "ceiling".

  python scripts/bench_generate.py [--model PATH] [--dtype float32|bfloat16] [--new-tokens 64]
      [--quantize none|int8|int4|as-shipped] [--quantize-sweep] [every engine flag: --attention-impl,
      --page-size, --kv-cache-dtype, --tp, ...]

The engine flags configure the paged engine's half (the dense half has none to configure); its
defaults are a batch-1 configuration: --max-num-seqs 1 --max-num-batched-tokens 64
--token-buckets 1,N (N = --max-num-batched-tokens), and --max-model-len min(1024, the model's
context).

Weights count at the bytes they are stored in: a quantized weight's int8 / packed int4 data
plus its scales and zeros (QuantizedWeight.nbytes). Each run prints one row; --quantize-sweep
runs fp32, bf16, int8 and int4 (as shipped for a GGUF, else int4 at load) in turn, measuring
the bandwidth once. Last line: RESULT {json} (one run's figures; with the sweep {"rows": [...]}).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve import loading  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.build import build_engine, size_kv_pool
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.engine.dense_generator import DenseGenerator, GenerationStats  # noqa: E402
from jaxserve.model.llama import flat_params  # noqa: E402
from jaxserve import flags  # noqa: E402
from jaxserve.config import LoadConfig  # noqa: E402
from jaxserve.types import SamplingParams  # noqa: E402

PROMPT = "Once upon a time, there was a little"


def bytes_per_decode_step(lm, context_len: int, cache_len: int) -> dict:
    import jax
    cfg = lm.config
    itemsize = np.dtype(lm.model.dtype).itemsize
    # As stored: quantized weights count their q / scale / zero bytes, packed ones their packed data.
    weights = sum(x.nbytes for w in flat_params(lm.model, unpack=False).values() for x in jax.tree.leaves(w))
    # The dense path attends over its whole bucketed cache every step (masked), so it reads
    # cache_len slots; an ideal engine reads only the context_len slots in use.
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    return {"weights": weights, "kv_read_dense": kv_per_token * cache_len,
            "kv_read_ideal": kv_per_token * context_len}


BATCH1_DEFAULTS = {"max_num_seqs": 1, "max_num_batched_tokens": 64}


def paged_engine(lm, load: LoadConfig, config: EngineConfig) -> Engine:
    """The paged engine for `config` on the dense half's model (one device), or with --tp > 1
    its own load split over the mesh (the dense half keeps its one-device copy)."""
    if config.max_model_len is None:
        config = dataclasses.replace(config, max_model_len=min(1024, lm.config.max_position_embeddings))
    if config.token_buckets is None:  # batch 1: a decode bucket and one prefill bucket, the budget
        config = dataclasses.replace(config, token_buckets=(1, config.max_num_batched_tokens))
    if config.tp > 1:
        return build_engine(load, config, local_devices=True)[1]
    config, _ = size_kv_pool(config, lm.model, None)
    return Engine(lm.model, lm.tokenizer, config, lm.eos_token_ids)


def run(args, dtype: str, options: dict, bw: float, config: EngineConfig) -> dict:
    """Load the model as asked, measure the dense path and the engine at batch 1: one row."""
    lm = loading.load(args.model, dtype, **options)
    prompt_ids = lm.tokenizer.encode(PROMPT)
    gen = DenseGenerator(lm.model, lm.eos_token_ids)
    compile_s = gen.warmup(len(prompt_ids), args.new_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    # The paged engine: the same prompt alone, ids straight in (its flags' batch-1 defaults).
    eng = paged_engine(lm, LoadConfig(model=args.model, dtype=dtype, **options), config)
    engine_compile_s = eng.warmup(progress=False)
    engine_tok_s = 0.0
    for _ in range(args.repeats):
        eng.add_request({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True))
        eng.step()  # prefill + first token
        t0 = time.perf_counter()
        n = 0
        while eng.has_unfinished():
            n += sum(len(d.token_ids) for d in eng.step())
        engine_tok_s = max(engine_tok_s, n / (time.perf_counter() - t0))
    # Read now: the counter is process-wide and the dense path below compiles its own buckets.
    engine_compiles_after_warmup = eng.compiles_after_warmup

    runs = []
    for _ in range(args.repeats):
        st = GenerationStats()
        for _ in gen.generate(prompt_ids, params, st):
            pass
        runs.append(st)
    best = max(runs, key=lambda s: s.decode_tok_s)
    from jaxserve.engine.dense_generator import CACHE_BUCKETS, pick_bucket
    cache_len = pick_bucket(CACHE_BUCKETS, len(prompt_ids) + args.new_tokens)
    b = bytes_per_decode_step(lm, len(prompt_ids) + args.new_tokens // 2, cache_len)
    step_bytes = b["weights"] + b["kv_read_dense"]
    ceiling = bw / step_bytes
    engine_ceiling = bw / (b["weights"] + b["kv_read_ideal"])
    return {
        "model": str(lm.source.name), "dtype": str(lm.model.dtype), "quantize": lm.quantize, "weights": lm.weights,
        "weights_mb": round(b["weights"] / 1e6, 1), "path": "dense",
        "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
        "load_s": round(lm.load_s, 2), "compile_s": round(compile_s, 2),
        "ttft_ms": round(best.ttft_s * 1e3, 1), "decode_tok_s": round(best.decode_tok_s, 2),
        "read_bandwidth_gb_s": round(bw / 1e9, 2), "bytes_per_step_mb": round(step_bytes / 1e6, 1),
        "bandwidth_ceiling_tok_s": round(ceiling, 2),
        "fraction_of_bandwidth_ceiling": round(best.decode_tok_s / ceiling, 3),
        "compilations": gen.num_compilations,
        "engine_decode_tok_s": round(engine_tok_s, 2), "engine_compile_s": round(engine_compile_s, 2),
        "engine_bandwidth_ceiling_tok_s": round(engine_ceiling, 2),
        "engine_fraction_of_bandwidth_ceiling": round(engine_tok_s / engine_ceiling, 3),
        "engine_compiles_after_warmup": engine_compiles_after_warmup,
        "engine_config": {k: getattr(eng.config, k) for k in ("attention_impl", "kv_cache_dtype", "tp",
                                                               "page_size", "max_num_seqs", "token_buckets")},
    }


def sweep(model: str | None) -> list[tuple[str, str]]:
    """(dtype, quantize) of the sweep's rows: fp32, bf16, int8, and int4 as the checkpoint ships
    it (a GGUF) or quantized at load (any other model)."""
    import checkpoints
    gguf = checkpoints.resolve_model_path(model).suffix == ".gguf"
    return [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"),
            ("float32", "as-shipped" if gguf else "int4")]


def print_row(r: dict) -> None:
    label = r["dtype"] if r["quantize"] == "none" else f"{r['quantize']} ({r['dtype']} activations)"
    print(f"{label}: {r['weights_mb']} MB of weights; dense batch-1 decode {r['decode_tok_s']} tok/s "
          f"(ceiling {r['bandwidth_ceiling_tok_s']} tok/s at {r['read_bandwidth_gb_s']} GB/s, "
          f"{r['fraction_of_bandwidth_ceiling']:.0%}); engine {r['engine_decode_tok_s']} tok/s "
          f"(ceiling {r['engine_bandwidth_ceiling_tok_s']} tok/s, {r['engine_fraction_of_bandwidth_ceiling']:.0%}); "
          f"TTFT {r['ttft_ms']} ms; load {r['load_s']} s; compile {r['compile_s']} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flags(ap, LoadConfig, "model (LoadConfig)")
    flags.add_flags(ap, EngineConfig, "the paged engine's half (EngineConfig; batch-1 defaults: "
                                      "--max-num-seqs 1 --max-num-batched-tokens 64 --token-buckets 1,N)")
    ap.set_defaults(**BATCH1_DEFAULTS)
    flags.add_log_flags(ap)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quantize-sweep", action="store_true",
                    help="one row each for fp32, bf16, int8 and int4 (ignores --dtype, --quantize and its group size)")
    args = ap.parse_args()
    flags.setup_logging(args.log_level)
    load, config = flags.engine_configs_or_exit(args, "bench_generate")
    from step_roofline import measure_read_bandwidth
    bw = measure_read_bandwidth()["read_gbs"] * 1e9
    if not args.quantize_sweep:
        r = run(args, load.dtype, dict(quantize=load.quantize, quantize_group_size=load.quantize_group_size,
                                       quant_impl=load.quant_impl), bw, config)
        print_row(r)
        print("RESULT " + json.dumps(r))
        return
    rows = []
    for dtype, mode in sweep(args.model):
        rows.append(run(args, dtype, dict(quantize=mode, quant_impl=args.quant_impl if mode != "none" else "auto"), bw,
                        config))
        print_row(rows[-1])
    print("RESULT " + json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
