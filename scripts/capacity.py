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

Targets:
  in-process (default)  a server on loopback with `jaxserve serve`'s engine flags (over gRPC)
  --server HOST:PORT    a running server; loopback addresses only (this is a load generator)
  --simulate            no server, no wall clock: the engine (--fake-model) driven in virtual
                        time, each step costing --sim-step-ms + --sim-token-ms per token.
                        Exact and fast; what the tests use to check the search.

Outputs: a PNG of the curve (--plot) and `RESULT {json}` on the last line (--out: also a file).

    python scripts/capacity.py --fake-model --simulate --rates 2,4,8,16 --slo-ttft-ms 500 --slo-tpot-ms 50
    python scripts/capacity.py --max-model-len 1024 --rates 0.05,0.1,0.2 --num-requests 24 \
        --slo-ttft-ms 5000 --slo-tpot-ms 500
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from request_timing import RequestTiming  # noqa: E402

DEFAULT_WORKLOAD = ROOT.parent / "shared" / "workloads" / "serving-mixed-200.json"
MAX_REQUESTS = 5000  # per trial: a load generator must stay bounded
MAX_RATE = 1000.0


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    tenant: str = ""


@dataclasses.dataclass
class Outcome(RequestTiming):
    tenant: str
    output_tokens: int
    sent: float
    code: str = "OK"
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    max_rejection: float = 0.0

    def request_ok(self, o: Outcome) -> bool:
        return (o.code == "OK" and o.ttft is not None and o.ttft <= self.ttft_s
                and (o.tpot is None or o.tpot <= self.tpot_s))

    def met(self, row: dict) -> bool:
        t, p = row["ttft_s"]["p99"], row["tpot_s"]["p99"]
        return (row["completed"] > 0 and t is not None and t <= self.ttft_s
                and (p is None or p <= self.tpot_s) and row["rejection_rate"] <= self.max_rejection)


# ---- workload --------------------------------------------------------------------------------

def load_lengths(path: Path, n: int | None, max_output: int | None) -> list[tuple[int, int]]:
    spec = json.loads(Path(path).read_text())
    out = [(int(r["prompt_tokens"]), min(int(r["output_tokens"]), max_output or 1 << 30))
           for r in spec["requests"]][:n]
    if not out or any(p < 1 or o < 1 for p, o in out):
        raise SystemExit(f"capacity: {path}: needs requests with prompt_tokens and output_tokens >= 1")
    return out[:MAX_REQUESTS]


