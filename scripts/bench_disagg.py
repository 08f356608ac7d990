"""When prefill/decode disaggregation pays: colocated serving with chunked prefill on two devices
(two replicas, each taking half the Poisson arrivals) against one prefill and one decode device
(scripts/capacity_disagg.py), in virtual time, on the same requests, per arrival rate: TTFT and
TPOT p50 / p99, goodput at the SLO (requests/s meeting both, and their output tokens/s),
transfer bytes and seconds per request.

Step costs: a roofline per device for the model and chip below (compute: 2 x parameters FLOPs
per token at the chip's dense peak; memory: every weight once per step plus the KV the running
sequences hold, at its bandwidth; the slower bound wins), labelled ANALYTIC: not measured, not
compiled. It is what separates the two phases (a 2,048-token prefill chunk is compute-bound
and costs several decode steps), which is what the crossover is about. The engines are the real
Engine and scheduler with the fake runner; prompt contents do not change a step's cost, so the
prompts are natural text only to keep to the project's rule.

Workloads: `long` (prompts 2,048-8,192 tokens uniform, outputs 96-160: the long-prompt,
strict-TPOT case) and `mixed` (../shared/workloads/serving-mixed-200.json).

    python scripts/bench_disagg.py --workload long --rates 0.5,1,2,3,4 --slo-ttft-ms 3000 --slo-tpot-ms 25
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from capacity_disagg import DisaggSimTarget  # noqa: E402
from capacity_search import SLO, summarize  # noqa: E402
from capacity_targets import SimTarget  # noqa: E402
from capacity_workload import arrival_times, load_lengths, make_requests  # noqa: E402

# Llama-3.1-8B in bf16 (config.json: 32 layers, 8 KV heads of 128, 8.03e9 parameters).
MODEL = dict(name="Llama-3.1-8B bf16", params=8.03e9, weight_bytes=16.06e9, kv_bytes_per_token=32 * 2 * 8 * 128 * 2)
# H100 SXM (NVIDIA's datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB).
CHIP = dict(name="H100 SXM", flops=989e12, bandwidth=3.35e12, hbm=80e9)


def roofline_step_s(tokens: int, kv_tokens: int) -> float:
    flops = 2 * MODEL["params"] * tokens  # attention's own FLOPs left out: the weights' dominate below 8k
    bytes_ = MODEL["weight_bytes"] + kv_tokens * MODEL["kv_bytes_per_token"]
    return max(flops / CHIP["flops"], bytes_ / CHIP["bandwidth"])


def long_lengths(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(2048, 8192), rng.randint(96, 160)) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["long", "mixed"], default="long")
    p.add_argument("--rates", default="0.5,1,2,3")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--slo-ttft-ms", type=float, default=3000)
    p.add_argument("--slo-tpot-ms", type=float, default=25)
    p.add_argument("--transfer-gbps", type=float, default=25.0, help="the prefill->decode link, GB/s")
    p.add_argument("--transfer-latency-ms", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from jaxserve.engine import fake_model
    from jaxserve.server.fake_engine import fake_tokenizer, make_fake_engine
    # The fake model re-reads every sequence's whole history from its pages each step (tests
    # rely on it: tests/test_disagg_sim.py); at 8k-token contexts that is most of the run's
    # time, and virtual time does not depend on it, so the benchmark turns it off.
    fake_model.FakeModel._check_history = lambda *a, **k: None
    page = 16
    kv_bytes = CHIP["hbm"] * 0.9 - MODEL["weight_bytes"] - 4e9  # 4 GB of activations and workspace
    pages = int(kv_bytes / (MODEL["kv_bytes_per_token"] * page))
    buckets = tuple(b for b in (16, 64, 128, 256, 512, 1024, 2048, 4096) if b <= args.chunk)
    if buckets[-1] != args.chunk:
        buckets += (args.chunk,)

    def engine():
        return make_fake_engine(max_model_len=8192 + 256, page_size=page, num_pages=pages,
                                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.chunk,
                                token_buckets=buckets)

    if args.workload == "long":
        lengths = long_lengths(args.num_requests, args.seed)
    else:
        lengths = load_lengths(ROOT.parent / "shared" / "workloads" / "serving-mixed-200.json", args.num_requests, None)
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    tok = fake_tokenizer()
    colocated = SimTarget(engine, lambda t: roofline_step_s(t, 0), kv_step_cost=roofline_step_s)
    disagg = DisaggSimTarget(engine, roofline_step_s, MODEL["kv_bytes_per_token"] * page,
                             args.transfer_gbps, args.transfer_latency_ms / 1000)
    print(f"ANALYTIC roofline step costs: {MODEL['name']} on {CHIP['name']} x 2 devices; KV pool {pages} pages "
          f"x {page}; chunk {args.chunk}; link {args.transfer_gbps:g} GB/s + {args.transfer_latency_ms:g} ms; "
          f"workload {args.workload} ({len(lengths)} requests, mean prompt "
          f"{sum(a for a, _ in lengths) / len(lengths):.0f}, mean output {sum(b for _, b in lengths) / len(lengths):.0f}); "
          f"SLO TTFT p99 <= {args.slo_ttft_ms:g} ms, TPOT p99 <= {args.slo_tpot_ms:g} ms", flush=True)
    print("| rate/s | mode | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | goodput req/s | "
          "goodput tok/s | SLO met | MB moved / req | transfer ms / req |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        reqs = make_requests(tok, lengths, args.seed)
        arr = arrival_times(len(reqs), rate, "poisson", random.Random(args.seed))
        # Two colocated replicas: a random half of a Poisson stream is a Poisson stream at half
        # the rate, so one replica at rate / 2 has the pair's latency distribution and half
        # its throughput.
        half = [r for j, r in enumerate(reqs) if j % 2 == 0]
        arr_half = arrival_times(len(half), rate / 2, "poisson", random.Random(args.seed))
        out, dur, extras = colocated.run(half, arr_half)
        c = summarize(rate, out, dur, extras, slo)
        c["itl_s"] = _itl(out)
        for k in ("throughput_req_s", "output_tok_s", "goodput_req_s", "goodput_tok_s"):
            c[k] *= 2
        out, dur, extras = disagg.run(reqs, arr)
        dz = summarize(rate, out, dur, extras, slo)
        dz["itl_s"] = _itl(out)
        dz["transfer"] = {k: extras[k] for k in ("handovers", "transfer_bytes", "mean_transfer_s",
                                                 "mean_handover_wait_s", "prefill_queue_peak")}
        for mode, r in (("colocated x2", c), ("1 prefill + 1 decode", dz)):
            t = r.get("transfer")
            moved = f"{t['transfer_bytes'] / max(1, t['handovers']) / 1e6:.0f}" if t else ""
            xfer = f"{(t['mean_transfer_s'] + t['mean_handover_wait_s']) * 1e3:.1f}" if t else ""
            print(f"| {rate:g} | {mode} | {_ms(r['ttft_s']['p50'])} | {_ms(r['ttft_s']['p99'])} | "
                  f"{_ms(r['tpot_s']['p50'])} | {_ms(r['tpot_s']['p99'])} | {_ms(r['itl_s']['p99'])} | {r['goodput_req_s']:.2f} | "
                  f"{r['goodput_tok_s']:.0f} | {'yes' if r['slo_met'] else 'no'} | {moved} | {xfer} |", flush=True)
            rows.append({"mode": mode, **r})
    result = {"workload": args.workload, "model": MODEL, "chip": CHIP, "chunk": args.chunk,
              "transfer_gbps": args.transfer_gbps, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print("RESULT " + json.dumps({"workload": args.workload, "rates": args.rates,
                                  "met": [[r["mode"], r["rate"], r["slo_met"]] for r in rows]}))
    return 0


def _itl(outcomes) -> dict:
    """Inter-token latency percentiles over every gap of every completed request."""
    import numpy as np
    gaps = [g for o in outcomes if o.code == "OK" for g in o.gaps]
    return {q: (float(np.percentile(gaps, int(q[1:]))) if gaps else None) for q in ("p50", "p99")}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
