"""Offline throughput: a workload of fixed prompt / output lengths through the engine, optionally
side by side with HF transformers `generate()` in static batches.

  python scripts/bench_offline.py WORKLOAD.json [--max-requests N] [--prompt-seed 0] [--random-prompts]
      [--model PATH] [--dtype float32|bfloat16] [--quantize none|int8|int4|as-shipped]
      [engine options: --max-num-seqs 64 ...]
      [--compare-hf [--hf-python /work/goldens-venv/bin/python] [--hf-model HF_DIR]]

WORKLOAD.json is shaped like shared/workloads/offline-mixed-48.json: {"requests": [{"prompt_tokens":
P, "output_tokens": O}, ...]}. By default each request is a chat-templated natural-text request
of about P tokens (scripts/natural_text.py: a task such as "summarise" over English prose,
documentation or Chinese from the project's own corpus), greedy, with max_tokens = O and EOS
respected: a request ends where the model ends its answer, as real traffic does. Each opens
with its own label (natural_text.prompt_label), so the prefix cache can share only the chat
template's preamble (the model's default system prompt) between requests, never their text.
--random-prompts runs the old workload instead: seeded random token ids of exactly P tokens,
exactly O tokens each (ignore_eos). Greedy decoding of random ids tends to loop, and n-gram
speculation copies the loop, so drafts are kept far more often than on real text: that mode
flatters speculation and is kept only to compare with earlier figures.
All requests are admitted at once (LLM.generate).

Figures, after warm-up (every bucket compiled, plus one short generate):
  useful_tok_s       tokens generated / wall time of the generate call
  roofline           per bucket: steps, time, real tokens, achieved GFLOP/s and GB/s; and the
                     run's fraction of the step roofline (scripts/step_roofline.py: per step
                     max(FLOPs / GEMM peak, bytes / read bandwidth), both measured in this
                     process before and after the run (the best of each), summed, over the
                     wall time)
  padding_fraction   padded / computed tokens over the run's steps (engine.stats)
  compiles_after_warmup, peak host memory (VmHWM: since the model load began, jaxserve/host_memory.py)
  and the load's own peak (load_peak_rss_mib), TTFT / TPOT / e2e p50 p95 p99
With --compare-hf, HF transformers runs the same prompt token ids in file order in static batches
of 16 (left-padded, greedy, max_new_tokens = the batch's longest output; with --random-prompts also
min_new_tokens, so every row runs to the batch's length; otherwise a batch runs until every row
has ended on EOS or reached the batch's length) and counts as useful only each request's own
tokens: up to its output_tokens and its first EOS (included, as jaxserve counts it). It runs
in a subprocess of --hf-python (default: this interpreter, which must then import transformers);
the HF model is --hf-model or the `jaxserve convert` of the model into a temporary folder.

Last line: RESULT {json} with useful_tok_s, padding_fraction, compiles_after_warmup (and
hf_useful_tok_s, ratio_vs_hf when compared).
"""

# Only the standard library at module level: the --hf-worker half runs under another
# interpreter (a torch + transformers venv) that has neither jax nor jaxserve.

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_workload(path: Path, max_requests: int | None) -> list[dict]:
    reqs = json.loads(path.read_text())["requests"]
    if max_requests is not None:
        reqs = reqs[:max_requests]
    for i, r in enumerate(reqs):
        for k in ("prompt_tokens", "output_tokens"):
            v = r.get(k)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise SystemExit(f"bench_offline: {path}: request {i}: {k} must be an integer >= 1, got {v!r}")
    if not reqs:
        raise SystemExit(f"bench_offline: {path}: no requests")
    return reqs