def arrival_times(n: int, rate: float, kind: str, rng: random.Random, cv: float = 1.0) -> list[float]:
    """Arrival offsets in seconds. gamma: inter-arrival gaps with mean 1/rate and coefficient of
    variation `cv` (shape 1/cv^2; cv = 1 is Poisson, cv > 1 is bursty)."""
    if not 0 < rate <= MAX_RATE:
        raise ValueError(f"rate: must be in (0, {MAX_RATE}], got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        if kind == "poisson":
            gap = rng.expovariate(rate)
        elif kind == "gamma":
            k = 1.0 / (cv * cv)
            gap = rng.gammavariate(k, 1.0 / (rate * k))
        elif kind == "constant":
            gap = 1.0 / rate
        else:
            raise ValueError(f"arrival: must be poisson, gamma or constant, got {kind!r}")
        t += gap
        out.append(t)
    return out


def make_requests(tokenizer, lengths, seed: int, tenants: list[tuple[str, float]] | None = None) -> list[Request]:
    from natural_text import token_prompts
    prompts = token_prompts(tokenizer, [p for p, _ in lengths], seed)
    rng = random.Random(seed + 1)
    names = [t for t, _ in tenants] if tenants else [""]
    weights = [w for _, w in tenants] if tenants else [1.0]
    return [Request(ids, o, rng.choices(names, weights)[0]) for ids, (_, o) in zip(prompts, lengths)]


# ---- targets ---------------------------------------------------------------------------------

class SimTarget:
    """The real Engine (scheduler, engine loop; a fake runner) in virtual time: a step costs
    `step_cost(tokens)` seconds. Deterministic: the same inputs give the same curve."""

    def __init__(self, make_engine: Callable[[], object], step_cost: Callable[[int], float]):
        self.make_engine = make_engine
        self.step_cost = step_cost

    def run(self, requests: list[Request], arrivals: list[float]):
        from jaxserve.types import InvalidRequestError, SamplingParams
        eng = self.make_engine()
        sched = eng.scheduler
        usable = sched.num_total_pages - 1
        now, i, outcomes, by_id, peak = 0.0, 0, [], {}, 0.0
        while i < len(requests) or eng.has_unfinished():
            if not eng.has_unfinished() and arrivals[i] > now:
                now = arrivals[i]  # idle: jump to the next arrival
            while i < len(requests) and arrivals[i] <= now:
                r = requests[i]
                o = Outcome(r.tenant, r.max_tokens, arrivals[i])
                outcomes.append(o)
                try:
                    rid = eng.add_request({"prompt_token_ids": r.prompt_ids},
                                          SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                          request_id=f"r{i}", tenant=r.tenant)
                    by_id[rid] = o
                except InvalidRequestError:
                    o.code = "INVALID_ARGUMENT"
                i += 1
            before = eng.stats["computed_tokens"]
            deltas = eng.step()
            now += self.step_cost(eng.stats["computed_tokens"] - before)
            peak = max(peak, (usable - sched.num_free_pages) / usable)
            for d in deltas:
                o = by_id[d.request_id]
                if d.token_ids:
                    o.first = o.first if o.first is not None else now
                    o.last = now
                    o.tokens += len(d.token_ids)
                if d.finished:
                    eng.pop_finished(d.request_id)
        return outcomes, now, {"preemptions": eng.stats["preemptions"], "peak_kv_usage": peak}


class GrpcTarget:
    """A server over loopback gRPC; the in-process Server too when there is one (its engine
    for preemptions and compilations, its metrics for the peak KV usage, which the engine
    thread records after every step: sampling it from here as messages arrive misses requests
    that finish between two samples)."""

    def __init__(self, address: str, server=None, timeout: float = 3600.0):
        check_loopback(address)
        self.address = address
        self.engine = None if server is None else server.engine
        self.metrics = None if server is None else server.metrics
        self.timeout = timeout

    def run(self, requests: list[Request], arrivals: list[float]):
        pre = self.engine.stats["preemptions"] if self.engine is not None else None
        if self.metrics is not None:
            self.metrics.reset_kv_peak()  # this trial's peak
        outcomes, duration = asyncio.run(self._run(requests, arrivals))
        extras = {"preemptions": None if pre is None else self.engine.stats["preemptions"] - pre,
                  "peak_kv_usage": None if self.metrics is None else self.metrics.kv_peak,
                  "compilations_after_warmup": getattr(self.engine, "compiles_after_warmup", None)}
        return outcomes, duration, extras

    async def _run(self, requests, arrivals):
        import grpc

        from jaxserve.server.proto import generation_grpc
        from jaxserve.server.proto import generation_pb2 as pb
        channel = grpc.aio.insecure_channel(self.address)
        stub = generation_grpc.GenerationStub(channel)

        async def one(req, o):
            md = (("authorization", f"Bearer tenant-{req.tenant}"),) if req.tenant else ()
            msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=req.prompt_ids),
                                     max_tokens=req.max_tokens, ignore_eos=True)
            try:
                async for m in stub.Generate(msg, metadata=md, timeout=self.timeout):
                    if m.token_ids:
                        t = time.perf_counter() - t0
                        o.first = o.first if o.first is not None else t
                        o.last = t
                        o.tokens += len(m.token_ids)
            except grpc.aio.AioRpcError as e:
                o.code = e.code().name

        t0 = time.perf_counter()
        tasks, outcomes = [], []
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            o = Outcome(req.tenant, req.max_tokens, time.perf_counter() - t0)
            outcomes.append(o)
            tasks.append(asyncio.create_task(one(req, o)))
        await asyncio.gather(*tasks)
        await channel.close()
        return outcomes, time.perf_counter() - t0


