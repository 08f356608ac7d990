"""Capacity search: the highest request rate a server sustains within a latency SLO.

Replays a workload with realistic lengths and arrivals, sweeps the rate, and reports the
throughput-latency curve and the safe rate:

  - prompts: natural text (scripts/natural_text.py) cut to the workload's prompt lengths,
    max_tokens = its output lengths with ignore_eos, so every request generates its length;
  - lengths: a workload file ({"requests": [{"prompt_tokens", "output_tokens"}, ...]});
  - arrivals: open loop, Poisson, bursty gamma (--arrival gamma --cv 3: CV > 1 = bursts) or
    constant spacing; optional tenant mix (--tenants a=3,b=1: share of requests, each tenant
    its own bearer token);
  - per rate: goodput (requests per second that met both SLOs, and their output tokens/s),
    TTFT / TPOT / end-to-end p50/p95/p99, rejection and preemption rates, peak KV usage;
  - the safe rate: the highest rate whose p99 TTFT and p99 TPOT meet --slo-ttft-ms /
    --slo-tpot-ms with rejections at most --max-rejection, in every one of --trials repeated
    trials (different arrival seeds), found by bisection between the last passing and the
    first failing rate of the sweep.

Targets (capacity_targets.py):
  in-process (default)  a server on loopback with `jaxserve serve`'s engine flags
  --server HOST:PORT    a running server; loopback addresses only (this is a load generator)
  --backend grpc|http   the protocol: jaxserve.v1 Generate over gRPC (default), or the OpenAI
                        API's streamed /v1/completions (--server is then the HTTP host:port)
  --simulate            no server, no wall clock: the engine (--fake-model) driven in virtual
                        time, each step costing --sim-step-ms + --sim-token-ms per token.
                        Exact and fast; what the tests use to check the search.
  --simulate --sim-compiled REPORT.json
                        the same, each step costing what a `jaxserve compile --json` report
                        predicts for it on that report's chips (its compiled bucket's FLOPs and
                        bytes, plus the KV the running sequences hold, at the chip's peaks),
                        with the report's KV pool, page size, buckets and limits: goodput
                        PREDICTED for a machine this one is not (jaxserve/aot/predict.py).

The modules: capacity_workload.py (lengths, prompts, arrivals, tenants), capacity_targets.py
(where a trial's requests go), capacity_search.py (a trial's statistics, the search, the plot);
this file is the command line.

Outputs: a PNG of the curve (--plot) and `RESULT {json}` on the last line (--out: also a file).

    python scripts/capacity.py --fake-model --simulate --rates 2,4,8,16 --slo-ttft-ms 500 --slo-tpot-ms 50
    python scripts/capacity.py --max-model-len 1024 --rates 0.05,0.1,0.2 --num-requests 24 \
        --slo-ttft-ms 5000 --slo-tpot-ms 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# The pieces, re-exported: tests and users reach them as capacity.<name>.
from capacity_search import SLO, plot, search, summarize  # noqa: E402,F401
from capacity_targets import GrpcTarget, HttpTarget, Outcome, SimTarget, check_loopback  # noqa: E402,F401
from capacity_workload import (MAX_RATE, MAX_REQUESTS, Request, arrival_times,  # noqa: E402,F401
                               load_lengths, make_requests, parse_pairs)

TARGETS = {"grpc": GrpcTarget, "http": HttpTarget}
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "workloads" / "serving-mixed-200.json"


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--num-requests", type=int, default=None, help="the first N of the workload")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output")
    p.add_argument("--rates", default="0.5,1,2,4", help="requests per second to sweep, comma-separated")
    p.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    p.add_argument("--cv", type=float, default=3.0, help="gamma arrivals: coefficient of variation")
    p.add_argument("--tenants", type=parse_pairs, default=None, metavar="NAME=SHARE,...",
                   help="tenant mix: each request's tenant drawn by share (its own bearer token)")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--max-rejection", type=float, default=0.0, help="fraction of requests refused")
    p.add_argument("--server-slo", action="store_true",
                   help="the server holds the SLO too (serve's --slo-ttft-ms / --slo-tpot-ms: TTFT "
                        "refusals, TPOT batch sizing): the in-process server or the simulation")
    p.add_argument("--trials", type=int, default=2, help="trials per rate (different arrival seeds)")
    p.add_argument("--bisect-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=4, help="sent and discarded before the sweep")
    p.add_argument("--plot", type=Path, default=Path("capacity.png"))
    p.add_argument("--out", type=Path, default=None, help="also write the JSON table here")
    p.add_argument("--server", default=None, help="loopback host:port of a running server (with "
                                                  "--backend http: its HTTP port)")
    p.add_argument("--backend", choices=("grpc", "http"), default="grpc",
                   help="the protocol: jaxserve.v1 Generate over gRPC, or the OpenAI API over HTTP "
                        "(streamed /v1/completions)")
    p.add_argument("--tokenizer", default=None, help="with --server: HF tokenizer folder ('fake' for --fake-model servers)")
    p.add_argument("--simulate", action="store_true", help="virtual time, engine in process (needs --fake-model)")
    p.add_argument("--sim-step-ms", type=float, default=10.0)
    p.add_argument("--sim-token-ms", type=float, default=0.0)
    p.add_argument("--sim-compiled", type=Path, default=None, metavar="REPORT.json",
                   help="with --simulate: step costs, KV pool and limits from a `jaxserve compile --json` report")
    p.add_argument("--timeout", type=float, default=3600.0)
    # In-process server: every flag of `jaxserve serve` (the same generated definitions, so a
    # flag build_engine reads is always there), but --seed, which here seeds the workload.
    from jaxserve import flags
    from jaxserve.server.cli import add_serve_flags
    add_serve_flags(p, exclude=("seed",), server=False)
    p.add_argument("--max-queued-requests", type=int, default=256)
    args = p.parse_args(argv)
    flags.setup_logging(args.log_level)
    if args.server is None:
        flags.engine_configs_or_exit(args, "capacity")  # refused flags: one line, before the load
    if args.num_requests is not None and not 1 <= args.num_requests <= MAX_REQUESTS:
        p.error(f"--num-requests: must be in [1, {MAX_REQUESTS}]")
    if args.simulate and not args.fake_model:
        p.error("--simulate drives the fake model in virtual time: add --fake-model")
    if args.sim_compiled is not None:
        if not args.simulate:
            p.error("--sim-compiled: step costs for the simulation; add --simulate --fake-model")
        _take_compiled_limits(args, p)
    return args


def _take_compiled_limits(args, p) -> None:
    """The simulated engine gets the compiled engine's KV pool, pages, buckets and limits, so
    admission and preemption happen where they would on the report's chips."""
    try:
        report = json.loads(args.sim_compiled.read_text())
    except (OSError, ValueError) as e:
        p.error(f"--sim-compiled: cannot read {args.sim_compiled}: {e}")
    args.num_pages = report["num_pages"] + 1  # + the null page the scheduler keeps
    args.page_size = report["page_size"]
    args.max_num_seqs = report["max_num_seqs"]
    args.max_model_len = report["max_model_len"]
    args.token_buckets = tuple(pr["tokens"] for pr in report["programs"])
    args.max_num_batched_tokens = max(args.token_buckets)
    args.compiled_report = report


