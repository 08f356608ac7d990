"""capacity.py's statistics and search: one trial's row (goodput, latency percentiles,
rejections, preemptions, peak KV), the sweep-then-bisect search for the highest rate meeting
the SLO in every trial, and the curve's PNG."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    max_rejection: float = 0.0

    def request_ok(self, o) -> bool:
        return (o.code == "OK" and o.ttft is not None and o.ttft <= self.ttft_s
                and (o.tpot is None or o.tpot <= self.tpot_s))

    def met(self, row: dict) -> bool:
        t, p = row["ttft_s"]["p99"], row["tpot_s"]["p99"]
        return (row["completed"] > 0 and t is not None and t <= self.ttft_s
                and (p is None or p <= self.tpot_s) and row["rejection_rate"] <= self.max_rejection)


def _pct(values, qs=(50, 95, 99)):
    v = [x for x in values if x is not None]
    return {f"p{q}": (float(np.percentile(v, q)) if v else None) for q in qs}


def summarize(rate: float, outcomes: list, duration: float, extras: dict, slo: SLO) -> dict:
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
        # prompt tokens the prefix cache answered (every prompt is distinct: 0 expected)
        "prefix_cache_hit_tokens": extras.get("prefix_cache_hit_tokens"),
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
