"""Disaggregated against colocated serving as real processes on this machine: the same Poisson
requests (natural text, scripts/natural_text.py) sent through gRPC to

    colocated   one `jaxserve serve` on every core (chunked prefill mixed with decode), and
    1P + 1D     `serve --role prefill` pinned to core 0, `--role decode` pinned to core 1 and a
                `--role router` in front (unpinned, as the client),

so both set-ups have the same cores. Per set-up and rate: TTFT and TPOT p50 / p99 (the client's
clock, bench_serving.py's definitions), output tokens/s, and goodput: requests per second that
met both SLOs (--slo-ttft, --slo-tpot). The default workload is a scaled-down long-prompt one
(prompts 1-2k tokens, 32 out; prompts of 2-8k take seconds each on two CPU cores).

What it distorts: two cores shared by three processes and the client, so the router and the
client take time from the engines; XLA:CPU in each pinned process runs one core, the colocated
one two. Read it as the shape of the trade on CPU, not as a device figure
(scripts/bench_disagg.py's virtual-time table is that).

    python scripts/bench_disagg_processes.py --rates 0.2,0.4 --num-requests 16

The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import run_rate, summarize  # noqa: E402
from natural_text import token_prompts  # noqa: E402


class Served:
    """One `jaxserve serve` process, its log in a file; `address` once it listens."""

    def __init__(self, name, args, cpus, folder: Path):
        self.name, self.log = name, folder / f"{name}.log"
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--no-progress", *args]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        with open(self.log, "w") as f:
            self.p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))

    def wait_ready(self, timeout=900) -> "Served":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.log.read_text()
            m = re.search(r"listening on [\d.]+:(\d+)", text)
            if m and "jaxserve: ready" in text:
                self.address = f"localhost:{m.group(1)}"
                return self
            if self.p.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"{self.name} did not become ready:\n{self.log.read_text()[-3000:]}")

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()


@contextlib.contextmanager
def setup(kind, engine_flags, folder):
    procs = []
    try:
        if kind == "colocated":
            procs.append(Served("colocated", engine_flags, "0,1", folder).wait_ready())
        else:
            procs.append(Served("prefill", ["--role", "prefill", *engine_flags], "0", folder).wait_ready())
            procs.append(Served("decode", ["--role", "decode", *engine_flags], "1", folder).wait_ready())
            procs.append(Served("router", ["--role", "router", "--prefill-servers", procs[0].address,
                                           "--decode-servers", procs[1].address], None, folder).wait_ready())
        yield procs[-1].address
    finally:
        for p in reversed(procs):
            p.stop()


def long_workload(n, seed, lo, hi, out):
    rng = random.Random(seed)
    return [(rng.randint(lo, hi), out) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.2,0.4")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-tokens", default="1024,2048", help="LO,HI: uniform prompt lengths")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.15, help="seconds")
    p.add_argument("--engine-flags", default="--max-model-len 2304 --max-num-seqs 16 --max-num-batched-tokens 256 "
                                              "--token-buckets 16,256 --kv-cache-mb 512",
                   help="`serve` flags for every engine (chunked prefill: --max-num-batched-tokens)")
    p.add_argument("--setups", default="colocated,disaggregated")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    workload = long_workload(args.num_requests, args.seed, lo, hi, args.output_tokens)
    from jaxserve import loading
    tokenizer = loading.load(None, "float32").tokenizer
    folder = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    flags = args.engine_flags.split() + ["--compilation-cache-dir", str(folder / "xla")]
    rows = []
    for kind in args.setups.split(","):
        with setup(kind, flags, folder) as address:
            for k, rate in enumerate(float(r) for r in args.rates.split(",")):
                prompts = token_prompts(tokenizer, [n for n, _ in workload], args.seed * 1000 + k + 1)
                outcomes, duration = asyncio.run(run_rate(address, rate, workload, prompts,
                                                          random.Random(args.seed), (), 3600))
                r = summarize(rate, outcomes, duration)
                good = sum(o.code == "OK" and o.ttft <= args.slo_ttft and (o.tpot or 0) <= args.slo_tpot
                           for o in outcomes)
                r.update(setup=kind, goodput_req_s=good / duration, met_slo=good)
                rows.append(r)
                print(f"{kind:13s} rate {rate:g}/s: TTFT p50 {r['ttft_s']['p50']:.2f} p99 {r['ttft_s']['p99']:.2f} s, "
                      f"TPOT p50 {r['tpot_s']['p50'] * 1e3:.0f} p99 {r['tpot_s']['p99'] * 1e3:.0f} ms, "
                      f"{r['output_tok_s']:.1f} out tok/s, goodput {r['goodput_req_s']:.3f} req/s "
                      f"({good}/{len(outcomes)} met the SLO), errors {r['errors']}", flush=True)
    print("| setup | rate/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | out tok/s | goodput req/s (met SLO) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['rate']:g} | {r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f} | "
              f"{r['tpot_s']['p50'] * 1e3:.0f} / {r['tpot_s']['p99'] * 1e3:.0f} | {r['output_tok_s']:.1f} | "
              f"{r['goodput_req_s']:.3f} ({r['met_slo']}/{r['requests']}) |")
    print("RESULT " + json.dumps({"workload": {"prompt_tokens": [lo, hi], "output_tokens": args.output_tokens,
                                              "requests": args.num_requests},
                                 "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
                                 "engine_flags": args.engine_flags, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
