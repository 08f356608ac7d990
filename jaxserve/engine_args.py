"""The engine flags of the offline scripts (scripts/generate_batch.py, bench_offline.py),
defined once: the model flags (jaxserve/model_args.py) plus one flag per EngineConfig field,
and the jaxserve.LLM built from them.

Standard library only at import time: building a parser must stay instant (no jax import).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.model_args import add_model_args, load_options


def _tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    pairs = [p.strip().rpartition("=") for p in text.split(",") if p.strip()]
    try:
        return tuple((name, float(w)) for name, _, w in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT[,...], got {text!r}") from None


def _engine_option_type(annotation: str):
    if annotation.startswith("tuple[tuple[str"):  # tenant_weights
        return _tenant_weights
    if "tuple" in annotation:
        return lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    if "int" in annotation:
        return int
    if annotation == "float":
        return float
    return str


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The model flags (--model, --dtype, --quantize ...: jaxserve/model_args.py) and one flag per
    EngineConfig field (--max-num-seqs, --page-size, ..., --no-enable-prefix-caching for a
    boolean). Flags left out keep EngineConfig's defaults."""
    g = ap.add_argument_group("engine")
    add_model_args(g)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":  # --enable-prefix-caching / --no-enable-prefix-caching
            g.add_argument(flag, dest="engine_" + f.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=f"EngineConfig.{f.name} (default {f.default!r})")
            continue
        extra = " (comma-separated)" if "tuple" in str(f.type) else ""
        extra += " ('none' disables it)" if f.name == "compilation_cache_dir" else ""
        g.add_argument(flag, dest="engine_" + f.name, type=_engine_option_type(str(f.type)),
                       default=argparse.SUPPRESS, help=f"EngineConfig.{f.name} (default {f.default!r}){extra}")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM's keyword arguments from the flags: the load options and the EngineConfig fields."""
    kw = dict(load_options(args))
    kw.update({k[len("engine_"):]: v for k, v in vars(args).items() if k.startswith("engine_")})
    if str(kw.get("compilation_cache_dir", "")).lower() == "none":
        kw["compilation_cache_dir"] = None
    return kw


def build_llm(args: argparse.Namespace, prog: str):
    """jaxserve.LLM from the flags (model, dtype, engine options); a bad option or model exits
    with one line naming `prog`, not a traceback."""
    from checkpoints import CheckpointError
    from jaxserve import LLM
    try:
        return LLM(args.model, args.dtype, progress=not args.no_progress, **engine_kwargs(args))
    except (ValueError, CheckpointError) as e:
        raise SystemExit(f"{prog}: {e}") from None
