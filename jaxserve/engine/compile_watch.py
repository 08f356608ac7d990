"""Counts XLA compilations process-wide, so the engine can report them and tests can forbid
any after warm-up. It listens to jax.monitoring's backend-compile event, which fires for every
executable jax obtains, whether XLA built it or the persistent compilation cache supplied it
(cache hits are also counted on their own, so `compiles() - cache_hits()` were really built)."""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_counts = {"compiles": 0, "cache_hits": 0}
_installed = False


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _counts["compiles"] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _installed = True


def compiles() -> int:
    install()
    return _counts["compiles"]


def cache_hits() -> int:
    install()
    return _counts["cache_hits"]


class CompilationAfterWarmup(RuntimeError):
    """An executable was compiled after warm-up: some shape escaped the bucket lists."""
