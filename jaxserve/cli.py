"""The `jaxserve` command line: `generate`, `convert`, `serve` / `client` (jaxserve/server/cli.py) and
`compile` (jaxserve/aot/cli.py).

Every user-facing failure (a bad flag value, a missing or broken checkpoint, the default model
not installed) ends in one line `jaxserve: error: ...` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jaxserve import flags
from jaxserve.config import ConfigError, EngineConfig, LoadConfig

GENERATE_ENGINES = ("dense", "paged")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="Serve LLMs with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text, continued as is")
    src.add_argument("--chat", help="one user turn, rendered through the model's chat template")
    src.add_argument("--prompt-token-ids", type=_token_ids, metavar="IDS",
                     help="the prompt as comma-separated token ids (the only prompt a model without "
                          "tokenizer files takes); the output is printed as ids too")
    g.add_argument("--engine", choices=GENERATE_ENGINES, default="dense",
                   help="dense: the single-request dense generator, the reference the paged engine is "
                        "tested against (default); paged: the serving engine (paged KV cache), "
                        "configured by the engine flags")
    flags.add_flags(g, LoadConfig, "model (LoadConfig)")
    # Every engine flag, for --engine paged. Not the engine's --seed: generate's --seed is the
    # request's own sampling seed (below), which both engines honour.
    flags.add_flags(g, EngineConfig, "engine (EngineConfig; with --engine paged)", exclude=("seed",))
    flags.add_log_flags(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, the default here (SamplingParams() and the HTTP API default to "
                        "1.0, as vLLM and OpenAI do)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stats", action="store_true", help="print token counts and timings to stderr")

    c = sub.add_parser("convert", help="write an HF folder from a GGUF file, or an Orbax checkpoint "
                                       "(float or pre-quantized) from any model")
    c.add_argument("source", type=Path, help="a .gguf file (--to hf); any model path (--to orbax)")
    c.add_argument("out_dir", type=Path)
    c.add_argument("--to", default="hf", choices=("hf", "orbax"),
                   help="hf: config.json + fp32 safetensors + tokenizer, for HF transformers; orbax: the "
                        "weights as jaxserve runs them (quantized with --quantize), loaded with no conversion")
    # Not the draft model's flags: `compile` builds the step programs, not a draft's.
    flags.add_flags(c, LoadConfig, "weights (LoadConfig)", exclude=("model", "dtype", "quant_impl", "matmul_impl",
                                                                     "speculative_model", "speculative_quantize"))
    flags.add_log_flags(c)

    from jaxserve.server.cli import add_server_commands
    add_server_commands(sub)
    from jaxserve.aot.cli import add_compile_command
    add_compile_command(sub)
    return parser


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r:.80}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def generate_params(args):
    """`generate`'s request: its own flags' defaults (greedy), not SamplingParams()'s."""
    from jaxserve.types import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def cmd_generate(args) -> int:
    from jaxserve import loading
    from jaxserve.engine.dense_generator import DenseGenerator, GenerationStats
    from jaxserve.tokenizer import IncrementalDetokenizer, with_bos
    from jaxserve.types import InvalidRequestError

    params = generate_params(args)
    load = flags.from_args(LoadConfig, args)
    # Both checked before anything loads: a refused value or combination costs no model load.
    if args.engine == "paged":
        config = flags.from_args(EngineConfig, args)
    else:
        _refuse_engine_flags(args)
    stats = GenerationStats()
    if args.engine == "paged":
        from jaxserve.engine.build import build_engine
        lm, engine = build_engine(load, config, local_devices=True, progress=flags.progress_enabled(args))
        stats.compile_s = engine.warmup(flags.progress_enabled(args))
    else:
        lm = loading.load(load.model, load.dtype, quantize=load.quantize,
                          quantize_group_size=load.quantize_group_size, quant_impl=load.quant_impl,
                          matmul_impl=load.matmul_impl,
                          progress=flags.progress_enabled(args))
    tok = lm.tokenizer
    if args.prompt_token_ids is not None:
        prompt_ids = args.prompt_token_ids
        V = lm.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < V), None)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} outside [0, {V})")
    elif args.chat is not None:
        prompt_ids = with_bos(tok.encode(tok.apply_chat_template([{"role": "user", "content": args.chat}],
                                                                 add_generation_prompt=True)), tok)
    else:
        # The one BOS rule (tokenizer.with_bos, as the engine and the server apply it): BOS for
        # Gemma, as llama.cpp and HF do; nothing for SmolLM2; never twice after a chat template.
        prompt_ids = with_bos(tok.encode(args.prompt), tok)
    if args.engine == "paged":
        tokens = _paged_tokens(engine, prompt_ids, params, stats)
    else:
        tokens = DenseGenerator(lm.model, lm.eos_token_ids).generate(prompt_ids, params, stats)
    detok = IncrementalDetokenizer(tok)
    as_ids = args.prompt_token_ids is not None or tok.ids_only
    sep = ""
    for token in tokens:
        sys.stdout.write(f"{sep}{token}" if as_ids else detok.add(token))
        sep = ","
        sys.stdout.flush()
    sys.stdout.write(("" if as_ids else detok.flush(drop_incomplete=stats.finish_reason == "length")) + "\n")
    sys.stdout.flush()
    if args.stats:
        print(f"[{stats.prompt_tokens} prompt tokens, {stats.output_tokens} generated, "
              f"finish={stats.finish_reason}, load {lm.load_s:.1f} s ({lm.format}, {lm.weights}), "
              f"compile {stats.compile_s:.1f} s{' (engine warmup)' if args.engine == 'paged' else ''}, "
              f"TTFT {stats.ttft_s * 1e3:.0f} ms, decode {stats.decode_tok_s:.1f} tok/s]", file=sys.stderr)
    return 0


