"""Shared fixtures: the default model loaded once per session, a tiny random model with a byte
tokenizer (fast engine tests), and engines built on them with small bucket lists."""

import os
import tempfile
from pathlib import Path

import pytest

# Eight fake CPU devices for the tensor-parallel tests; set before anything imports jax.
# Single-device code is unaffected: it runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

ROOT = Path(__file__).resolve().parents[1]

# One persistent XLA compilation cache for the session's engines: many tests build engines on
# the same model with the same buckets, and each would otherwise compile the same step
# executables again (seconds per bucket). Fresh per session, so nothing carries between runs.
XLA_CACHE = tempfile.mkdtemp(prefix="jaxserve-test-xla-")


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


def make_engine(model, tokenizer, eos=(), mesh=None, **kw):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    base = dict(max_model_len=256, page_size=4, num_pages=96, max_num_seqs=8,
                max_num_batched_tokens=32, token_buckets=(1, 8, 32), compilation_cache_dir=XLA_CACHE)
    base.update(kw)
    eng = Engine(model, tokenizer, EngineConfig(**base), eos, mesh=mesh)
    eng.warmup(progress=False)
    eng.strict_compiles = True
    return eng


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
_HEAVY_FIRST = ("test_tensor_parallel.py", "test_engine.py", "test_goldens.py", "test_engine_pallas.py",
                "test_quantized_model.py", "test_speculative.py", "test_generate_batch.py",
                "test_pallas_attention.py", "test_server_parallel.py", "test_model_layers.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
