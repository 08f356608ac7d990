"""Batch generation alone and on Ray Data, side by side: rows/s, tokens/s and what Ray adds.

  python scripts/bench_ray_batch.py [WORKLOAD.json] [--rows 2000] [--max-output 16] [--prompt-scale 1]
      [--modes alone,ray1,ray2] [--ray-python .venv-ray/bin/python] [--model PATH]
      [--json OUT] [-- engine flags for every run, e.g. --max-num-seqs 64]

The rows are natural-text chat requests (scripts/natural_text.py), greedy, EOS respected, their
prompt lengths drawn in turn from WORKLOAD's requests (default: offline-mixed-48, the
bench_offline workload) times --prompt-scale, and each output capped at --max-output tokens
(fewer where the workload asks for fewer). Every mode runs `scripts/generate_batch.py` on the same JSONL, as its own
process:

  alone   generate_batch.py IN OUT.jsonl                      one engine, no Ray
  rayN    generate_batch.py IN OUT_DIR --ray --ray-actors N   a local Ray started for the job,
                                                              N engine actors, JSONL out

A warm-up run of `alone` on a few rows first fills the shared XLA compilation cache, so no mode
pays the step programs' compiles cold. Figures per mode:

  wall_s        the whole process: interpreter, model load, compiles from the cache, Ray's start
  generate_s    alone: its first step to its last; Ray: from the first batch an actor took to the
                last one any actor returned (the job less Ray's start and the actors' loads)
  rows_s, tok_s rows and generated tokens over generate_s (and rows over wall_s)
  overhead_ms_per_row   (generate_s - alone's generate_s) / rows: what Ray Data's reading,
                batching into actors, Arrow conversion and writing cost each row here

The outputs of every mode are compared by id (greedy: the same token ids whatever ran them).
The last line is RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "generate_batch.py"
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "workloads" / "offline-mixed-48.json"
WARMUP_ROWS = 8

ALONE_LINE = re.compile(r"generate_batch: .*: (\d+) results and (\d+) error records .* (\d+) tokens in ([\d.]+) s")
RAY_LINE = re.compile(r"generate_batch --ray: .*: (\d+) rows \((\d+) errors\), (\d+) tokens in ([\d.]+) s .*"
                      r"generating ([\d.]+|nan) s")


def write_rows(path: Path, workload: Path, rows: int, max_output: int, prompt_scale: float, model: str | None,
               seed: int) -> int:
    """The benchmark's JSONL; returns the prompt tokens it holds (chat template included)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import checkpoints
    from natural_text import chat_prompts

    from jaxserve.tokenizer import Tokenizer
    src = checkpoints.resolve_model_path(model)
    if src.suffix == ".gguf":  # the default model: its tokenizer is in the GGUF metadata
        from checkpoints.gguf_loader import GGUFCheckpoint
        tok = Tokenizer.from_gguf_metadata(GGUFCheckpoint(src).metadata)
    else:
        tok = Tokenizer.from_hf_folder(src)
    reqs = json.loads(workload.read_text())["requests"]
    picked = [reqs[i % len(reqs)] for i in range(rows)]
    msgs = chat_prompts(tok, [max(1, round(r["prompt_tokens"] * prompt_scale)) for r in picked], seed)
    prompt_tokens = 0
    with path.open("w") as f:
        for i, (r, m) in enumerate(zip(picked, msgs)):
            f.write(json.dumps({"id": f"row-{i}", "messages": m, "temperature": 0,
                                "max_tokens": min(max_output, r["output_tokens"])}) + "\n")
            prompt_tokens += len(tok.encode(tok.apply_chat_template(m)))
    return prompt_tokens


def run_mode(mode: str, rows_path: Path, out: Path, python: str, engine_flags: list[str], env: dict) -> dict:
    cmd = [python, str(SCRIPT), str(rows_path), str(out), "--no-progress", *engine_flags]
    if mode.startswith("ray"):
        actors = int(mode[3:])
        # Actors leave a CPU of the machine's for Ray's read and write tasks (Processor warns
        # otherwise, and the job would wait): on 2 cores, 2 actors reserve half a CPU each.
        cpus = max(0.25, min(1.0, ((os.cpu_count() or 2) - 1) / actors))
        cmd += ["--ray", "--ray-actors", str(actors), "--ray-num-cpus", f"{cpus:g}", "--output-format", "jsonl"]
    print(f"bench_ray_batch: {mode}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"bench_ray_batch: {mode} exited {p.returncode}:\n{p.stderr[-4000:]}")
    m = (RAY_LINE if mode.startswith("ray") else ALONE_LINE).search(p.stderr)
    if m is None:
        raise SystemExit(f"bench_ray_batch: {mode}: no summary line in its output:\n{p.stderr[-4000:]}")
    if mode.startswith("ray"):
        rows, errors, tokens, job_s, gen = m.groups()
        gen_s = float(gen)
        actor_lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip().startswith("actor ")]
    else:
        results, errors, tokens, gen = m.groups()
        rows, job_s, gen_s, actor_lines = int(results) + int(errors), None, float(gen), []
    return {"mode": mode, "rows": int(rows), "errors": int(errors), "tokens": int(tokens),
            "wall_s": round(wall, 1), "job_s": None if job_s is None else float(job_s), "generate_s": gen_s,
            "rows_s": round(int(rows) / gen_s, 2), "tok_s": round(int(tokens) / gen_s, 1),
            "rows_s_wall": round(int(rows) / wall, 2), "actors": actor_lines,
            "outputs": read_outputs(out)}


