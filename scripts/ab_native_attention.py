"""A/B of attention_impl "xla" against "cpu_native" on batched decode steps of the whole engine:
the measurement behind sharding/ops.py's AUTO_PREFERS_NATIVE.

For each batch B: two engines on the same loaded model (one per implementation, prefix caching
off), B requests of --prompt-tokens random ids decoding --decode tokens each (ignore_eos). Each
rep gives both engines the same fresh prompts, in alternating order (ABAB), and records the
wall and process CPU time of every decode step (the steps after the prefill); a rep's figure
is its median step, the result the median over reps. The machine's load average is printed
with each rep: on a shared machine, compare pairs, not single numbers.

  python scripts/ab_native_attention.py --batches 8,32,64 --reps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

IMPLS = ("xla", "cpu_native")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    p.add_argument("--batches", default="8,32,64", help="comma-separated batch sizes")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--decode", type=int, default=16, help="tokens each request decodes (>= 4)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    if a.decode < 4:
        p.error(f"--decode must be >= 4, got {a.decode}")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    from jaxserve import loading
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.types import SamplingParams

    lm = loading.load(a.model, "float32")
    vocab = lm.config.vocab_size

    def engine(impl: str, B: int) -> Engine:
        cfg = EngineConfig(max_model_len=a.prompt_tokens + a.decode + 16, page_size=16, max_num_seqs=B,
                           max_num_batched_tokens=512, token_buckets=tuple(sorted({B, 512})),
                           attention_impl=impl, enable_prefix_caching=False)
        e = Engine(lm.model, lm.tokenizer, cfg, ())
        e.warmup(progress=False)
        return e

    def decode_steps(e: Engine, prompts) -> list[tuple[float, float]]:
        for p in prompts:
            e.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=a.decode, ignore_eos=True))
        steps = []
        while e.has_unfinished():
            t, c = time.perf_counter(), time.process_time()
            e.step()
            steps.append((time.perf_counter() - t, time.process_time() - c))
        # The first token comes from the prefill; the last decode - 2 steps are B-row decodes
        # whatever the prefill took (B * prompt_tokens <= 512 tokens a step, or more steps).
        return steps[-(a.decode - 2):]

    rows = []
    for B in a.batches:
        engines = {impl: engine(impl, B) for impl in IMPLS}
        wall = {impl: [] for impl in IMPLS}
        cpu = {impl: [] for impl in IMPLS}
        loads = []
        for r in range(a.reps):
            rng = np.random.default_rng(100 + r)
            prompts = [rng.integers(3, vocab, a.prompt_tokens).tolist() for _ in range(B)]
            for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
                steps = decode_steps(engines[impl], prompts)
                wall[impl].append(statistics.median(w for w, _ in steps) * 1e3)
                cpu[impl].append(statistics.median(c for _, c in steps) * 1e3)
            loads.append(os.getloadavg()[0])
        med = {k: {impl: statistics.median(v[impl]) for impl in IMPLS} for k, v in (("wall", wall), ("cpu", cpu))}
        row = dict(batch=B, wall_ms_xla=round(med["wall"]["xla"], 1),
                   wall_ms_native=round(med["wall"]["cpu_native"], 1),
                   xla_over_native=round(med["wall"]["xla"] / med["wall"]["cpu_native"], 3),
                   cpu_ms_xla=round(med["cpu"]["xla"], 1), cpu_ms_native=round(med["cpu"]["cpu_native"], 1),
                   wall_reps={impl: [round(x, 1) for x in wall[impl]] for impl in IMPLS},
                   load=[round(x, 1) for x in loads])
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engines
    return rows


if __name__ == "__main__":
    main()
