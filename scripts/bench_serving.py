"""Open-loop load test of the gRPC or the OpenAI HTTP API: Poisson arrivals at several rates.

Each request of the workload (serving-mixed-200.json: {prompt_tokens, output_tokens} pairs) is
sent as natural text (scripts/natural_text.py's corpus: prose, technical docs, Chinese) cut to
exactly that many tokens, with max_tokens = output_tokens and ignore_eos, so every request
produces exactly its output length. Every prompt is distinct, within a rate and across rates
(each rate draws its own text; each prompt opens with a label of its seed and index), so the
prefix cache answers none of them: each rate's row says how many prompt tokens it did answer
(in process; 0 expected). `--random-prompts` sends random token ids instead (a greedy model
loops on them, which flatters n-gram speculation); with `--server`, `--tokenizer` gives the
model's tokenizer for the natural text. Arrivals are open-loop: a request is sent at
its Poisson arrival time whether or not earlier ones have finished (a closed loop would hide
queueing). Per rate: TTFT, TPOT (a request's (last token - first token) / (tokens - 1)) and
end-to-end latency at p50/p95/p99, output tokens/s over the run, and the rejection rate
(RESOURCE_EXHAUSTED). A throughput-latency plot goes to a PNG; the last line is
`RESULT {json}`.

Against a running server:
    python scripts/bench_serving.py --server localhost:50051 --tokenizer path/to/hf_folder --rates 0.5,1,2
In process (starts a server on loopback with these engine settings, the same flags as
`jaxserve serve`; the default model unless --model / --fake-model):
    python scripts/bench_serving.py --rates 0.05,0.1 --num-requests 12 --max-num-batched-tokens 64

Timestamps are taken by the client when each message arrives, so they include the network
and the server's queue, as a user sees them.

`--backend openai` sends the same workload (the same token ids, max_tokens, ignore_eos) to
POST /v1/completions with stream=true and stream_options.include_usage (token counts from the
final usage chunk), so the two protocols' figures compare; `--server` is then the HTTP
host:port, and the in-process server also listens on HTTP. 429 counts as a rejection.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from request_timing import RequestTiming, completion_body, stream_completion, stream_grpc  # noqa: E402

import grpc  # noqa: E402

from jaxserve.server.cli import build_engine  # noqa: E402
from jaxserve.server.proto import generation_grpc  # noqa: E402
from jaxserve.server.proto import generation_pb2 as pb  # noqa: E402
from jaxserve.server.security import bearer_metadata  # noqa: E402

# ../shared beside the checkout, as the README runs it (not one machine's absolute path).
DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "serving-mixed-200.json"


@dataclasses.dataclass
class Outcome(RequestTiming):
    prompt_tokens: int
    output_tokens: int


_clock = time.perf_counter  # this script's timestamps are absolute perf_counter readings


class _Http:
    """The openai backend's transport (what run_rate needs of it)."""

    def __init__(self, address, token, model):
        import httpx
        self.client = httpx.AsyncClient(base_url=f"http://{address}",
                                        limits=httpx.Limits(max_connections=1024,
                                                            max_keepalive_connections=1024))
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.model = model

    def send(self, ids, out_len, out: Outcome, timeout):
        return stream_completion(self.client, completion_body(self.model, ids, out_len), out, self.headers,
                                 timeout, _clock)

    async def close(self):
        await self.client.aclose()


def random_prompts(workload, vocab, avoid, seed):
    """Random token ids of the workload's prompt lengths (--random-prompts), none in `avoid`."""
    rng = random.Random(seed)
    return [[t for t in (rng.randrange(vocab) for _ in range(n * 2)) if t not in avoid][:n] for n, _ in workload]


async def run_rate(address, rate, workload, prompts, rng, metadata, timeout, credentials=None,
                   http=None):
    """`prompts`: one token-id list per workload entry; `rng` draws the arrivals; `http`:
    (address, token, model) for the openai backend, None = gRPC."""
    if http is not None:
        transport = _Http(*http)
    else:
        channel = (grpc.aio.secure_channel(address, credentials) if credentials
                   else grpc.aio.insecure_channel(address))
        stub = generation_grpc.GenerationStub(channel)
    t0 = time.perf_counter()
    arrival, tasks, outcomes = 0.0, [], []
    for (prompt_len, out_len), ids in zip(workload, prompts):
        arrival += rng.expovariate(rate)
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=out_len, ignore_eos=True)
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        o = Outcome(prompt_len, out_len, sent=time.perf_counter())
        outcomes.append(o)
        if http is not None:
            tasks.append(asyncio.create_task(transport.send(ids, out_len, o, timeout)))
        else:
            tasks.append(asyncio.create_task(stream_grpc(stub, req, o, metadata, timeout, _clock)))
    await asyncio.gather(*tasks)
    await (transport.close() if http is not None else channel.close())
    return outcomes, time.perf_counter() - t0


