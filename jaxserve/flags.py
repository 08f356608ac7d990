"""One generator of command-line flags, from the config dataclasses (config_engine.py,
server/config.py). Every entry point that loads a model or builds an engine (`jaxserve
generate` / `serve`, scripts/generate_batch.py, bench_*.py, capacity.py) calls these, so a
knob is declared once (its `option()` in the dataclass) and spelled the same everywhere:

    add_engine_flags(parser)                 --model ... --quantize ... --max-num-seqs ... --tp ...
    load, engine = engine_configs(args)      LoadConfig, EngineConfig; every check already run
    jaxserve.engine.build.build_llm(args, prog)  the LLM those flags describe (offline scripts)
    add_log_flags(parser); setup_logging(args)

A field becomes --field-name (or its declared `flag`), plus its aliases (vLLM's names); the
value lands under the field's own name in the namespace. A nested dataclass field (EngineConfig
.scheduler) contributes its fields as flat flags. Defaults are the dataclass's own, so a flag
left out means exactly what the dataclass says. Standard library only: building a parser must
stay instant (no jax import).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Callable, Iterable

from jaxserve.config_base import ConfigError
from jaxserve.config_engine import EngineConfig, LoadConfig

_FIELDS_KEY = "_config_fields"  # namespace attribute: the field names the generator added
LOG_LEVELS = ("debug", "info", "warning", "error")

_PLAIN = {"int": int, "float": float, "str": str}


def _value_type(f: dataclasses.Field) -> Callable[[str], Any]:
    parse = f.metadata.get("parse")
    if parse is None:
        base = str(f.type).replace(" ", "").replace("|None", "")
        if base not in _PLAIN:
            raise TypeError(f"{f.name}: no parser for {f.type!r}; declare option(parse=...)")
        parse = _PLAIN[base]

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # argparse prints ArgumentTypeError's text as is
            raise argparse.ArgumentTypeError(str(e) if parse not in _PLAIN.values()
                                             else f"expected {parse.__name__}, got {text!r:.80}") from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _units(unit: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            return int(float(text) * unit)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r:.80}") from None
    return convert


def _nested(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds, when it is one (EngineConfig.scheduler)."""
    if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
        return f.default_factory  # type: ignore[return-value]
    return None


def cli_fields(cls: type) -> Iterable[dataclasses.Field]:
    """The fields of `cls` that are flags, nested dataclasses flattened."""
    for f in dataclasses.fields(cls):
        inner = _nested(f)
        if inner is not None:
            yield from cli_fields(inner)
        elif f.metadata.get("cli", False):
            yield f


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    return (f.metadata.get("flag") or "--" + f.name.replace("_", "-"),) + tuple(f.metadata.get("aliases", ()))


