"""Structured outputs at scale: N seeded random JSON schemas (tests/json_schemas.py), one greedy
and one sampled output each, every output parsed and validated with jsonschema; plus the
per-token mask cost of llguidance and the decode throughput with and without a schema.

    python scripts/check_structured_outputs.py                # the tiny random model (seconds)
    python scripts/check_structured_outputs.py --smollm2      # the default model (minutes)

Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def build(smollm2: bool):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    kw = dict(max_model_len=256 if not smollm2 else 512, page_size=16, num_pages=512, max_num_seqs=16, max_num_batched_tokens=128,
              token_buckets=(16, 128), compilation_cache_dir=None)
    if smollm2:
        from jaxserve import loading
        lm = loading.load(None, "float32")
        eng = Engine(lm.model, lm.tokenizer, EngineConfig(**kw), lm.eos_token_ids)
    else:
        import checkpoints
        from conftest import byte_tokenizer
        from json_schemas import control_byte_eos
        model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "llama_mqa", "float32")
        eos = (control_byte_eos(),)
        eng = Engine(model, byte_tokenizer(eos), EngineConfig(**kw), eos)
    eng.warmup(progress=False)
    return eng


def run(eng, cases):
    ids = [eng.add_request(p, sp) for p, sp in cases]
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    outs = [eng.pop_finished(i).outputs[0] for i in ids]
    return outs, dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-schemas", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--smollm2", action="store_true")
    args = ap.parse_args()
    import jsonschema
    import numpy as np

    from json_schemas import schemas
    from jaxserve.types import SamplingParams, StructuredOutputsParams as SO
    eng = build(args.smollm2)
    tok = eng.tokenizer
    prompt = "Reply with JSON only:"
    cases, sch = [], schemas(args.num_schemas, seed=7)
    for i, s in enumerate(sch):
        sop = SO(json=json.dumps(s))
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=sop)))
        cases.append((prompt, SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                             structured_outputs=sop)))
    # Mask cost: time GrammarCompiler.fill inside the engine's step (wrapping the method).
    fills = []
    real_fill = eng.grammar.fill

    def timed_fill(m, out):
        t = time.perf_counter()
        real_fill(m, out)
        fills.append(time.perf_counter() - t)
    eng.grammar.fill = timed_fill
    outs, dt_grammar = run(eng, cases)
    ok = bad = 0
    for (_, sp), c in zip(cases, outs):
        ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        text = tok.decode(ids)
        try:
            jsonschema.validate(json.loads(text), json.loads(sp.structured_outputs.json))
            ok += 1
        except Exception as e:
            bad += 1
            print(f"FAIL ({c.finish_reason}): {text[:200]!r}: {type(e).__name__}: {str(e)[:200]}")
    gen_grammar = sum(len(c.token_ids) for c in outs)
    # The same number of requests and tokens without a grammar (ignore_eos, exactly as many tokens).
    per = max(1, gen_grammar // len(cases))
    free = [(prompt, SamplingParams(max_tokens=per, ignore_eos=True, temperature=t, seed=i))
            for i in range(len(cases) // 2) for t in (0.0, 1.0)]
    fouts, dt_free = run(eng, free)
    gen_free = sum(len(c.token_ids) for c in fouts)
    res = {"model": "smollm2" if args.smollm2 else "tiny", "schemas": len(sch), "outputs": len(cases),
           "valid": ok, "invalid": bad,
           "mask_ms_median": round(float(np.median(fills)) * 1e3, 4),
           "mask_ms_mean": round(float(np.mean(fills)) * 1e3, 4),
           "mask_ms_p99": round(float(np.percentile(fills, 99)) * 1e3, 4),
           "tok_s_with_schema": round(gen_grammar / dt_grammar, 1),
           "tok_s_without": round(gen_free / dt_free, 1),
           "compiles_after_warmup": eng.compiles_after_warmup}
    print("RESULT " + json.dumps(res))
    return 0 if bad == 0 and eng.compiles_after_warmup == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
