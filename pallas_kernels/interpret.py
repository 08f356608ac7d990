"""What the kernels' `interpret` argument means, in one place.

interpret = False          compile for the device;
            True / "nan"   the interpret mode, uninitialised buffers filled with NaN (JAX's default);
            "zero"         the interpret mode, uninitialised buffers filled with zeros.

Why two fills: NaN catches a read of memory nobody wrote when the value reaches the output
(NaN propagates), but it also hides bugs that *test* for NaN or non-finiteness to decide that
something was not written. A device's memory holds stale, finite bits, so a kernel must be
right under zeros too (issue 22: the GPU kernel's split merge passed under NaN, was wrong on
zeros). Tests run every interpret-mode kernel under both fills (tests/conftest.py `mem_fill`).
The value is a static argument of the jitted kernels, so each fill gets its own trace.
"""

from __future__ import annotations

import os

FILLS = ("nan", "zero")
FILL_ENV = "JAXSERVE_INTERPRET_FILL"  # the fill of the "pallas_*_interpret" attention / matmul impls


def impl_fill() -> str:
    """The fill the seams (sharding/ops.py, sharding/quantized_matmul.py) give the kernels for a
    "pallas_*_interpret" impl: $JAXSERVE_INTERPRET_FILL, default "nan". Read while tracing and
    passed on as the kernels' static `interpret` value, so a change retraces the kernel."""
    fill = os.environ.get(FILL_ENV, "nan")
    if fill not in FILLS:
        raise ValueError(f"{FILL_ENV}={fill!r}: expected one of {FILLS}")
    return fill


def fill_of(interpret) -> str | None:
    """None (compile for the device) or the fill of uninitialised memory."""
    if interpret is False or interpret is None:
        return None
    if interpret is True:
        return "nan"
    if interpret in FILLS:
        return interpret
    raise ValueError(f"interpret={interpret!r}: expected False, True or one of {FILLS}")


def gpu_params(interpret):
    """Mosaic GPU interpret-mode parameters, or None to compile. InterpretGPUParams lives in
    jax._src in this JAX (0.10), with no public alias yet: imported here only."""
    fill = fill_of(interpret)
    if fill is None:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(uninitialized_memory=fill)


def tpu_params(interpret):
    """TPU interpret-mode parameters (pltpu.InterpretParams), or False to compile."""
    fill = fill_of(interpret)
    if fill is None:
        return False
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams(uninitialized_memory=fill)


def generic_param(interpret):
    """pallas_call's `interpret` for Pallas's generic interpret mode (the kernel body as plain
    XLA): False, True (NaN fill) or "zero". That mode's fill is fixed at NaN in this JAX; the
    tests turn it into zeros around the call (tests/test_quantized_matmul.py `generic_zero_fill`),
    and the distinct value keeps the two fills' traces and executables apart."""
    fill = fill_of(interpret)
    return False if fill is None else (True if fill == "nan" else fill)
