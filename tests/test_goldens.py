"""The dense model against goldens from HF transformers (scripts/make_goldens.py wrote them; no
torch is needed here). fp32 greedy tokens must match exactly; logits within an fp32 tolerance.

SmolLM2 goes through `jaxserve convert` (GGUF -> HF folder), the same folder HF loaded to make
its goldens, so the converter, the HF loader and the tokenizer are all checked at once.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import checkpoints
from jaxserve import loading
from jaxserve.cli import main as cli_main
from jaxserve.engine.dense_generator import DenseGenerator
from jaxserve.model.dense_attention import init_dense_cache, make_dense_attend
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "goldens"
TINY = ["llama3_rope", "qwen2_bias", "mistral_swa", "llama_mqa"]

# Same weights, same fp32 arithmetic, different summation orders (XLA vs torch/oneDNN): each
# matmul differs by ~1e-6 relative; over a few layers logits of magnitude ~10 move by ~1e-4.
# 1e-3 absolute leaves 10x headroom and is still far below the smallest greedy margin (0.003).
LOGIT_ATOL = 1e-3


def full_logits(model, ids: list[int]) -> np.ndarray:
    graphdef, state = nnx.split(model)
    cfg = model.cfg
    attend = make_dense_attend(cfg)

    @jax.jit
    def fwd(state, tokens, pos):
        m = nnx.merge(graphdef, state)
        logits, _ = m(tokens, pos, init_dense_cache(cfg, 1, tokens.shape[1], m.dtype), attend, pos)
        return logits[0]

    tokens = jnp.asarray([ids], jnp.int32)
    return np.asarray(fwd(state, tokens, jnp.arange(len(ids), dtype=jnp.int32)[None]))


def check_top5(logits: np.ndarray, top5: list[dict]) -> None:
    for entry in top5:
        row = logits[entry["position"]]
        np.testing.assert_allclose(row[entry["ids"]], entry["logits"], atol=LOGIT_ATOL,
                                   err_msg=f"position {entry['position']}")
        # Our own top-5 must be at least as high as HF's 5th (no token missing from our top).
        assert np.sort(row)[-5] >= entry["logits"][-1] - LOGIT_ATOL


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_matches_hf(name):
    golden = json.loads((GOLDENS / f"{name}.json").read_text())
    model, loaded = checkpoints.load_model(ROOT / golden["checkpoint"], "float32")
    gen = DenseGenerator(model)
    for case in golden["cases"]:
        check_top5(full_logits(model, case["prompt_ids"]), case["top5"])
        out = list(gen.generate(case["prompt_ids"], SamplingParams(max_tokens=len(case["greedy_ids"]),
                                                                   ignore_eos=True)))
        assert out == case["greedy_ids"], f"{name} prompt {case['prompt_ids']}"
    # All prompts share two executables (prefill bucket 16/32 and decode) per cache bucket.
    assert gen.num_compilations <= 3


@pytest.fixture(scope="module")
def smollm2_converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    assert cli_main(["convert", str(checkpoints.default_model_path()), str(out)]) == 0
    return loading.load(out, "float32")


@pytest.fixture(scope="module")
def smollm2_golden():
    return json.loads((GOLDENS / "smollm2.json").read_text())


def test_smollm2_converted_matches_hf(smollm2_converted, smollm2_golden):
    lm = smollm2_converted
    assert lm.format == "hf"
    gen = DenseGenerator(lm.model, lm.eos_token_ids)
    for case in smollm2_golden["cases"]:
        assert lm.tokenizer.encode(case["rendered"]) == case["prompt_ids"]
        check_top5(full_logits(lm.model, case["prompt_ids"]), case["top5"])
        out = list(gen.generate(case["prompt_ids"], SamplingParams(max_tokens=len(case["greedy_ids"]))))
        assert out == case["greedy_ids"], case["prompt"]
        assert lm.tokenizer.decode(out, skip_special_tokens=False) == case["greedy_text"]


def test_smollm2_tokenizer_and_template_match_hf(smollm2_converted, smollm2_golden):
    tok = smollm2_converted.tokenizer
    for case in smollm2_golden["tokenizer_cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
    for case in smollm2_golden["chat_template_cases"]:
        got = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert got == case["rendered"], case["name"]


def test_gguf_and_converted_folder_hold_the_same_weights(smollm2_converted, smollm2):
    for name in ("wq", "wk", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(smollm2_converted.model.layers, name)[...]),
                                      np.asarray(getattr(smollm2.model.layers, name)[...]), err_msg=name)
    np.testing.assert_array_equal(np.asarray(smollm2_converted.model.embed[...]),
                                  np.asarray(smollm2.model.embed[...]))


MODELS_MD = [  # greedy fp32 continuations listed in ../shared/models.md
    ("raw", "The capital of France is", " Paris.\n\nThe answer is: 2018-01-22 12:12:53."),
    ("chat", "What is the capital of France?", "The capital of France is Paris."),
    ("raw", "Once upon a time, there was a little",
     " girl named Emma who loved to play in the sun. She would often go to the beach and play "
     "with her friends. One day, she decided to"),
]


def test_default_model_greedy_continuations_from_models_md(smollm2):
    lm = smollm2  # straight from the GGUF, as `jaxserve generate` does
    gen = DenseGenerator(lm.model, lm.eos_token_ids)
    for kind, prompt, want in MODELS_MD:
        text = (lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                if kind == "chat" else prompt)
        ids = lm.tokenizer.encode(text)
        n = len(lm.tokenizer.encode(want)) + 1
        out = list(gen.generate(ids, SamplingParams(max_tokens=n)))
        assert lm.tokenizer.decode(out).startswith(want), prompt