def main(argv=None) -> int:
    args = parse_args(argv)
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000, args.max_rejection)
    lengths = load_lengths(args.workload, args.num_requests, args.max_output_tokens)
    rates = sorted(float(r) for r in args.rates.split(","))
    server, engine = None, None
    if args.simulate:
        from jaxserve.server.cli import build_engine
        engine, _ = build_engine(args)
        tokenizer = engine.tokenizer
        make_slo = None
        if args.server_slo:
            from jaxserve.scheduler.slo import SloAdmission
            make_slo = lambda: SloAdmission(slo.ttft_s, tuple(engine.runner.buckets),  # noqa: E731
                                            engine.scheduler_config.max_num_batched_tokens, slo.tpot_s)
        kv_cost = None
        if args.sim_compiled is not None:
            from jaxserve.aot.predict import CompiledStepCost
            kv_cost = CompiledStepCost(args.compiled_report)
        target = SimTarget(lambda: build_engine(args)[0],
                           lambda tokens: (args.sim_step_ms + args.sim_token_ms * tokens) / 1000, make_slo,
                           kv_step_cost=kv_cost)
        what = "simulated fake model" if kv_cost is None else (
            f"PREDICTED: the fake model in virtual time at {args.sim_compiled.name}'s compiled step costs "
            f"({args.compiled_report['topology']}, tp={args.compiled_report['tp']})")
    elif args.server:
        from jaxserve.server.fake_engine import fake_tokenizer
        from jaxserve.tokenizer import Tokenizer
        if not args.tokenizer:
            raise SystemExit("capacity: --server needs --tokenizer (the model's HF folder, or 'fake')")
        tokenizer = fake_tokenizer() if args.tokenizer == "fake" else Tokenizer.from_hf_folder(args.tokenizer)
        target = TARGETS[args.backend](args.server, timeout=args.timeout)
        what = f"{args.server} over {args.backend}"
    else:
        from jaxserve.server.app import BackgroundServer
        from jaxserve.server.cli import build_engine
        from jaxserve.server.config import ServerConfig
        engine, description = build_engine(args)
        tokenizer = engine.tokenizer
        print(f"starting an in-process server ({description.model}); warming up ...", file=sys.stderr, flush=True)
        http = args.backend == "http"
        slo_ms = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms) if args.server_slo else {}
        server = BackgroundServer(engine, ServerConfig(port=0, progress=False, http_port=0 if http else None,
                                                       max_queued_requests=args.max_queued_requests, **slo_ms),
                                  description=description)
        server.start(ready_timeout=3600)
        address = f"127.0.0.1:{server.server.http_port}" if http else server.address
        target = TARGETS[args.backend](address, server.server, args.timeout)
        what = f"{description.model} in process over {args.backend}"
    # Every trial gets prompts of its own (same lengths, other text): a repeat of an earlier
    # trial's prompts would be answered from the prefix cache and flatter every later rate.
    trial_no = iter(range(1, 1 << 30))
    requests = make_requests(tokenizer, lengths, args.seed, args.tenants)

    def trial(rate: float, seed: int) -> dict:
        reqs = make_requests(tokenizer, lengths, args.seed * 100_003 + next(trial_no), args.tenants)
        arrivals = arrival_times(len(reqs), rate, args.arrival, random.Random(args.seed * 7919 + seed), args.cv)
        outcomes, duration, extras = target.run(reqs, arrivals)
        return summarize(rate, outcomes, duration, extras, slo)

    if args.warmup_requests and not args.simulate:
        # A fresh server's first requests are slower than the rest (first use of each executable
        # and of the host's memory): send a few back to back and discard them, so the first
        # swept rate is not judged on them.
        k = min(args.warmup_requests, len(requests))
        target.run(requests[:k], [0.0] * k)
    try:
        rows, safe, note = search(trial, rates, slo, args.trials, args.bisect_steps,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        if server is not None:
            server.stop()
    title = (f"{what}: {len(requests)} requests, {args.arrival} arrivals, SLO TTFT p99 <= "
             f"{args.slo_ttft_ms:g} ms, TPOT p99 <= {args.slo_tpot_ms:g} ms; policy {args.scheduling_policy}"
             f"{' + fair share' if args.fair_share else ''}{'; server holds the SLO' if args.server_slo else ''}")
    plot(rows, slo, safe, args.plot, title)
    result = {"target": what, "workload": str(args.workload), "num_requests": len(requests),
              "arrival": args.arrival, "cv": args.cv if args.arrival == "gamma" else None,
              "slo": dataclasses.asdict(slo), "trials": args.trials, "safe_rate": safe, "note": note,
              "backend": None if args.simulate else args.backend,
              "scheduling_policy": args.scheduling_policy, "fair_share": args.fair_share,
              "server_slo": args.server_slo,
              "rows": rows, "plot": str(args.plot)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{note}", file=sys.stderr)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
