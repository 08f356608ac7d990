"""A progress bar over the tensors a load reads, for a person watching a big model load.

The caller that knows whether anyone is watching (jaxserve/loading.py, `jaxserve convert`) opens
`bar(...)`; the readers (the safetensors and GGUF getters) `tick()` once per tensor, and a
step that changes what the time goes to (quantize-on-load) renames it with `describe()`. With no
bar open, or stderr not a terminal, every call here is a no-op: tests and pipes see nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

_bar: contextvars.ContextVar = contextvars.ContextVar("checkpoints_progress_bar", default=None)


@contextlib.contextmanager
def bar(desc: str, enabled: bool = True):
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    from tqdm import tqdm
    b = tqdm(desc=desc, unit="tensor", leave=False, file=sys.stderr, dynamic_ncols=True)
    token = _bar.set(b)
    try:
        yield b
    finally:
        _bar.reset(token)
        b.close()


def tick(total: int | None = None) -> None:
    """One tensor read; `total`: how many the checkpoint holds (sets the bar's length once)."""
    b = _bar.get()
    if b is None:
        return
    if total and b.total is None:
        b.total = total
    b.update(1)


def describe(desc: str) -> None:
    b = _bar.get()
    if b is not None:
        b.set_description(desc)