def make_prompts(reqs: list[dict], vocab_size: int, seed: int) -> list[list[int]]:
    """--random-prompts: seeded random ids (see the module docstring for why not by default)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=r["prompt_tokens"]).tolist() for r in reqs]


def make_chat_prompts(reqs: list[dict], engine, seed: int) -> list[list[int]]:
    """Natural-text chat requests of about each prompt_tokens, as the token ids the engine
    would make of them (chat template with the generation prompt), so HF gets the same ids."""
    from natural_text import chat_prompts
    msgs = chat_prompts(engine.tokenizer, [r["prompt_tokens"] for r in reqs], seed)
    return [engine.tokenize_prompt(m)[1] for m in msgs]


def percentiles_ms(xs: list[float | None]) -> dict:
    import numpy as np
    v = np.array([x for x in xs if x is not None], np.float64) * 1e3
    if not len(v):
        return {}
    return {f"p{q}": round(float(np.percentile(v, q)), 1) for q in (50, 95, 99)}


def peak_rss_mib() -> float:
    """This process's peak resident memory. /proc's VmHWM starts afresh at exec; ru_maxrss would
    carry a forking parent's resident set into a child's figure."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (1024 * 1024 if sys.platform == "darwin" else 1024)


# ---- the jaxserve half ----------------------------------------------------------------------

def bench_engine(llm, reqs: list[dict], prompts: list[list[int]], progress: bool, ignore_eos: bool,
                 peaks: dict, temperature: float = 0.0) -> dict:
    from step_roofline import StepRecorder, best_peaks, format_table, measure_peaks

    from jaxserve.types import SamplingParams
    eng = llm.engine
    # Warm-up beyond the AOT compiles: one short request runs the prefill and decode paths once.
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    before = dict(eng.stats)
    pos_before = {k: list(v) for k, v in eng.spec_positions.items()}
    # Sampled runs seed request i with i: the same figures on a rerun.
    params = [SamplingParams(max_tokens=r["output_tokens"], ignore_eos=ignore_eos, temperature=temperature,
                             seed=i if temperature > 0 else None) for i, r in enumerate(reqs)]
    rec = StepRecorder(eng, llm.loaded.model)
    t0 = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
    finally:
        rec.stop()
    wall = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    for i, (r, got) in enumerate(zip(reqs, lengths)):
        if got > r["output_tokens"] or (ignore_eos and got != r["output_tokens"]):
            raise RuntimeError(f"request {i} generated {got} tokens, expected "
                               f"{'exactly' if ignore_eos else 'at most'} {r['output_tokens']}")
    d = {k: eng.stats[k] - before[k] for k in eng.stats}
    drafted, kept = ([a - b for a, b in zip(eng.spec_positions[k], pos_before[k])] for k in ("drafted", "accepted"))
    useful = sum(lengths)
    compiles = eng.compiles_after_warmup  # before the second probe (its executables are cached anyway)
    roofline = rec.summary(best_peaks(peaks, measure_peaks()), wall)
    print(format_table(roofline), file=sys.stderr if not progress else sys.stdout, flush=True)
    return {
        "requests": len(reqs),
        "prompt_tokens": sum(map(len, prompts)),
        "useful_tokens": useful,
        "output_lengths": lengths,
        "ended_on_eos": sum(o.outputs[0].finish_reason == "stop" for o in outs),
        "roofline": roofline,
        "roofline_fraction": roofline["roofline_fraction"],
        "wall_s": round(wall, 3),
        "useful_tok_s": round(useful / wall, 2),
        "padding_fraction": round(d["padded_tokens"] / d["computed_tokens"], 4) if d["computed_tokens"] else 0.0,
        "compiles_after_warmup": compiles,
        "steps": d["steps"],
        "computed_tokens": d["computed_tokens"],
        "padded_tokens": d["padded_tokens"],
        "preemptions": d["preemptions"],
        "num_speculative_tokens": eng.scheduler_config.num_speculative_tokens,
        "draft_tokens": d["draft_tokens"],
        "draft_acceptance": round(d["accepted_draft_tokens"] / d["draft_tokens"], 3) if d["draft_tokens"] else None,
        "draft_method": _draft_method(eng),
        "acceptance_per_position": [round(a / n, 3) if n else None for a, n in zip(kept, drafted)],
        "mean_accepted_length": round(1 + d["accepted_draft_tokens"] / d["drafts"], 3) if d["drafts"] else None,
        "warmup_s": round(llm.warmup_s, 1),
        "ttft_ms": percentiles_ms([o.metrics.ttft for o in outs]),
        "tpot_ms": percentiles_ms([o.metrics.tpot(len(o.outputs[0].token_ids)) for o in outs]),
        "e2e_ms": percentiles_ms([o.metrics.e2e for o in outs]),
        "queue_ms": percentiles_ms([o.metrics.queue_time for o in outs]),
        "first8": [o.outputs[0].token_ids[:8] for o in outs],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }


