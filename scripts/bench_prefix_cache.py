"""Prefix caching on vs off on the real model, side by side: multi-turn chat, a shared system
prompt, and all-distinct prompts (the overhead when nothing is shared).

  python scripts/bench_prefix_cache.py [--scenarios chat,system,distinct]
      [--conversations 4 --turns 6 --answer-tokens 48]
      [--system-tokens 1500 --system-requests 16 --system-answer-tokens 8]
      [--distinct-requests 16 --distinct-prompt-tokens 300 --distinct-output-tokens 16 --reps 2]
      [--model PATH --dtype float32 --quantize ...] [--max-num-seqs 8 --token-buckets 8,32,128,512 ...]

Text is natural text (scripts/natural_text.py's corpus: prose, documentation, Chinese) through
the model's chat template, greedy, so both sides produce the same answers and see the same
prompts. One model, two engines (enable_prefix_caching True / False) with the same shapes, warmed
up before anything is timed; the scenarios alternate between them.

  chat      N conversations of T turns run at once; each user turn quotes a passage (~150-250
            tokens) and asks about it, and a conversation's next turn is added the moment its
            previous answer ends (closed loop), so the history (all turns and answers) grows past
            1,000 tokens. TTFT per turn, p50 / p99.
  system    R requests sharing a system prompt of S tokens (reference notes from the corpus),
            each with a short question of its own, all admitted at once.
  distinct  R prompts that share no full page (each starts with its own header), all at once;
            run --reps times per side, alternating, each run on an emptied cache (a repeat
            would otherwise hit its previous run), to show the noise next to the overhead.

Per scenario and side: wall time, prompt tokens, prefill tokens computed (prompt tokens minus
the cached ones; preemptions are reported, since a preempted request recomputes more), output
tokens/s, TTFT p50 / p99, and the engine's prefix-cache hits. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = (
    "Can you explain the main point of this passage in two sentences?",
    "What is the most surprising detail here, and why?",
    "How does this connect to what we discussed earlier?",
    "Summarise this for a ten-year-old.",
    "What question would you ask the author of this passage?",
    "List three key facts from this passage.",
    "Which part of this would be hardest to explain to a visitor, and why?",
    "Give this passage a short title and explain your choice.",
)
TOPICS = ("printing", "bread", "lighthouses", "rivers", "bicycles", "bees", "maps", "glass",
          "the library", "tides", "clocks", "compost", "volcanoes", "orchestras", "salt", "paper",
          "migrating birds", "kitchen knives", "rain gardens", "photography", "bridges", "cheese",
          "canals", "forests")


def paragraphs() -> list[str]:
    """The benchmarks' shared corpus (scripts/natural_text.py), whitespace runs folded."""
    from natural_text import paragraphs as corpus
    return [" ".join(b.split()) for b in corpus()]


def percentile_ms(xs, q):
    import numpy as np
    xs = [x for x in xs if x is not None]
    return round(float(np.percentile(np.array(xs) * 1e3, q)), 1) if xs else None


class Side:
    """One engine and the figures of one scenario run on it."""

    def __init__(self, engine, name: str):
        self.engine = engine
        self.name = name

    def reset_counters(self):
        self.stats0 = dict(self.engine.stats)
        self.cache0 = self.engine.prefix_cache_stats()
        self.outs = []
        self.t0 = time.perf_counter()

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t0
        eng = self.engine
        prompt = sum(len(o.prompt_token_ids) for o in self.outs)
        cached = sum(o.num_cached_tokens for o in self.outs)
        out_tokens = sum(len(c.token_ids) for o in self.outs for c in o.outputs)
        ttft = [o.metrics.ttft for o in self.outs]
        cache = eng.prefix_cache_stats()
        return {
            "wall_s": round(wall, 2), "requests": len(self.outs), "prompt_tokens": prompt,
            "prefill_tokens_computed": prompt - cached, "output_tokens": out_tokens,
            "output_tok_s": round(out_tokens / wall, 2), "total_tok_s": round((prompt + out_tokens) / wall, 1),
            "requests_s": round(len(self.outs) / wall, 3),
            "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99),
            "cache_hit_tokens": cache["hits"] - self.cache0["hits"],
            "preemptions": eng.stats["preemptions"] - self.stats0["preemptions"],
            "steps": eng.stats["steps"] - self.stats0["steps"],
        }


