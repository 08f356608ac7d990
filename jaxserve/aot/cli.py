"""`jaxserve compile --topology v5e:2x4|cuda:h200x8 --model DIR [engine flags] [--json OUT] [--aot-dir DIR]`:
the step programs `serve` would compile for that machine, compiled here (jaxserve/aot/
compile_report.py), their table printed, the report written as JSON. Exit 0 when they compile
and fit, 2 with one line when the model does not fit (naming what and by how much) or the
topology cannot be compiled for here."""

from __future__ import annotations

import json
import os
import sys

from jaxserve import flags
from jaxserve.config import EngineConfig, LoadConfig


def add_compile_command(sub) -> None:
    c = sub.add_parser("compile", help="compile the engine's step programs for a TPU topology or NVIDIA GPUs on "
                                       "this machine (no accelerator needed): compile times, HBM per chip, KV "
                                       "pages that fit")
    c.add_argument("--topology", required=True,
                   help="a TPU topology name libtpu accepts (v5e:2x2, v5e:2x4, v6e:2x4, v5p:2x2x1, ...; needs "
                        "libtpu: make tpu-compile) or cuda:h100xN / cuda:h200xN (N <= 8; needs jax[cuda12]: "
                        "make gpu-compile)")
    c.add_argument("--json", dest="json_out", metavar="OUT", help="write the report as JSON here")
    c.add_argument("--context", type=int, action="append", metavar="TOKENS",
                   help="context length(s) of the predicted decode speeds (default 1024)")
    flags.add_flags(c, LoadConfig, "model (LoadConfig; --model: a folder whose config.json is read, weights "
                                   "are not needed)")
    # --aot-dir (EngineConfig.aot_dir) here names where to write the executables `serve --aot-dir`
    # loads (jaxserve/aot/executable_store.py).
    flags.add_flags(c, EngineConfig, "engine (EngineConfig; --aot-dir: write each compiled step there)")
    flags.add_log_flags(c)
    c.set_defaults(run=cmd_compile)


def cmd_compile(args) -> int:
    # The compile-only devices come from libtpu; no backend of this machine may claim them.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # libtpu takes a lock file so that two processes never drive one chip; compile-only devices
    # drive none, and two compiles (or a compile beside a TPU job) may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jaxserve.aot.compile_report import CompileFailed, DoesNotFit, compile_for, format_table
    from jaxserve.aot.targets import TargetError, resolve_target
    load = flags.from_args(LoadConfig, args)
    config = flags.from_args(EngineConfig, args)
    if load.model is None:
        print("jaxserve: error: model: compile needs --model, a folder with the model's config.json", file=sys.stderr)
        return 2
    try:
        target = resolve_target(args.topology)
        report = compile_for(target, load.model, load, config, progress=flags.progress_enabled(args),
                             aot_dir=config.aot_dir, contexts=tuple(args.context or (1024,)))
    except (DoesNotFit, TargetError, CompileFailed, ValueError) as e:
        # ValueError: the engine's own refusals of these flags for this model (a tp the heads or
        # quantization groups do not divide), named as `serve` would name them.
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0