def add_flags(parser, cls: type, title: str | None = None, exclude: Iterable[str] = ()) -> None:
    """One flag per field of `cls` (see the module doc); `exclude`: field names an entry point
    leaves out (e.g. a benchmark whose --seed is its workload's)."""
    exclude = set(exclude)
    target = parser.add_argument_group(title) if title else parser
    added = list(parser.get_default(_FIELDS_KEY) or ())
    for f in cli_fields(cls):
        if f.name in exclude:
            continue
        m = f.metadata
        default = f.default
        help_ = m["help"]
        if str(f.type) == "bool":
            if m.get("negate"):
                target.add_argument(*flag_names(f), dest=f.name, action="store_false", default=default,
                                    help=help_)
            else:
                target.add_argument(*flag_names(f), dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=default, help=f"{help_} (default: {'on' if default else 'off'})")
        else:
            if default not in (None, (), "") and "default" not in help_:
                help_ = f"{help_} (default: {default})"
            target.add_argument(*flag_names(f), dest=f.name, type=_value_type(f), default=default,
                                choices=m.get("choices"), metavar=m.get("metavar"), help=help_)
            for alias, unit in m.get("unit_aliases", ()):
                target.add_argument(alias, dest=f.name, type=_units(unit), default=argparse.SUPPRESS,
                                    metavar="N", help=f"{f.name} in units of {unit} bytes")
        added.append(f.name)
    parser.set_defaults(**{_FIELDS_KEY: tuple(added)})


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from the flags add_flags made (fields left out keep their defaults); raises
    ConfigError, naming the field, if a value or a combination is refused."""
    given = set(getattr(args, _FIELDS_KEY, ()))
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        inner = _nested(f)
        if f.name in overrides:
            kw[f.name] = overrides[f.name]
        elif inner is not None:
            kw[f.name] = from_args(inner, args, **{k: v for k, v in overrides.items()
                                                   if k in {g.name for g in dataclasses.fields(inner)}})
        elif f.name in given:
            kw[f.name] = getattr(args, f.name)
    try:
        return cls(**kw)
    except TypeError as e:  # a value of the wrong type reached a check that assumed the right one
        raise ConfigError(f"{cls.__name__}: {e}") from None


def changed_fields(cls: type, args: argparse.Namespace) -> list[dataclasses.Field]:
    """The flag fields of `cls` whose parsed value is not the field's default: the flags the
    user set to something else (an entry point that takes them only in some mode refuses
    them in the others by name, rather than ignoring them)."""
    given = set(getattr(args, _FIELDS_KEY, ()))
    out = []
    for f in cli_fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if f.name in given and getattr(args, f.name) != default:
            out.append(f)
    return out


# ---- what every engine-building entry point uses ----------------------------------------------

def add_engine_flags(parser, exclude: Iterable[str] = ()) -> None:
    """The model flags (LoadConfig) and the engine's (EngineConfig, with its scheduler limits)."""
    add_flags(parser, LoadConfig, "model (LoadConfig)", exclude)
    add_flags(parser, EngineConfig, "engine (EngineConfig)", exclude)


def engine_configs(args: argparse.Namespace, **overrides: Any) -> tuple[LoadConfig, EngineConfig]:
    load_kw = {k: v for k, v in overrides.items() if k in {f.name for f in dataclasses.fields(LoadConfig)}}
    engine_kw = {k: v for k, v in overrides.items() if k not in load_kw}
    return from_args(LoadConfig, args, **load_kw), from_args(EngineConfig, args, **engine_kw)


def engine_configs_or_exit(args: argparse.Namespace, prog: str, **overrides: Any) -> tuple[LoadConfig, EngineConfig]:
    """engine_configs for scripts: a refused value or combination is one line and exit status 2
    (argparse's convention), before anything is loaded."""
    try:
        return engine_configs(args, **overrides)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def llm_kwargs(load: LoadConfig, engine: EngineConfig) -> dict[str, Any]:
    """jaxserve.LLM's keyword arguments for these configs."""
    return dict(model=load.model, dtype=load.dtype, quantize=load.quantize,
                quantize_group_size=load.quantize_group_size, quant_impl=load.quant_impl,
                matmul_impl=load.matmul_impl, speculative_model=load.speculative_model,
                speculative_quantize=load.speculative_quantize, engine_config=engine)


# ---- logging ------------------------------------------------------------------------------------

def add_log_flags(parser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="what jaxserve logs to stderr; warning and above also hide progress bars "
                             "(default: info)")


def setup_logging(level: str = "info") -> None:
    """jaxserve's loggers at `level`, to stderr unless the host process (a test runner, an
    application embedding jaxserve) configured logging already; third-party loggers stay at
    their own levels."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jaxserve").setLevel(level.upper())


def progress_enabled(args: argparse.Namespace) -> bool:
    """Progress bars: only for a person watching (stderr a TTY), not with --no-progress or a
    --log-level of warning and above."""
    asked_off = getattr(args, "no_progress", False) or getattr(args, "progress", True) is False  # serve's
    return (not asked_off and sys.stderr.isatty()
            and getattr(args, "log_level", "info") in ("debug", "info"))


__all__ = ["add_engine_flags", "add_flags", "add_log_flags", "changed_fields", "cli_fields", "engine_configs",
           "engine_configs_or_exit", "flag_names", "from_args", "llm_kwargs", "progress_enabled", "setup_logging"]
