"""A roofline prediction from a compiled program's own counts: one step on one chip takes at
least max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), with the program's FLOPs and bytes
accessed per chip from cost_analysis() and the chip's published peaks (targets.py). Every figure
made here is a prediction, labelled so wherever it is printed: nothing ran.

What cost_analysis() cannot know, the prediction adds by hand, and says so: the paged attention
kernel (a Mosaic custom call) reads each sequence's KV pages, whose number depends on the
step's context lengths, so `decode_tokens_per_s` adds B x context x KV bytes per token per chip
to a decode step's bytes.
"""

from __future__ import annotations

import dataclasses

from jaxserve.aot.targets import Chip


@dataclasses.dataclass(frozen=True)
class Roofline:
    seconds: float
    bound: str  # "compute" | "memory"


def roofline(flops: float, bytes_accessed: float, chip: Chip) -> Roofline:
    compute, memory = flops / chip.bf16_flops, bytes_accessed / chip.hbm_Bps
    return Roofline(max(compute, memory), "compute" if compute >= memory else "memory")


def decode_tokens_per_s(programs: list[dict], batch: int, context: int, kv_bytes_per_token: float,
                        chip: Chip) -> tuple[float, int] | None:
    """(predicted decode tokens/s, the bucket used) for `batch` sequences decoding at `context`
    tokens each: the smallest bucket holding `batch` tokens, its compiled FLOPs and bytes plus
    the KV pages attention reads (`kv_bytes_per_token` per chip). None if no bucket holds it."""
    fitting = [p for p in programs if p["tokens"] >= batch and p["max_seqs"] >= batch]
    if not fitting:
        return None
    p = min(fitting, key=lambda p: p["tokens"])
    step = roofline(p["flops"], p["bytes_accessed"] + batch * context * kv_bytes_per_token, chip).seconds
    return batch / step, p["tokens"]


def prefill_tokens_per_s(programs: list[dict], chip: Chip) -> tuple[float, int]:
    """(predicted prefill tokens/s, bucket) of the largest bucket: a step of prompt chunks."""
    p = max(programs, key=lambda p: p["tokens"])
    return p["tokens"] / roofline(p["flops"], p["bytes_accessed"], chip).seconds, p["tokens"]


class CompiledStepCost:
    """A step's predicted seconds from a `jaxserve compile` report, for capacity.py's virtual
    time: the smallest compiled bucket holding the step's tokens, its FLOPs and bytes per chip,
    plus attention reading `kv_tokens` tokens of KV (the pages the running sequences hold)."""

    def __init__(self, report: dict):
        from jaxserve.aot.targets import CHIPS
        self.chip = CHIPS[report["chip"]]
        self.programs = sorted(report["programs"], key=lambda p: p["tokens"])
        self.kv_bytes_per_token = report["kv_bytes_per_chip"] / max(report["kv_tokens"], 1)

    def __call__(self, tokens: int, kv_tokens: int = 0) -> float:
        p = next((p for p in self.programs if p["tokens"] >= tokens), None)
        if p is None:
            raise ValueError(f"a step of {tokens} tokens is larger than every compiled bucket "
                             f"(largest {self.programs[-1]['tokens']})")
        return roofline(p["flops"], p["bytes_accessed"] + kv_tokens * self.kv_bytes_per_token, self.chip).seconds
