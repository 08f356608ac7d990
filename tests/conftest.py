"""Shared fixtures: the default model loaded once per session, a tiny random model with a byte
tokenizer (fast engine tests), and engines built on them with small bucket lists."""

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from pallas_kernels.interpret import FILLS

# Eight fake CPU devices for the tensor-parallel tests; set before anything imports jax.
# Single-device code is unaffected: it runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

ROOT = Path(__file__).resolve().parents[1]

# The test processes never turn malloc's mmap off (host_malloc.keep_step_memory, an engine's
# warm-up): process-wide and one-way, it would reach every later test in the worker
# (test_huge_pages relies on buffers past 32 MiB being mappings of their own).
# tests/test_host_malloc.py runs it in subprocesses. import jaxserve's one malloc arena, which
# by itself maps nothing differently, stays.
from jaxserve import host_malloc  # noqa: E402

host_malloc.decline("a test process keeps malloc mmapping (tests/conftest.py)")

# Property tests: a failure must print what reproduces it (@reproduce_failure), or it is a flake
# nobody can replay. Where CI is set (.ci/run sets it) hypothesis's own "ci" profile is the
# parent: derandomized examples, the blob printed; elsewhere new examples every run, and this
# profile prints the blob too (no example database survives a fresh clone).
try:  # the TPU / GPU compile venvs (tests/tpu_compile, gpu_compile) have no hypothesis, nor use it
    from hypothesis import settings as _hypothesis_settings
except ImportError:
    pass
else:
    _hypothesis_settings.register_profile("jaxserve", print_blob=True)
    _hypothesis_settings.load_profile("jaxserve")

# `make test-native-avx2`: the native kernels' tests on another build of them (setup.py with
# JAXSERVE_NATIVE_MARCH), from a folder holding their sources and the libraries built from them.
# Checked before any test runs: a leg that quietly tested the installed build (or skipped, as
# the native matmul's tests do where no library loads) would prove nothing.
_NATIVE_DIR = os.environ.get("JAXSERVE_TEST_NATIVE_DIR")
if _NATIVE_DIR:
    from pallas_kernels.ragged_paged_attention import cpu_native as _native_attention
    from pallas_kernels.small_matmul import cpu_native as _native_matmul
    for _loader in (_native_attention, _native_matmul):
        _loader._SOURCE = Path(_NATIVE_DIR) / _loader._SOURCE.name
        _loader._load.cache_clear()
        if _loader.unavailable_reason() is not None:
            raise RuntimeError(f"JAXSERVE_TEST_NATIVE_DIR={_NATIVE_DIR}: {_loader.unavailable_reason()}")
    _want_width = os.environ.get("JAXSERVE_TEST_NATIVE_WIDTH")
    if _want_width and _native_matmul.vector_width() != int(_want_width):
        raise RuntimeError(f"JAXSERVE_TEST_NATIVE_DIR={_NATIVE_DIR}: its matmul library is built for "
                           f"{_native_matmul.vector_width()}-float vectors, not the {_want_width} asked for")

# One persistent XLA compilation cache for the test run's engines: many tests build engines on
# the same model with the same buckets, and each would otherwise compile the same step
# executables again (seconds per bucket). Fresh per run, so nothing carries between runs; under
# pytest-xdist every worker of one run shares it (same PYTEST_XDIST_TESTRUNUID), so a program
# one worker compiled is a cache hit in the other. A half-written entry read by the other
# worker is no hazard: jax warns and compiles instead (compiler._cache_read).
# Removed when the run ends (pytest_sessionfinish): left behind, a developer's /tmp gathered a
# few MB a run (900 MB over 213 runs on one machine).
def _shared_xla_cache(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"jaxserve-test-xla-{run_id}")


_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN_ID:
    XLA_CACHE = _shared_xla_cache(_RUN_ID)
    os.makedirs(XLA_CACHE, exist_ok=True)
else:
    XLA_CACHE = tempfile.mkdtemp(prefix="jaxserve-test-xla-")


def pytest_configure(config):
    # The controller of an xdist run names the run's id itself (xdist otherwise draws it out of
    # sight, when it starts the workers), so that it can remove the workers' shared cache.
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return  # a worker: the cache is shared with the other workers; the controller removes it
    shutil.rmtree(XLA_CACHE, ignore_errors=True)
    run_id = getattr(session.config.option, "testrunuid", None)
    if run_id:
        shutil.rmtree(_shared_xla_cache(run_id), ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in fp32, loaded once (about 8 s)."""
    from jaxserve import loading
    return loading.load(None, "float32")


def byte_tokenizer(eos_token_ids=(2,)):
    """A 256-token byte-level tokenizer: token i is one byte, so every multi-character string
    spans several tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from jaxserve.tokenizer import Tokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return Tokenizer(hf, eos_token_ids=eos_token_ids)


@pytest.fixture(scope="session")
def tiny_model():
    """The random-weight MQA Llama of tests/data (vocab 256, 2 layers) and a byte tokenizer."""
    import checkpoints
    model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "llama_mqa", "float32")
    return model, byte_tokenizer(loaded.config.eos_token_ids)


def make_engine(model, tokenizer, eos=(), mesh=None, draft_model=None, handover=False, **kw):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    base = dict(max_model_len=256, page_size=4, num_pages=96, max_num_seqs=8,
                max_num_batched_tokens=32, token_buckets=(1, 8, 32), compilation_cache_dir=XLA_CACHE)
    base.update(kw)
    eng = Engine(model, tokenizer, EngineConfig(**base), eos, mesh=mesh, draft_model=draft_model)
    eng.warmup(progress=False, handover=handover)
    eng.strict_compiles = True
    return eng