def _pct(values, qs=(50, 95, 99)):
    v = [x for x in values if x is not None]
    if not v:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(v, q)) for q in qs}


def summarize(rate, outcomes, duration):
    ok = [o for o in outcomes if o.code == "OK"]
    rejected = sum(o.code == "RESOURCE_EXHAUSTED" for o in outcomes)
    errors = {}
    for o in outcomes:
        if o.code not in ("OK", "RESOURCE_EXHAUSTED"):
            errors[o.code] = errors.get(o.code, 0) + 1
    out_tokens = sum(o.tokens for o in ok)
    short = sum(o.tokens != o.output_tokens for o in ok)
    return {
        "rate": rate, "requests": len(outcomes), "completed": len(ok), "rejected": rejected,
        "rejection_rate": rejected / len(outcomes), "errors": errors, "wrong_length": short,
        "duration_s": duration, "output_tokens": out_tokens, "output_tok_s": out_tokens / duration,
        "ttft_s": _pct([o.ttft for o in ok]), "tpot_s": _pct([o.tpot for o in ok]),
        "e2e_s": _pct([o.e2e for o in ok]),
        "long_prompts": sum(o.prompt_tokens >= 1024 for o in ok),
    }


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = [r["output_tok_s"] for r in results]
    for ax, key, title in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT", "TPOT", "end-to-end")):
        for q, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
            ax.plot(x, [r[key][q] for r in results], style, label=q)
        for r in results:
            ax.annotate(f"{r['rate']:g}/s", (r["output_tok_s"], r[key]["p50"] or 0), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("seconds")
        ax.set_title(f"{title} vs throughput")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--rates", default="0.5,1,2", help="requests per second, comma-separated")
    p.add_argument("--num-requests", type=int, default=None, help="the first N of the workload")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request gRPC deadline")
    p.add_argument("--plot", type=Path, default=Path("bench_serving.png"))
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="the protocol: jaxserve.v1.Generation over gRPC, or the OpenAI HTTP API")
    p.add_argument("--server", default=None, help="host:port of a running server (else start one here); "
                                                  "with --backend openai, the HTTP port")
    p.add_argument("--grpc-server", default=None,
                   help="with --backend openai and --server: the gRPC host:port for ModelInfo (default: "
                        "ask the HTTP API)")
    p.add_argument("--token", default=None, help="bearer token for --server")
    p.add_argument("--tokenizer", default=None,
                   help="with --server: the model's HF tokenizer folder ('fake' for --fake-model servers), "
                        "to cut the natural-text prompts to the workload's token lengths")
    p.add_argument("--random-prompts", action="store_true",
                   help="random token ids instead of natural text: a greedy model loops on them, which "
                        "flatters n-gram speculation and hides real decode cost (for comparison with "
                        "figures taken that way only)")
    # In-process server: every flag of `jaxserve serve` (the same generated definitions, so a
    # flag build_engine reads is always there), but --seed, which here seeds the workload.
    from jaxserve import flags
    from jaxserve.server.cli import add_serve_flags
    add_serve_flags(p, exclude=("seed",), server=False)
    p.add_argument("--max-queued-requests", type=int, default=256)
    args = p.parse_args(argv)
    flags.setup_logging(args.log_level)
    if args.server is None:
        flags.engine_configs_or_exit(args, "bench_serving")  # refused flags: one line, before the load

    rates = [float(r) for r in args.rates.split(",")]
    spec = json.loads(args.workload.read_text())
    workload = [(r["prompt_tokens"], min(r["output_tokens"], args.max_output_tokens or 1 << 30))
                for r in spec["requests"]][:args.num_requests]

    server, engine, tokenizer = None, None, None
    address = args.server
    engine_info = {}
    if address is None:
        from jaxserve.server.app import BackgroundServer
        from jaxserve.server.config import ServerConfig
        engine, description = build_engine(args)
        tokenizer = engine.tokenizer
        print(f"starting an in-process server ({description.model}); warming up ...", file=sys.stderr, flush=True)
        server = BackgroundServer(engine, ServerConfig(port=0, progress=True, http_port=0,
                                                       max_queued_requests=args.max_queued_requests),
                                 description=description)
        server.start(ready_timeout=3600)
        address = server.address
        http_address = f"127.0.0.1:{server.server.http_port}"
        sc = engine.scheduler_config
        engine_info = {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                       "num_pages": sc.num_pages, "page_size": sc.page_size,
                       "token_buckets": list(engine.runner.buckets)}
    else:
        http_address = args.server
    metadata = bearer_metadata(args.token)
    http = None
    if args.backend == "openai":
        import httpx
        headers = {"authorization": f"Bearer {args.token}"} if args.token else {}
        model = httpx.get(f"http://{http_address}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        http = (http_address, args.token, model)
        if server is None:
            if not args.grpc_server:
                p.error("--backend openai --server needs --grpc-server too: ModelInfo (the model's "
                    "name, dtype, vocabulary size and EOS ids) is a gRPC call")
            address = args.grpc_server
    info = generation_grpc.GenerationStub(grpc.insecure_channel(address)).ModelInfo(
        pb.ModelInfoRequest(), metadata=metadata, timeout=30)
    vocab, eos, model_name, dtype = info.vocab_size, set(info.eos_token_ids), info.model, info.dtype
    avoid = eos | set(range(min(32, vocab)))  # specials sit low

    if not args.random_prompts and tokenizer is None:
        if not args.tokenizer:
            p.error("--server needs --tokenizer (the model's HF folder, or 'fake') for natural-text "
                    "prompts, or --random-prompts")
        from jaxserve.server.fake_engine import fake_tokenizer
        from jaxserve.tokenizer import Tokenizer
        tokenizer = fake_tokenizer() if args.tokenizer == "fake" else Tokenizer.from_hf_folder(args.tokenizer)

    results = []
    try:
        for k, rate in enumerate(rates):
            # Each rate its own prompts (the same lengths, other text or ids): a prompt seen at an
            # earlier rate would be answered from the prefix cache and flatter the later rates.
            seed = args.seed * 1000 + k + 1
            if args.random_prompts:
                prompts = random_prompts(workload, vocab, avoid, seed)
            else:
                from natural_text import token_prompts
                prompts = token_prompts(tokenizer, [n for n, _ in workload], seed)
            hits0 = engine.prefix_cache_stats()["hits"] if engine is not None else None
            outcomes, duration = asyncio.run(run_rate(address, rate, workload, prompts, random.Random(args.seed),
                                                      metadata, args.timeout, http=http))
            r = summarize(rate, outcomes, duration)
            # In process: prompt tokens the prefix cache answered during this rate (0 when every
            # prompt is distinct; a shared chat template or system prompt would count here).
            r["prefix_cache_hit_tokens"] = None if engine is None else engine.prefix_cache_stats()["hits"] - hits0
            results.append(r)
            print(f"rate {rate:g}/s: {r['completed']}/{r['requests']} ok, {r['rejected']} rejected, "
                  f"{r['output_tok_s']:.1f} out tok/s, TTFT p50 {r['ttft_s']['p50']}, "
                  f"TPOT p50 {r['tpot_s']['p50']} p99 {r['tpot_s']['p99']}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            stats = dict(server.server.engine.stats)
            server.stop()
            engine_info["engine_stats"] = stats
    plot(results, args.plot)
    top = results[-1]
    ratio = (top["tpot_s"]["p99"] / top["tpot_s"]["p50"]) if top["tpot_s"]["p50"] else None
    summary = {
        "workload": spec.get("name", args.workload.stem), "num_requests": len(workload),
        "backend": args.backend,
        "max_output_tokens": args.max_output_tokens, "model": model_name, "dtype": dtype,
        "prompts": "random token ids" if args.random_prompts else "natural text (scripts/natural_text.py)",
        "engine": engine_info, "rates": results, "plot": str(args.plot),
        "tpot_p99_over_p50_at_highest_rate": ratio,
        "goal_tpot_p99_le_2x_p50_without_rejections": bool(ratio is not None and ratio <= 2.0
                                                           and top["rejected"] == 0),
    }
    print("RESULT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
