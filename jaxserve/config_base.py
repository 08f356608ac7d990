"""What every config dataclass shares: the error type, the one-line check, and `option()`, the
field declaration that carries a field's help text and its command-line spelling(s).

`option()` is how a config field becomes a flag: jaxserve/flags.py walks the dataclasses and
reads this metadata, so a knob is declared (default, help, vLLM alias, choices) exactly once.
Standard library only, like every config module (import-linter contract).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration value is missing or outside its allowed range."""


def require(cond: bool, field: str, msg: str) -> None:
    """Raise ConfigError("field: msg") unless cond: every check names the field it is about."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def require_positive_int(obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(is_int(v) and v > 0, name, f"must be a positive integer, got {v!r}")


def option(default: Any = dataclasses.MISSING, help: str = "", *, aliases: tuple[str, ...] = (),
           choices: tuple | None = None, flag: str | None = None, parse: Callable[[str], Any] | None = None,
           metavar: str | None = None, negate: bool = False, cli: bool = True,
           unit_aliases: tuple[tuple[str, int], ...] = (), default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its command-line face.

    help: the flag's help text; aliases: other accepted spellings (vLLM's flag names, old
    names); choices: the allowed values; flag: the flag's name when not --field-name; parse:
    text -> value (default from the annotation); negate: a bool flag that stores False (e.g.
    --no-grpc for grpc_enabled); cli=False: not a flag (set from code only); unit_aliases:
    (flag, unit) pairs, flags taking a number of units (--kv-cache-mb N = N MiB of bytes)."""
    meta = dict(help=help, aliases=tuple(aliases), choices=choices, flag=flag, parse=parse,
                metavar=metavar, negate=negate, cli=cli, unit_aliases=tuple(unit_aliases))
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