def check_loopback(address: str) -> None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"capacity: --server must be a loopback address (localhost, 127.0.0.1, [::1]), "
                         f"got {address!r}: this is a load generator")


# ---- statistics and the search --------------------------------------------------------------

def _pct(values, qs=(50, 95, 99)):
    v = [x for x in values if x is not None]
    return {f"p{q}": (float(np.percentile(v, q)) if v else None) for q in qs}


def summarize(rate: float, outcomes: list[Outcome], duration: float, extras: dict, slo: SLO) -> dict:
    ok = [o for o in outcomes if o.code == "OK"]
    rejected = sum(o.code == "RESOURCE_EXHAUSTED" for o in outcomes)
    good = [o for o in ok if slo.request_ok(o)]
    n = len(outcomes)
    row = {
        "rate": rate, "requests": n, "completed": len(ok), "rejected": rejected,
        "rejection_rate": rejected / n, "errors": n - len(ok) - rejected, "duration_s": duration,
        "throughput_req_s": len(ok) / duration, "output_tok_s": sum(o.tokens for o in ok) / duration,
        "goodput_req_s": len(good) / duration, "goodput_tok_s": sum(o.tokens for o in good) / duration,
        "ttft_s": _pct([o.ttft for o in ok]), "tpot_s": _pct([o.tpot for o in ok]),
        "e2e_s": _pct([o.e2e for o in ok]),
        "preemptions_per_request": None if extras.get("preemptions") is None else extras["preemptions"] / n,
        "peak_kv_usage": extras.get("peak_kv_usage"),
        "compilations_after_warmup": extras.get("compilations_after_warmup"),  # in process only
    }
    tenants = sorted({o.tenant for o in outcomes if o.tenant})
    if tenants:
        row["tenants"] = {t: {"ttft_s": _pct([o.ttft for o in ok if o.tenant == t]),
                              "rejected": sum(o.code == "RESOURCE_EXHAUSTED" for o in outcomes if o.tenant == t)}
                          for t in tenants}
    row["slo_met"] = slo.met(row)
    return row


def search(trial: Callable[[float, int], dict], rates: list[float], slo: SLO, trials: int = 1,
           bisect_steps: int = 6, rel_tol: float = 0.02, log=print) -> tuple[list[dict], float | None, str]:
    """Sweep `rates` (ascending), then bisect between the last rate that met the SLO in all
    `trials` trials and the first that did not. Returns (every trial's row, the safe rate or
    None if even the lowest rate missed, a note)."""
    rows: list[dict] = []

    def passes(rate: float) -> bool:
        ok = True
        for seed in range(trials):
            row = trial(rate, seed)
            row["trial"] = seed
            rows.append(row)
            log(f"rate {rate:.4g}/s trial {seed}: TTFT p99 {_fmt(row['ttft_s']['p99'])} TPOT p99 "
                f"{_fmt(row['tpot_s']['p99'])} rejected {row['rejection_rate']:.1%} goodput "
                f"{row['goodput_req_s']:.3g} req/s -> {'meets' if row['slo_met'] else 'misses'} the SLO")
            ok = ok and row["slo_met"]
            if not ok:
                break  # one miss decides it
        return ok

    lo = hi = None
    for rate in sorted(rates):
        if passes(rate):
            lo = rate
        else:
            hi = rate
            break
    if lo is None:
        return rows, None, f"even the lowest rate ({min(rates)}/s) misses the SLO"
    if hi is None:
        return rows, lo, f"every swept rate met the SLO: the safe rate is at least {lo}/s (sweep higher)"
    for _ in range(bisect_steps):
        if (hi - lo) <= rel_tol * lo:
            break
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return rows, lo, f"safe rate in [{lo:.4g}, {hi:.4g}) req/s"


