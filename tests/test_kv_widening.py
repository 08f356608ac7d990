"""A 16-bit KV cache on XLA:CPU: the start-up warning of paged_attention.kv_widening_warning is
said exactly where the engine's compiled step widens the whole cache (or the int8 cache's bf16
scales) to float32, which jax 0.10's XLA:CPU did every layer of every step and jax 0.12's does
not. Both legs run this file (`make test` on jax 0.10, `make test-jax-current` on 0.12): each
checks the warning against the program its own XLA compiled. And the load's warning for bfloat16
weights that run through jax 0.10's XLA:CPU instead of the native packed kernel
(loading.cpu_bfloat16_warning)."""

from __future__ import annotations

import logging
import math
import re

import jax.numpy as jnp
import pytest

from conftest import ROOT, byte_tokenizer
from jaxserve.model.paged_attention import kv_widening_warning
from sharding import backends

NUM_PAGES = 97  # prime, so no other array of the step has the cache's element count by chance


def widened_arrays(hlo: str, elements: int) -> list[str]:
    """The float32 array shapes in `hlo` that hold `elements` elements: a whole cache widened."""
    out = []
    for dims in set(re.findall(r"\bf32\[([0-9,]+)\]", hlo)):
        if math.prod(int(d) for d in dims.split(",")) == elements:
            out.append(f"f32[{dims}]")
    return out


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float32", "int8"),
                                                  ("float32", "auto")])
def test_the_warning_is_said_where_the_compiled_step_widens_the_cache(dtype, kv_cache_dtype, caplog):
    import checkpoints
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "llama_mqa", dtype)
    backends.say_once_clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.attention"):
        eng = Engine(model, byte_tokenizer(loaded.config.eos_token_ids),
                     EngineConfig(max_model_len=64, page_size=4, num_pages=NUM_PAGES, max_num_seqs=2,
                                  max_num_batched_tokens=8, token_buckets=(1, 8), kv_cache_dtype=kv_cache_dtype,
                                  attention_impl="xla"))
    said = [r.getMessage() for r in caplog.records if "widened to float32 whole" in r.getMessage()]
    kv = eng.runner.cache.k
    array = kv.scales if kv_cache_dtype == "int8" else kv  # the 16-bit array, if any
    hlo = eng.runner.lower(1).compile().as_text()
    widened = widened_arrays(hlo, math.prod(array.shape)) if jnp.dtype(array.dtype).itemsize == 2 else []
    expected = kv_widening_warning("cpu", "int8" if kv_cache_dtype == "int8" else jnp.dtype(dtype))
    assert bool(widened) == (expected is not None), (widened, expected)
    assert said == ([expected] if expected else []), said


def test_the_warning_names_the_array_and_the_way_out():
    bf16 = kv_widening_warning("cpu", jnp.bfloat16, (0, 10, 2))
    assert "bfloat16 KV cache" in bf16 and "--dtype float32" in bf16 and "jax 0.10.2" in bf16
    assert "bf16 scales" in kv_widening_warning("cpu", "int8", (0, 10, 2))
    assert "float16 KV cache" in kv_widening_warning("cpu", jnp.float16, (0, 11, 0))
    for platform, dtype, version in (("cpu", jnp.float32, (0, 10, 2)), ("tpu", jnp.bfloat16, (0, 10, 2)),
                                     ("gpu", "int8", (0, 10, 2)), ("cpu", jnp.bfloat16, (0, 12, 0, 1))):
        assert kv_widening_warning(platform, dtype, version) is None, (platform, dtype, version)


@pytest.mark.parametrize("dtype,matmul_impl,quantize", [("bfloat16", "xla", "none"), ("bfloat16", "auto", "none"),
                                                       ("float32", "xla", "none"), ("bfloat16", "xla", "int8")])
def test_the_load_warns_of_bfloat16_weights_through_xla_on_the_cpu(dtype, matmul_impl, quantize, caplog):
    import jax

    from jaxserve import loading
    backends.say_once_clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.loading"):
        lm = loading.load(ROOT / "tests" / "data" / "llama_mqa", dtype, quantize=quantize, matmul_impl=matmul_impl)
    packed = lm.model.float_matmul is not None and lm.model.float_matmul.is_packed
    said = [r.getMessage() for r in caplog.records if "order of magnitude slower" in r.getMessage()]
    warned = (dtype == "bfloat16" and quantize == "none" and not packed
              and jax.__version_info__[:2] < loading.SLOW_16BIT_CPU_BEFORE)
    assert said == ([loading.cpu_bfloat16_warning("cpu", dtype, quantize, packed)] if warned else []), said
    assert jnp.dtype(lm.model.dtype) == jnp.dtype(dtype)  # a warning, never a silent change of dtype


def test_the_bfloat16_weights_warning_names_the_ways_out():
    from jaxserve import loading
    said = loading.cpu_bfloat16_warning("cpu", "bfloat16", jax_version=(0, 10, 2))
    assert "jax 0.10.2" in said and "--matmul-impl auto" in said and "--dtype float32" in said
    for args in (("tpu", "bfloat16"), ("cpu", "float32"), ("cpu", "bfloat16", "int8"), ("cpu", "bfloat16", "none", True)):
        assert loading.cpu_bfloat16_warning(*args, jax_version=(0, 10, 2)) is None, args
    assert loading.cpu_bfloat16_warning("cpu", "bfloat16", jax_version=(0, 12, 0, 1)) is None