def read_outputs(out: Path) -> dict[str, list[int] | None]:
    files = [out] if out.is_file() else sorted(out.glob("*.json*"))
    got = {}
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                got[str(r["id"])] = r.get("token_ids")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", type=Path, nargs="?", default=DEFAULT_WORKLOAD)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--max-output", type=int, default=16, help="cap on each row's max_tokens")
    ap.add_argument("--prompt-scale", type=float, default=1.0,
                    help="each prompt's length is the workload's times this (the chat template's own "
                         "tokens are a floor): shorter prompts fit more rows in a CPU's time")
    ap.add_argument("--modes", default="alone,ray1,ray2", help="alone and rayN, comma-separated")
    ap.add_argument("--ray-python", default=sys.executable,
                    help="the interpreter with jaxserve[ray] for the Ray modes (default: this one)")
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--json", type=Path, default=None, help="write the result here too")
    ap.add_argument("engine_flags", nargs=argparse.REMAINDER, help="after --: flags for every generate_batch run")
    args = ap.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if not (m == "alone" or (m.startswith("ray") and m[3:].isdigit() and int(m[3:]) >= 1)):
            ap.error(f"--modes: {m!r} is neither 'alone' nor 'rayN' (N >= 1 actors)")
    if args.rows < 1 or args.max_output < 1:
        ap.error("--rows and --max-output must be >= 1")
    if not args.prompt_scale > 0:
        ap.error("--prompt-scale must be > 0")
    engine_flags = [f for f in args.engine_flags if f != "--"]
    if args.model:
        engine_flags += ["--model", args.model]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_ray_batch-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "xla-cache"
    engine_flags += ["--compilation-cache-dir", str(cache)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")

    rows_path = work / "rows.jsonl"
    prompt_tokens = write_rows(rows_path, args.workload, args.rows, args.max_output, args.prompt_scale,
                               args.model, args.seed)
    warm = work / "warmup.jsonl"
    warm.write_text("".join(rows_path.read_text().splitlines(keepends=True)[:WARMUP_ROWS]))
    run_mode("alone", warm, work / "warmup-out.jsonl", sys.executable, engine_flags, env)

    results = []
    for m in modes:
        out = work / (f"out-{m}.jsonl" if m == "alone" else f"out-{m}")
        py = sys.executable if m == "alone" else args.ray_python
        results.append(run_mode(m, rows_path, out, py, engine_flags, env))
    base = next((r for r in results if r["mode"] == "alone"), None)
    print(f"\n{args.rows} rows, {prompt_tokens} prompt tokens (workload x {args.prompt_scale:g}), outputs capped "
          f"at {args.max_output} tokens; {os.cpu_count()} CPUs")
    print(f"{'mode':<7} {'wall s':>7} {'gen. s':>7} {'rows/s':>7} {'tok/s':>7} {'rows/s wall':>11} "
          f"{'Ray ms/row':>10}  same tokens as alone")
    for r in results:
        if base is not None and r is not base:
            r["overhead_ms_per_row"] = round((r["generate_s"] - base["generate_s"]) / r["rows"] * 1e3, 2)
            r["same_tokens_as_alone"] = sum(r["outputs"].get(k) == v for k, v in base["outputs"].items())
        same = r.get("same_tokens_as_alone")
        same_txt = "" if same is None else f"{same} of {len(base['outputs'])}"
        print(f"{r['mode']:<7} {r['wall_s']:>7.1f} {r['generate_s']:>7.1f} {r['rows_s']:>7.2f} {r['tok_s']:>7.1f} "
              f"{r['rows_s_wall']:>11.2f} {r.get('overhead_ms_per_row', ''):>10}  "
              f"{same_txt}")
        for line in r["actors"]:
            print(f"        {line}")
    for r in results:
        r.pop("outputs")
    result = {"rows": args.rows, "prompt_tokens": prompt_tokens, "prompt_scale": args.prompt_scale,
              "max_output": args.max_output,
              "cpus": os.cpu_count(), "engine_flags": engine_flags, "results": results}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
