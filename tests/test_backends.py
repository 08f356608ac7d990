"""The backend tables (sharding/backends.py): names equal to the declared ones, resolution once,
refusals naming the field, and "auto" saying what it took and why."""

import logging

import jax.numpy as jnp
import pytest

from jaxserve import config
from sharding import backends, ops
from sharding import quantized_matmul as qmm


def test_table_names_equal_the_declared_names():
    # The config validates attention_impl / quant_impl against these stdlib tuples before any
    # load; a row added without its name (or the reverse) would pass one check and fail the other.
    # sharding may not import jaxserve (import-linter), so it declares the tuples too: all equal.
    assert ops.ATTENTION.names == ops.ATTENTION_IMPLS == config.ATTENTION_IMPLS
    assert qmm.QUANTIZED_MATMUL.names == qmm.QUANT_IMPLS == config.QUANT_IMPLS
    from sharding import float_matmul
    assert float_matmul.FLOAT_MATMUL.names == float_matmul.MATMUL_IMPLS == config.MATMUL_IMPLS


def _table():
    def fast(x):
        return ("fast", x)

    def slow(x):
        return ("slow", x)
    return backends.Table(field="widget_impl", logger="test.backends", auto=lambda p: (("fast", None), ("slow", None)),
                          rows=(backends.Backend("fast", ("cpu",), fast,
                                                 unsupported=lambda *, width: None if width % 8 == 0 else
                                                 f"widget_impl 'fast' needs width a multiple of 8, got {width}"),
                                backends.Backend("slow", ("cpu", "gpu"), slow)))


def test_one_row_per_backend_resolves_to_its_callable(caplog):
    table = _table()
    assert table.resolve("fast", platform="cpu", width=16).fn(3) == ("fast", 3)
    assert table.resolve("slow", platform="gpu").fn(3) == ("slow", 3)
    with pytest.raises(ValueError, match=r"widget_impl: 'turbo' is not available; choose one of \('fast', 'slow'\)"):
        table.resolve("turbo", platform="cpu")
    with pytest.raises(ValueError, match="widget_impl: 'fast' needs a CPU backend, this one is 'gpu'; use 'xla'"):
        table.resolve("fast", platform="gpu")
    with pytest.raises(ValueError, match="width a multiple of 8, got 12"):
        table.resolve("fast", platform="cpu", width=12)
    backends.say_once_clear()
    with caplog.at_level(logging.INFO, logger="test.backends"):
        assert table.resolve("auto", platform="cpu", width=16).name == "fast"
        assert table.resolve("auto", platform="cpu", width=12).name == "slow"
        assert table.resolve("auto", platform="gpu").name == "slow"
    text = caplog.text
    assert "widget_impl 'auto' on cpu: 'fast'" in text
    assert "widget_impl 'auto' on cpu: 'slow'; not 'fast': widget_impl 'fast' needs width a multiple of 8" in text
    assert "widget_impl 'auto' on gpu: 'slow'; not 'fast': widget_impl: 'fast' needs a CPU backend" in text
    # A fallback because a kernel could not take the model or machine is a warning; the plain choice is not.
    levels = {r.getMessage().split(";")[0]: r.levelno for r in caplog.records}
    assert levels == {"widget_impl 'auto' on cpu: 'fast'": logging.INFO,
                      "widget_impl 'auto' on cpu: 'slow'": logging.WARNING,
                      "widget_impl 'auto' on gpu: 'slow'": logging.WARNING}
    backends.say_once_clear()


def test_a_row_auto_skips_by_policy_is_information_not_a_warning(caplog):
    # The CPU's cpu_native while AUTO_PREFERS_NATIVE is off: runnable, passed over on measurement.
    table = backends.Table(field="widget_impl", logger="test.backends",
                           auto=lambda p: (("fast", "not auto's choice yet"), ("slow", None)),
                           rows=_table().rows)
    backends.say_once_clear()
    with caplog.at_level(logging.INFO, logger="test.backends"):
        assert table.resolve("auto", platform="cpu", width=16).name == "slow"
    [record] = caplog.records
    assert record.levelno == logging.INFO and "not 'fast': not auto's choice yet" in record.getMessage()
    backends.say_once_clear()


def test_attention_refusals_name_the_field_at_start_up():
    with pytest.raises(ValueError, match="attention_impl: 'pallas_tpu' needs a TPU backend.*'pallas_tpu_interpret'"):
        ops.resolve("pallas_tpu")
    with pytest.raises(ValueError, match="attention_impl: 'triton' is not available"):
        ops.resolve("triton")
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, q_dtype=jnp.float32)
    # The interpret rows run on this CPU and take these shapes.
    assert ops.resolve("pallas_tpu_interpret", **shapes).name == "pallas_tpu_interpret"
    assert ops.resolve("xla", **dict(shapes, q_dtype=jnp.bfloat16)).fn is ops.ATTENTION.row("xla").fn


def test_quantized_matmul_resolves_once_into_what_the_model_holds():
    mm = qmm.resolve("xla")
    assert mm.name == "xla" and mm.mesh is None and mm.backend is qmm.QUANTIZED_MATMUL.row("xla")
    assert hash(mm) == hash(qmm.resolve("xla"))  # hashable: the model holds it statically
    with pytest.raises(ValueError, match="quant_impl: 'pallas_gpu' needs a GPU backend.*'pallas_gpu_interpret'"):
        qmm.resolve("pallas_gpu")
    x = jnp.ones((2, 64), jnp.float32)
    q = jnp.ones((8, 64), jnp.int8)
    s = jnp.ones((8, 2), jnp.float32)
    with pytest.raises(ValueError, match="split over 'tp' \\('n'\\) but this matmul was given no mesh"):
        mm(x, q, s, bits=8, group_size=32, split="n")