def first_layers(model, n):
    """The model cut to its first n decoder layers, real weights and all. For tests of code
    that runs once per layer (a kernel, a sharding rule): the same code paths at 30/n the
    cost of SmolLM2's 30 layers."""
    import dataclasses

    from jaxserve.model.llama import Llama, flat_params
    cfg = dataclasses.replace(model.cfg, num_layers=n)
    arrays = {k: (v[:n] if k.startswith("layers.") else v) for k, v in flat_params(model).items()}
    return Llama.from_arrays(cfg, arrays, dtype=model.dtype, quantized_matmul=model.quantized_matmul)


def dense_forward(model, reduce=None):
    """One jitted full forward of the dense reference model over a batch of token lists:
    seqs -> reduce(logits) [B, T, ...] as numpy, T the longest list rounded up to 64 tokens
    (padding sits at position -1: it attends to nothing and its cache writes are dropped), so
    inputs of similar length share one compiled program. `reduce` runs on device (an argmax
    keeps a batch of 49k-vocabulary logits off the host)."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxserve.model.dense_attention import init_dense_cache, make_dense_attend
    graphdef, state = nnx.split(model)  # weights as arguments, not as constants baked into the program

    @jax.jit
    def fwd(state, tokens, positions):
        m = nnx.merge(graphdef, state)
        cache = init_dense_cache(m.cfg, tokens.shape[0], tokens.shape[1], m.dtype)
        logits, _ = m(tokens, positions, cache, make_dense_attend(m.cfg), positions)
        return logits if reduce is None else reduce(logits)

    def run(seqs):
        T = -(-max(len(s) for s in seqs) // 64) * 64
        tokens = np.zeros((len(seqs), T), np.int32)
        positions = np.full((len(seqs), T), -1, np.int32)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
            positions[i, :len(s)] = np.arange(len(s))
        return np.asarray(fwd(state, tokens, positions))

    return run


def assert_dense_greedy(model, prompts, outputs, max_tokens, stop_ids=()):
    """Every output is the dense reference model's greedy continuation of its prompt.

    One full forward of the dense model over prompt + output per request: the output token at
    each step must be the argmax of the dense logits at the position before it. By induction
    that is exactly the sequence the dense generator emits one token at a time (the same
    model, causal masking: a position's logits depend only on the tokens before it), at a
    fraction of its cost: one compile and one call instead of a prefill and a decode
    executable per prompt length and a host round trip per token. The length is checked
    too: it stops at its first stop token, or at max_tokens."""
    import jax.numpy as jnp
    assert len(prompts) == len(outputs)
    greedy = dense_forward(model, lambda logits: jnp.argmax(logits, axis=-1))
    want = greedy([list(p) + list(o) for p, o in zip(prompts, outputs)])
    stops = set(stop_ids)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        o = list(o)
        assert o, f"request {i}: no output"
        pred = want[i, len(p) - 1:len(p) - 1 + len(o)].tolist()
        bad = next((j for j, (a, b) in enumerate(zip(o, pred)) if a != b), None)
        assert bad is None, (f"request {i} (prompt length {len(p)}): output token {bad} is {o[bad]}, "
                             f"the dense model's greedy choice is {pred[bad]}")
        early = [j for j, t in enumerate(o[:-1]) if t in stops]
        assert not early, f"request {i}: went on past stop token {o[early[0]]} at output {early[0]}"
        assert len(o) == max_tokens or o[-1] in stops, (
            f"request {i}: stopped after {len(o)} of {max_tokens} tokens without a stop token")


def staggered_with_drafts(eng, prompts, params):
    """Each prompt added one step after the last (so its prefill chunks run beside the others'
    drafts), then drained. Checks that drafts were kept, the pool preempted and nothing compiled
    after warm-up; returns each request's first output and every delta the steps gave."""
    deltas = []
    for i, p in enumerate(prompts):
        eng.add_request({"prompt_token_ids": p}, params, request_id=str(i))
        deltas += eng.step()
    deltas += drain(eng)
    assert eng.stats["accepted_draft_tokens"] > 0, "no draft was ever kept: speculation did not run"
    assert eng.stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert eng.compiles_after_warmup == 0
    return [eng.pop_finished(str(i)).outputs[0] for i in range(len(prompts))], deltas


def drain(eng, max_steps=10_000):
    """Step until idle; returns every delta. Bounded so a livelock fails instead of hanging."""
    deltas = []
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return deltas
        deltas.extend(eng.step())
    raise AssertionError(f"engine not idle after {max_steps} steps")


# Heaviest files first (seconds measured on the 2-core machine). `make test` runs pytest-xdist
# with --dist loadfile, which hands whole files to whichever worker is free in collection
# order: a heavy file collected last (test_tensor_parallel.py, alphabetically near the end)
# ran alone for minutes while the other worker idled. Longest first keeps both busy.
@pytest.fixture(params=FILLS)
def mem_fill(request):
    """Each interpret-mode kernel test runs twice: uninitialised memory NaN (JAX's default,
    catches reads of unwritten memory that reach the output) and zeros (a device's stale,
    finite bits: catches code that takes non-finite for "not written"). pallas_kernels/interpret.py."""
    return request.param


_HEAVY_FIRST = ("test_tensor_parallel.py", "test_engine.py", "test_goldens.py", "test_families.py", "test_engine_pallas.py",
                "test_quantized_model.py", "test_speculative.py", "test_generate_batch.py",
                "test_pallas_attention.py", "test_server_parallel.py", "test_model_layers.py",
                "test_engine_prefix_cache.py", "test_soak.py")  # the soak: 60 s of wall time, not the tail


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