def run_all_at_once(side: Side, prompts, params) -> dict:
    eng = side.engine
    side.reset_counters()
    ids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    side.outs = [eng.pop_finished(i) for i in ids]
    return side.summary() | {"_tokens": [[c.token_ids for c in o.outputs] for o in side.outs]}


def run_chat(side: Side, conversations: list[list[str]], params) -> dict:
    """Closed loop: each conversation's next user turn is added when its last answer ends."""
    eng = side.engine
    side.reset_counters()
    history = [[] for _ in conversations]
    turn = [0] * len(conversations)
    live: dict[str, int] = {}

    def ask(c: int) -> None:
        history[c].append({"role": "user", "content": conversations[c][turn[c]]})
        live[eng.add_request(list(history[c]), params)] = c

    for c in range(len(conversations)):
        ask(c)
    longest = 0
    tokens = {}
    while live:
        eng.step()
        for rid in [r for r in live if r in eng.finished_outputs]:
            c = live.pop(rid)
            out = eng.pop_finished(rid)
            side.outs.append(out)
            longest = max(longest, len(out.prompt_token_ids) + len(out.outputs[0].token_ids))
            history[c].append({"role": "assistant", "content": out.outputs[0].text})
            tokens[(c, turn[c])] = out.outputs[0].token_ids
            turn[c] += 1
            if turn[c] < len(conversations[c]):
                ask(c)
    s = side.summary()
    s["longest_history_tokens"] = longest
    s["_tokens"] = [tokens[k] for k in sorted(tokens)]
    return s


def build_conversations(paras, n: int, turns: int) -> list[list[str]]:
    convs = []
    for c in range(n):
        conv = []
        for t in range(turns):
            k = (c * 5 + t * 3) % len(paras)
            conv.append(f"Here is a passage from my notes:\n\n{paras[k]}\n\n{QUESTIONS[(c + t) % len(QUESTIONS)]}")
        convs.append(conv)
    return convs


def build_system_prompt(paras, tokenizer, target_tokens: int) -> str:
    head = ("You are the reference assistant of the Riverside Library. Answer visitors' questions "
            "briefly and only from the reference notes below; if the notes do not cover a "
            "question, say so.\n\nReference notes:\n\n")
    text, i = head, 0
    while len(tokenizer.encode(text)) < target_tokens:
        text += paras[i % len(paras)] + "\n\n"
        i += 1
    ids = tokenizer.encode(text)[:target_tokens]
    return tokenizer.decode(ids)