def _draft_method(eng) -> str:
    sc = eng.scheduler_config
    if sc.speculative_layers:
        return f"self-draft, first {sc.speculative_layers} layers"
    return "draft model" if sc.model_drafts else "n-gram"


# ---- the HF half (runs under --hf-python) ---------------------------------------------------

def hf_worker(spec_path: Path) -> None:
    """Prints HF_RESULT {json}. spec: {"model_dir", "prompts", "outputs", "batch_size", "ignore_eos"}."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(spec_path.read_text())
    t_load = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], torch_dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t_load
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0
    prompts, outputs, B = spec["prompts"], spec["outputs"], spec["batch_size"]
    ignore_eos = spec.get("ignore_eos", True)
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    gen_s, first8, batches, own = 0.0, [], [], []
    for s in range(0, len(prompts), B):
        ps, os_ = prompts[s:s + B], outputs[s:s + B]
        P, M = max(map(len, ps)), max(os_)
        ids = torch.full((len(ps), P), pad, dtype=torch.long)
        mask = torch.zeros((len(ps), P), dtype=torch.long)
        for i, p in enumerate(ps):  # left padding: every row's last prompt token at column P-1
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            extra = {"min_new_tokens": M} if ignore_eos else {}
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=M,
                                 pad_token_id=pad, **extra)
        dt = time.perf_counter() - t0
        gen_s += dt
        if ignore_eos and out.shape[1] - P != M:
            raise RuntimeError(f"HF batch at {s} generated {out.shape[1] - P} tokens, expected {M}")
        for i in range(len(ps)):
            row = out[i, P:P + os_[i]].tolist()
            if not ignore_eos:  # the request's own tokens end at its first EOS (kept, as jaxserve does)
                cut = next((j for j, t in enumerate(row) if t in eos_ids), None)
                row = row if cut is None else row[:cut + 1]
            own.append(row)
        first8 += [out[i, P:P + 8].tolist() for i in range(len(ps))]
        batches.append({"rows": len(ps), "max_prompt": P, "max_output": M, "seconds": round(dt, 2)})
        print(f"HF batch {s // B + 1}/{-(-len(prompts) // B)}: {len(ps)} rows, prompt {P}, "
              f"{M} new tokens, {dt:.1f} s", file=sys.stderr, flush=True)
    useful = sum(map(len, own))
    print("HF_RESULT " + json.dumps({"hf_useful_tokens": useful, "outputs": own,
        "hf_useful_tok_s": round(useful / gen_s, 2), "hf_wall_s": round(gen_s, 1), "hf_load_s": round(load_s, 1),
        "hf_peak_rss_mib": round(peak_rss_mib(), 1), "hf_batches": batches, "first8": first8,
        "hf_torch": torch.__version__}), flush=True)


def hf_model_dir(args, tmp: Path) -> Path:
    if args.hf_model is not None:
        return args.hf_model
    if args.model is not None and Path(args.model).is_dir():
        return Path(args.model)  # already an HF folder
    import checkpoints
    from checkpoints.convert import write_hf_weights
    from checkpoints.gguf_loader import GGUFCheckpoint
    from jaxserve.tokenizer import Tokenizer
    ckpt = GGUFCheckpoint(checkpoints.resolve_model_path(args.model))
    out = write_hf_weights(ckpt, tmp / "hf")
    Tokenizer.from_gguf_metadata(ckpt.metadata).save_hf_folder(out)
    return out


def check_hf_python(python: str) -> None:
    r = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_offline: --compare-hf needs torch and transformers, and {python} cannot "
                         f"import them ({r.stderr.strip().splitlines()[-1:]}); pass --hf-python PATH to "
                         f"an interpreter that can (for example /work/goldens-venv/bin/python)")


def run_hf(args, reqs: list[dict], prompts: list[list[int]]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_offline_") as tmp:
        tmp = Path(tmp)
        model_dir = hf_model_dir(args, tmp)
        spec = tmp / "spec.json"
        spec.write_text(json.dumps({"model_dir": str(model_dir), "prompts": prompts,
                                    "outputs": [r["output_tokens"] for r in reqs],
                                    "batch_size": args.hf_batch_size,
                                    "ignore_eos": args.random_prompts}))
        proc = subprocess.run([args.hf_python, str(Path(__file__).resolve()), "--hf-worker", str(spec)],
                              stdout=subprocess.PIPE, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("HF_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_offline: the HF run failed (exit {proc.returncode}); "
                         f"its output:\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1][len("HF_RESULT "):])


# ---- main -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--hf-worker"]:
        hf_worker(Path(argv[1]))
        return 0

    sys.path.insert(0, str(ROOT))
    from jaxserve import flags
    from jaxserve.types import InvalidRequestError, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", type=Path, help="JSON with a 'requests' list of {prompt_tokens, output_tokens}")
    ap.add_argument("--max-requests", type=int, default=None, help="run only the first N requests")
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompts (text choice, or random ids)")
    ap.add_argument("--random-prompts", action="store_true",
                    help="seeded random token ids of exactly prompt_tokens, exactly output_tokens each "
                         "(ignore_eos), as before natural text was the default. This flatters speculative "
                         "decoding: greedy decoding of random ids loops and n-gram drafts copy the loop, "
                         "so drafts are kept far more often than on real text; use it only to compare "
                         "with old figures")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0 = greedy, the default); request i has seed i")
    ap.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate()")
    ap.add_argument("--hf-python", default=sys.executable,
                    help="interpreter with torch + transformers for the HF half (default: this one)")
    ap.add_argument("--hf-model", type=Path, default=None,
                    help="HF folder for the HF half (default: `jaxserve convert` of --model into a temp dir)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--no-progress", action="store_true")
    flags.add_engine_flags(ap)
    flags.add_log_flags(ap)
    args = ap.parse_args(argv)
    flags.setup_logging(args.log_level)
    flags.engine_configs_or_exit(args, "bench_offline")  # every config check, before jax starts
    if args.max_requests is not None and args.max_requests < 1:
        ap.error("--max-requests must be >= 1")
    try:  # SamplingParams' own bounds, checked before anything loads
        SamplingParams(temperature=args.temperature)
    except InvalidRequestError as e:
        ap.error(f"--temperature: {e}")
    if args.compare_hf and args.temperature > 0:
        ap.error("--compare-hf compares greedy outputs token for token: it needs --temperature 0")
    reqs = load_workload(args.workload, args.max_requests)
    if args.compare_hf:
        check_hf_python(args.hf_python)  # fail before the long part, not after it

    # The roofline's peaks, measured before the engine's warm-up so their compilations are not
    # counted as the engine's after it.
    from step_roofline import measure_peaks
    peaks = measure_peaks()
    from jaxserve.engine.build import build_llm
    llm = build_llm(args, "bench_offline")
    if args.random_prompts:
        prompts = make_prompts(reqs, llm.loaded.config.vocab_size, args.prompt_seed)
    else:
        prompts = make_chat_prompts(reqs, llm.engine, args.prompt_seed)
    r = {"prompts": "random ids, ignore_eos" if args.random_prompts else "natural-text chat, EOS respected",
         "temperature": args.temperature,
         "dtype": str(llm.loaded.model.dtype), "quantize": llm.loaded.quantize, "weights": llm.loaded.weights}
    r.update(bench_engine(llm, reqs, prompts, progress=not args.no_progress, ignore_eos=args.random_prompts,
                          peaks=peaks, temperature=args.temperature))
    r["peak_rss_mib"] = round(peak_rss_mib(), 1)
    r["load_peak_rss_mib"] = round(llm.loaded.load_memory.peak_bytes / 2**20, 1)
    first8 = r.pop("first8")
    outputs = r.pop("outputs")
    print(f"workload {args.workload.name} ({r['prompts']}): {r['requests']} requests, {r['prompt_tokens']} "
          f"prompt tokens, {r['useful_tokens']} output tokens ({r['ended_on_eos']} ended on EOS), temperature {args.temperature}; dtype {llm.loaded.model.dtype}, --quantize {r['quantize']} "
          f"({r['weights']}), max_num_seqs "
          f"{llm.engine.scheduler_config.max_num_seqs}, max_num_batched_tokens "
          f"{llm.engine.scheduler_config.max_num_batched_tokens}, buckets {list(llm.engine.runner.buckets)}")
    print(f"jaxserve: {r['useful_tok_s']:.1f} useful tok/s ({r['wall_s']:.1f} s), "
          f"padding {r['padding_fraction']:.1%} "
          f"of {r['computed_tokens']} computed tokens over {r['steps']} steps, {r['preemptions']} preemptions, "
          f"{r['compiles_after_warmup']} compilations after warm-up, peak RSS {r['peak_rss_mib']:.0f} MiB; "
          f"{r['roofline_fraction']:.3f} of the step roofline")
    if r["num_speculative_tokens"]:
        acc = r["draft_acceptance"]
        print(f"  speculative decoding ({r['draft_method']}, up to {r['num_speculative_tokens']} drafts): "
              f"{r['draft_tokens']} draft tokens, " + (f"{acc:.1%} kept" if acc is not None else "none proposed")
              + (f"; per position {r['acceptance_per_position']}, mean accepted length {r['mean_accepted_length']}"
                 if acc is not None else ""))
    for k in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        print(f"  {k[:-3]:>5} ms: " + "  ".join(f"{q} {v:.0f}" for q, v in r[k].items()))
    if args.compare_hf:
        del llm  # give HF the memory (and nothing else runs here meanwhile)
        hf = run_hf(args, reqs, prompts)
        hf_first8 = hf.pop("first8")
        hf_outputs = hf.pop("outputs")
        r.update({k: v for k, v in hf.items() if k != "hf_batches"})
        r["hf_outputs_identical"] = sum(a == b for a, b in zip(outputs, hf_outputs))
        r["ratio_vs_hf"] = round(r["useful_tok_s"] / hf["hf_useful_tok_s"], 2)
        # Greedy on both sides: the first tokens should mostly agree (left padding and batch
        # shapes change the last bits of the logits, so a near tie may flip).
        # HF rows run on to the batch's longest output; compare each request's own tokens only.
        r["hf_first8_agree"] = round(sum(a == b[:len(a)] for a, b in zip(first8, hf_first8)) / len(first8), 3)
        print(f"HF transformers (torch {hf['hf_torch']}): {hf['hf_useful_tok_s']:.1f} useful tok/s "
              f"({hf['hf_wall_s']:.0f} s, "
              f"batches of {args.hf_batch_size}), peak RSS {hf['hf_peak_rss_mib']:.0f} MiB; ratio "
              f"{r['ratio_vs_hf']:.1f}x; first 8 tokens agree on {r['hf_first8_agree']:.0%} of requests, "
              f"whole outputs identical on {r['hf_outputs_identical']}/{len(outputs)}")
    print("RESULT " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
