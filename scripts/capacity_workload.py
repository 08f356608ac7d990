"""capacity.py's workload: request lengths from a file, natural-text prompts of those lengths,
arrival times (Poisson, bursty gamma, constant) and an optional tenant mix."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

MAX_REQUESTS = 5000  # per trial: a load generator must stay bounded
MAX_RATE = 1000.0


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    tenant: str = ""


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


def parse_pairs(text: str) -> list[tuple[str, float]]:
    """'a=3,b=1' -> [('a', 3.0), ('b', 1.0)] (a bare name weighs 1)."""
    out = []
    for part in filter(None, text.split(",")):
        name, _, w = part.partition("=")
        out.append((name, float(w or 1)))
    return out
