"""Backend tables: one per kernel family, each row one implementation.

A `Backend` row says what an implementation is called (the name the config field takes), the
platforms it runs on, why it cannot run on this machine at all (`unavailable`: a library not
built, a GPU of the wrong generation), why it cannot take this model (`unsupported`: head dim,
dtypes, page size), and the callable that runs it. A `Table` is the family's rows plus the
order "auto" tries on each platform.

`Table.resolve` runs once, at start-up, and returns the row whose callable the model is then
given (attention: sharding/ops.py's ATTENTION, through model/paged_attention.make_paged_attend;
quantized matmul: sharding/quantized_matmul.py's QUANTIZED_MATMUL, through the Decoder's
`quantized_matmul`). Nothing is looked up again per call. A refusal is a ValueError naming the
field and the reason; "auto" never falls back silently: it logs once which row it took and why
it passed over the rows it preferred.

Adding a backend is one row in its family's table (and its name in the family's declared names,
which a test holds equal to the table's).

Compiling for another machine (`jaxserve compile`, jaxserve/aot/): inside `targeting(platform,
devices)` every table resolves for that platform and its compile-only devices instead of this
process's backend, so the programs compiled for a TPU topology on a CPU host take exactly the rows
a TPU host's `serve` would take.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from typing import Callable, Mapping, Sequence

import jax


# (platform, devices) being compiled for, or None: this process's own backend.
_TARGET: contextvars.ContextVar[tuple[str, tuple] | None] = contextvars.ContextVar("jaxserve_target", default=None)


@contextlib.contextmanager
def targeting(platform: str, devices: Sequence = ()):
    """Resolve every backend table for `platform` (and its `devices`, e.g. compile-only TPU
    devices of a topology) inside this block, whatever backend this process runs on."""
    token = _TARGET.set((platform, tuple(devices)))
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> str:
    """The platform programs are built for: the `targeting` one, else jax's default backend."""
    target = _TARGET.get()
    return target[0] if target is not None else jax.default_backend()


def target_devices() -> list:
    """The devices programs are built for: the `targeting` ones, else jax.devices()."""
    target = _TARGET.get()
    return list(target[1]) if target is not None and target[1] else jax.devices()


def _never(**_) -> str | None:
    return None


def _always_here() -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    platforms: tuple[str, ...]  # jax.default_backend() names it runs on
    fn: Callable  # the implementation, in its family's calling convention
    unsupported: Callable[..., str | None] = _never  # (**model shapes) -> why not, or None
    unavailable: Callable[[], str | None] = _always_here  # why not on this machine, or None
    instead: str = "'xla'"  # what to suggest when this one is refused


@dataclasses.dataclass(frozen=True)
class Table:
    field: str  # the config field naming a row, used in every refusal and log line
    rows: tuple[Backend, ...]
    # platform -> (name, why "auto" passes over it here or None), in order of preference; the
    # first one not passed over and not refused is taken
    auto: Callable[[str], tuple[tuple[str, str | None], ...]]
    logger: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rows)

    def row(self, name: str) -> Backend:
        for r in self.rows:
            if r.name == name:
                return r
        raise ValueError(f"{self.field}: {name!r} is not available; choose one of {self.names} or 'auto'")

    def refusal(self, row: Backend, platform: str, shapes: Mapping) -> str | None:
        """Why `row` cannot serve here (platform, machine, model shapes), or None."""
        if platform not in row.platforms:
            need = "/".join(p.upper() for p in row.platforms)
            return f"{self.field}: {row.name!r} needs a {need} backend, this one is {platform!r}; use {row.instead}"
        return row.unavailable() or (row.unsupported(**shapes) if shapes else None)

    def resolve(self, name: str, platform: str | None = None, **shapes) -> Backend:
        """The row for `name` ("auto": by platform), checked for this platform, this machine and,
        given `shapes` (keyword arguments of the rows' `unsupported`), this model."""
        platform = platform or target_platform()
        if name != "auto":
            row = self.row(name)
            why = self.refusal(row, platform, shapes)
            if why is not None:
                raise ValueError(why if why.startswith(self.field) else f"{self.field}: {name!r} cannot run: {why}")
            return row
        passed, refused = [], False
        for cand, skip in self.auto(platform):
            refusal = self.refusal(self.row(cand), platform, shapes)
            why = refusal or skip
            if why is None:
                # A warning only when a kernel auto prefers could not take this model or machine (a
                # fallback the user should know of); a row auto skips by policy is just information.
                _say_once(self.logger, logging.WARNING if refused else logging.INFO,
                          f"{self.field} 'auto' on {platform}: {cand!r}" +
                          "".join(f"; not {n!r}: {w}" for n, w in passed))
                return self.row(cand)
            passed.append((cand, why))
            refused = refused or refusal is not None
        raise ValueError(f"{self.field}: 'auto' found nothing to run on {platform!r}: " +
                         "; ".join(f"{n!r}: {w}" for n, w in passed))


@functools.cache
def _say_once(logger: str, level: int, message: str) -> None:
    logging.getLogger(logger).log(level, message)


def say_once(logger: str, message: str) -> None:
    """Log `message` at INFO once per process (a choice made at start-up, not per call)."""
    _say_once(logger, logging.INFO, message)


def warn_once(logger: str, message: str) -> None:
    """Log `message` at WARNING once per process (a start-up choice that will cost the user)."""
    _say_once(logger, logging.WARNING, message)


def say_once_clear() -> None:
    """Forget what was logged (tests that read the log line twice)."""
    _say_once.cache_clear()