def _refuse_engine_flags(args) -> None:
    """The dense generator has no paged KV cache, scheduler or mesh: an engine flag set to
    anything but its default would be silently ignored, so it is refused by name."""
    changed = flags.changed_fields(EngineConfig, args) + [
        f for f in flags.changed_fields(LoadConfig, args) if f.name in ("speculative_model", "speculative_quantize")]
    if changed:
        names = ", ".join(f.name for f in changed)
        given = ", ".join(flags.flag_names(f)[0] for f in changed)
        raise ConfigError(f"{names}: {given} {'needs' if len(changed) == 1 else 'need'} --engine paged "
                          f"(the default dense generator has no paged engine to configure)")


def _paged_tokens(engine, prompt_ids, params, stats):
    """The one request through the paged engine, its tokens as each step yields them; `stats`
    filled as DenseGenerator.generate fills it (TTFT from submission, decode after the first)."""
    import time
    stats.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    rid = engine.add_request({"prompt_token_ids": list(prompt_ids)}, params)
    t_first = None
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id != rid:
                continue
            for token in d.token_ids:
                now = time.perf_counter()
                if t_first is None:
                    t_first, stats.ttft_s = now, now - t0
                stats.decode_s = now - t_first
                stats.output_tokens += 1
                stats.token_times.append(now)
                yield token
            if d.finished:
                stats.finish_reason = d.finish_reason
    engine.pop_finished(rid)


def cmd_convert(args) -> int:
    if args.to == "orbax":
        return _convert_to_orbax(args)
    if args.quantize != "none" or args.quantize_group_size is not None:
        raise ConfigError("quantize: applies to `convert --to orbax`; --to hf writes fp32 weights")
    from checkpoints import progress
    from checkpoints.convert import write_hf_weights
    from checkpoints.gguf_loader import GGUFCheckpoint
    from jaxserve.tokenizer import Tokenizer

    ckpt = GGUFCheckpoint(args.source)
    with progress.bar("converting", flags.progress_enabled(args)):
        out = write_hf_weights(ckpt, args.out_dir)
    Tokenizer.from_gguf_metadata(ckpt.metadata).save_hf_folder(out)
    print(f"wrote {out} ({ckpt.config.architecture}, {ckpt.config.num_parameters() / 1e6:.1f}M parameters)")
    return 0


def _convert_to_orbax(args) -> int:
    """The weights as loading them with --quantize would give (float weights as stored), saved
    with their tokenizer, so a later load restores bytes and converts nothing."""
    import time

    from checkpoints import progress
    from checkpoints.orbax_io import is_orbax_checkpoint, save_orbax
    from checkpoints.quantize import describe, load_quantized_params
    from jaxserve.loading import load_tokenizer

    if args.source.is_dir() and is_orbax_checkpoint(args.source):
        raise ConfigError(f"convert: {args.source} is already an Orbax checkpoint")
    t0 = time.perf_counter()
    spec = flags.from_args(LoadConfig, args).spec
    with progress.bar("converting", flags.progress_enabled(args)):
        loaded = load_quantized_params(args.source, spec)
    out = save_orbax(args.out_dir, loaded.config, loaded.params, quantize=args.quantize)
    load_tokenizer(loaded).save_hf_folder(out)
    print(f"wrote {out} (Orbax, --quantize {args.quantize}: {describe(loaded.params)}) in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags.setup_logging(getattr(args, "log_level", "info"))
    # User errors, as opposed to bugs: these get one line, bugs keep their traceback.
    from checkpoints.errors import CheckpointError
    from jaxserve.tokenizer import TokenizerError
    from jaxserve.types import InvalidRequestError
    try:
        if hasattr(args, "run"):  # serve / client
            return args.run(args)
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_convert(args)
    except (CheckpointError, InvalidRequestError, ConfigError, TokenizerError, FileNotFoundError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `jaxserve generate ... | head` closed the pipe; not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