def _fmt(x):
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def plot(rows: list[dict], slo: SLO, safe: float | None, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted(rows, key=lambda r: r["rate"])
    x = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    for ax, key, title_, limit in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT", "TPOT", "end-to-end"),
                                      (slo.ttft_s, slo.tpot_s, None)):
        for q, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
            ax.plot(x, [r[key][q] for r in rows], style, label=q)
        if limit is not None:
            ax.axhline(limit, color="red", lw=1, label="SLO")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("seconds")
        ax.set_title(title_)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax = axes[3]
    ax.plot(x, [r["throughput_req_s"] for r in rows], "o-", label="throughput")
    ax.plot(x, [r["goodput_req_s"] for r in rows], "s-", label="goodput (met SLO)")
    if safe is not None:
        ax.axvline(safe, color="green", lw=1, label=f"safe rate {safe:.3g}/s")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax.set_title("throughput and goodput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------

def _pairs(text: str) -> list[tuple[str, float]]:
    out = []
    for part in filter(None, text.split(",")):
        name, _, w = part.partition("=")
        out.append((name, float(w or 1)))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--num-requests", type=int, default=None, help="the first N of the workload")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output")
    p.add_argument("--rates", default="0.5,1,2,4", help="requests per second to sweep, comma-separated")
    p.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    p.add_argument("--cv", type=float, default=3.0, help="gamma arrivals: coefficient of variation")
    p.add_argument("--tenants", type=_pairs, default=None, metavar="NAME=SHARE,...",
                   help="tenant mix: each request's tenant drawn by share (its own bearer token)")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--max-rejection", type=float, default=0.0, help="fraction of requests refused")
    p.add_argument("--trials", type=int, default=2, help="trials per rate (different arrival seeds)")
    p.add_argument("--bisect-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=4, help="sent and discarded before the sweep")
    p.add_argument("--plot", type=Path, default=Path("capacity.png"))
    p.add_argument("--out", type=Path, default=None, help="also write the JSON table here")
    p.add_argument("--server", default=None, help="loopback host:port of a running server")
    p.add_argument("--tokenizer", default=None, help="with --server: HF tokenizer folder ('fake' for --fake-model servers)")
    p.add_argument("--simulate", action="store_true", help="virtual time, engine in process (needs --fake-model)")
    p.add_argument("--sim-step-ms", type=float, default=10.0)
    p.add_argument("--sim-token-ms", type=float, default=0.0)
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
    return args


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
        target = SimTarget(lambda: build_engine(args)[0],
                           lambda tokens: (args.sim_step_ms + args.sim_token_ms * tokens) / 1000)
        what = "simulated fake model"
    elif args.server:
        from jaxserve.server.fake_engine import fake_tokenizer
        from jaxserve.tokenizer import Tokenizer
        if not args.tokenizer:
            raise SystemExit("capacity: --server needs --tokenizer (the model's HF folder, or 'fake')")
        tokenizer = fake_tokenizer() if args.tokenizer == "fake" else Tokenizer.from_hf_folder(args.tokenizer)
        target = GrpcTarget(args.server, timeout=args.timeout)
        what = args.server
    else:
        from jaxserve.server.app import BackgroundServer
        from jaxserve.server.cli import build_engine
        from jaxserve.server.config import ServerConfig
        engine, description = build_engine(args)
        tokenizer = engine.tokenizer
        print(f"starting an in-process server ({description.model}); warming up ...", file=sys.stderr, flush=True)
        server = BackgroundServer(engine, ServerConfig(port=0, progress=False,
                                                       max_queued_requests=args.max_queued_requests),
                                  description=description)
        server.start(ready_timeout=3600)
        target = GrpcTarget(server.address, server.server, args.timeout)
        what = f"{description.model} in process"
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
             f"{' + fair share' if args.fair_share else ''}")
    plot(rows, slo, safe, args.plot, title)
    result = {"target": what, "workload": str(args.workload), "num_requests": len(requests),
              "arrival": args.arrival, "cv": args.cv if args.arrival == "gamma" else None,
              "slo": dataclasses.asdict(slo), "trials": args.trials, "safe_rate": safe, "note": note,
              "scheduling_policy": args.scheduling_policy, "fair_share": args.fair_share,
              "rows": rows, "plot": str(args.plot)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{note}", file=sys.stderr)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