def build_distinct(paras, tokenizer, n: int, target_tokens: int) -> list[str]:
    out = []
    for i in range(n):
        # The header differs in the first tokens, so no two prompts share a full page.
        text = f"Archive note {i * 7919 % 10007}, filed under {TOPICS[i % len(TOPICS)]}:\n\n"
        j = i
        while len(tokenizer.encode(text)) < target_tokens:
            text += paras[(j * 5 + 1) % len(paras)] + "\n\n"
            j += 1
        out.append({"prompt_token_ids": tokenizer.encode(text)[:target_tokens]})
    return out


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="chat,system,distinct")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--system-requests", type=int, default=16, help="the issue's case: 64")
    ap.add_argument("--system-answer-tokens", type=int, default=8)
    ap.add_argument("--distinct-requests", type=int, default=16)
    ap.add_argument("--distinct-prompt-tokens", type=int, default=300)
    ap.add_argument("--distinct-output-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2, help="distinct: runs per side, alternating")
    ap.add_argument("--no-progress", action="store_true")
    # The engine flags every entry point takes (jaxserve/flags.py), with this benchmark's
    # defaults; prefix caching is what it compares, off against on, so that flag is its own.
    from jaxserve import flags
    flags.add_engine_flags(ap, exclude=("enable_prefix_caching",))
    flags.add_log_flags(ap)
    # Fine enough that a turn's new tokens do not pad to the whole budget (a 250-token suffix
    # runs as 256, not 512), coarse enough to compile in a minute or two.
    ap.set_defaults(max_model_len=2048, max_num_seqs=8, token_buckets=(8, 16, 32, 64, 128, 256, 384, 512),
                    kv_cache_bytes=768 * 2**20, seed=0)
    args = ap.parse_args(argv)
    flags.setup_logging(args.log_level)
    load, config = flags.engine_configs_or_exit(args, "bench_prefix_cache")

    import dataclasses

    from jaxserve import loading
    from jaxserve.engine.engine import Engine
    from jaxserve.types import SamplingParams

    lm = loading.load(load.model, load.dtype, quantize=load.quantize,
                      quantize_group_size=load.quantize_group_size, quant_impl=load.quant_impl)
    sides = {}
    for name, on in (("off", False), ("on", True)):
        cfg = dataclasses.replace(config, enable_prefix_caching=on)
        eng = Engine(lm.model, lm.tokenizer, cfg, lm.eos_token_ids)
        t = time.perf_counter()
        eng.warmup(progress=not args.no_progress)
        print(f"[{name}] warm-up {time.perf_counter() - t:.1f} s, {eng.scheduler_config.num_pages} pages",
              file=sys.stderr, flush=True)
        sides[name] = Side(eng, name)

    from jaxserve.engine import compile_watch
    compiles_warm = compile_watch.compiles()  # process-wide: both engines are warm now
    paras = paragraphs()
    tok = lm.tokenizer
    results: dict = {}
    scenarios = args.scenarios.split(",")
    if "chat" in scenarios:
        convs = build_conversations(paras, args.conversations, args.turns)
        params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
        results["chat"] = {name: run_chat(sides[name], convs, params) for name in ("off", "on")}
        print(f"chat done: {[r['wall_s'] for r in results['chat'].values()]} s", file=sys.stderr, flush=True)
    if "system" in scenarios:
        system = build_system_prompt(paras, tok, args.system_tokens)
        prompts = [[{"role": "system", "content": system},
                    {"role": "user", "content": f"Question {i + 1}: what do the notes say about "
                                                f"{TOPICS[i % len(TOPICS)]}?"}]
                   for i in range(args.system_requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.system_answer_tokens)
        results["system"] = {name: run_all_at_once(sides[name], prompts, params) for name in ("off", "on")}
        print(f"system done: {[r['wall_s'] for r in results['system'].values()]} s", file=sys.stderr, flush=True)
    if "distinct" in scenarios:
        prompts = build_distinct(paras, tok, args.distinct_requests, args.distinct_prompt_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=args.distinct_output_tokens, ignore_eos=True)
        runs = {"off": [], "on": []}
        for _ in range(args.reps):
            for name in ("off", "on"):
                # Empty cache each time: a repeat must not hit its own previous run's pages.
                sides[name].engine.reset_prefix_cache()
                runs[name].append(run_all_at_once(sides[name], prompts, params))
                print(f"[{name}] distinct run: {runs[name][-1]['total_tok_s']} tok/s", file=sys.stderr, flush=True)
        results["distinct"] = {name: {**max(r, key=lambda x: x["total_tok_s"]),
                                      "total_tok_s_runs": [x["total_tok_s"] for x in r]}
                               for name, r in runs.items()}
        for r in runs["on"][1:] + runs["off"][1:]:
            assert r["_tokens"] == runs["off"][0]["_tokens"], "distinct: outputs differ between runs"

    summary = {}
    for sc, r in results.items():
        off, on = r["off"], r["on"]
        same = off.pop("_tokens") == on.pop("_tokens")  # greedy: caching must not change a token
        print(f"\n== {sc}")
        keys = [k for k in off if not isinstance(off[k], list)] + [k for k in off if isinstance(off[k], list)]
        for k in keys:
            print(f"  {k:26s} off {off[k]!s:>14}   on {on[k]!s:>14}")
        summary[sc] = {
            "ttft_p50_speedup": ratio(off["ttft_p50_ms"], on["ttft_p50_ms"]),
            "ttft_p99_speedup": ratio(off["ttft_p99_ms"], on["ttft_p99_ms"]),
            "prefill_tokens_saved": round(1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"], 3),
            "throughput_ratio": ratio(on["total_tok_s"], off["total_tok_s"]),
            "output_throughput_ratio": ratio(on["output_tok_s"], off["output_tok_s"]),
            "same_outputs": same,
        }
        print("  " + json.dumps(summary[sc]))
    assert compile_watch.compiles() == compiles_warm, "compiled after warm-up"
    print("RESULT " + json.dumps({"summary": summary, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
