"""`generate_batch.py --ray`: the batch job through Ray Data. Input JSONL (one record per line,
generate_batch's format) or Parquet (one record per row, the same fields as columns) is read by
Ray, run through a pool of jaxserve engines (processor.py), and written by Ray's writers as a
directory of JSONL or Parquet files, rows in rows.py's format.

There is no resume from a half-written output here: Ray retries what fails inside the job, and a
job that fails as a whole is rerun into a new (or emptied) output directory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

FORMATS = ("auto", "jsonl", "parquet")


def add_ray_flags(ap) -> None:
    g = ap.add_argument_group("Ray Data (--ray)")
    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run through Ray Data: connect to the cluster at ADDRESS (default: RAY_ADDRESS, "
                        "else a local Ray started for this job); OUTPUT is then a directory")
    g.add_argument("--ray-actors", type=int, default=1, help="engine actors (one engine each)")
    g.add_argument("--ray-batch-size", type=int, default=16, help="rows per batch Ray hands an actor")
    g.add_argument("--ray-max-concurrent-batches", type=int, default=4,
                   help="batches an actor's engine runs at once (their rows share its steps)")
    g.add_argument("--ray-num-cpus", type=float, default=1, help="CPUs reserved per actor")
    g.add_argument("--ray-num-gpus", type=float, default=0, help="GPUs per actor")
    g.add_argument("--ray-resources", type=json.loads, default=None, metavar="JSON",
                   help='other Ray resources per actor, e.g. \'{"TPU": 4}\' (one TPU host each)')
    g.add_argument("--input-format", choices=FORMATS, default="auto",
                   help="auto: jsonl for a .jsonl / .json name, else parquet")
    g.add_argument("--output-format", choices=FORMATS, default="auto",
                   help="auto: jsonl for a .jsonl name, else parquet")


def input_format(path: str, given: str) -> str:
    if given != "auto":
        return given
    return "jsonl" if path.rstrip("/").endswith((".jsonl", ".json")) else "parquet"


def output_format(path: str, given: str) -> str:
    if given != "auto":
        return given
    return "jsonl" if path.rstrip("/").endswith(".jsonl") else "parquet"


def check_output_dir(path: str) -> str | None:
    """Why `path` cannot take this job's output, or None (local paths only; a URI is Ray's)."""
    if "://" in path:
        return None
    p = Path(path)
    if p.is_file():
        return f"{path} is a file; with --ray the output is a directory of files"
    if p.is_dir() and any(p.iterdir()):
        return f"{path} is not empty; --ray writes a new (or empty) directory and does not resume"
    return None


def run(args, load, engine) -> dict[str, Any]:
    """The whole job; returns the summary it printed."""
    import ray
    import ray.data

    from jaxserve.ray.processor import Processor

    src, dst = str(args.input), str(args.output)
    fmt_in, fmt_out = input_format(src, args.input_format), output_format(dst, args.output_format)
    ray.init(address=None if args.ray == "auto" else args.ray, log_to_driver=False)
    ds = ray.data.read_text(src) if fmt_in == "jsonl" else ray.data.read_parquet(src)
    proc = Processor(concurrency=args.ray_actors, batch_size=args.ray_batch_size,
                     max_concurrent_batches=args.ray_max_concurrent_batches, num_cpus=args.ray_num_cpus,
                     num_gpus=args.ray_num_gpus, resources=args.ray_resources,
                     input_format="jsonl" if fmt_in == "jsonl" else "rows",
                     engine_config=engine, **_load_kwargs(load))
    t0 = time.perf_counter()
    out = proc(ds)
    if fmt_out == "jsonl":
        out.write_json(dst)
    else:
        out.write_parquet(dst)
    seconds = time.perf_counter() - t0
    actors = proc.summary()
    summary = {"output": dst, "format": fmt_out, "seconds": round(seconds, 2),
               "rows": sum(a["rows"] for a in actors.values()),
               "errors": sum(a["errors"] for a in actors.values()),
               "tokens": sum(a["tokens"] for a in actors.values()),
               "generating_seconds": generating_seconds(actors), "actors": actors}
    gen = summary["generating_seconds"]
    print(f"generate_batch --ray: {dst}: {summary['rows']} rows ({summary['errors']} errors), "
          f"{summary['tokens']} tokens in {seconds:.1f} s ({summary['tokens'] / max(seconds, 1e-9):.1f} tok/s); "
          f"generating {gen if gen is not None else float('nan'):.1f} s", file=sys.stderr)
    for key, a in sorted(actors.items()):
        busy = a["step_seconds"]
        print(f"  actor {key}: {a['rows']} rows, {a['errors']} errors, {a['tokens']} tokens, "
              f"{a['tokens'] / max(busy, 1e-9):.1f} tok/s in its steps ({busy:.1f} s), load {a['load_seconds']:.1f} s",
              file=sys.stderr)
    return summary


def generating_seconds(actors: dict[str, dict]) -> float | None:
    """From the first batch any actor took to the last one any returned: the job's time less
    Ray's start-up and the actors' model loads and compiles (which overlap the read)."""
    starts = [a["first_batch_at"] for a in actors.values() if a.get("first_batch_at") is not None]
    ends = [a["last_batch_at"] for a in actors.values() if a.get("last_batch_at") is not None]
    return round(max(ends) - min(starts), 3) if starts and ends else None


def _load_kwargs(load) -> dict[str, Any]:
    from jaxserve import flags
    kw = flags.llm_kwargs(load, None)
    kw.pop("engine_config")
    return kw
