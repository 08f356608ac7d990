"""The dense model against goldens from HF transformers (scripts/make_goldens.py wrote them; no
torch is needed here). fp32 greedy tokens must match exactly; logits within an fp32 tolerance.

SmolLM2 goes through `jaxserve convert` (GGUF -> HF folder), the same folder HF loaded to make
its goldens, so the converter, the HF loader and the tokenizer are all checked at once.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import dense_forward
from tolerances import fp32_logits_atol

import checkpoints
from jaxserve import loading
from jaxserve.cli import main as cli_main
from jaxserve.engine.dense_generator import DenseGenerator
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "goldens"
TINY = ["llama3_rope", "qwen2_bias", "mistral_swa", "llama_mqa"]



def check_case(logits_of, case, cfg) -> list[int]:
    """`logits_of`: conftest.dense_forward of the model, `cfg` its ModelConfig. Checks HF's
    top-5 logits at the prompt positions it recorded (within tolerances.fp32_logits_atol: same
    weights and fp32 math, summed in another order by torch on the machine that made the
    goldens), and its greedy continuation: one forward over prompt + HF's greedy
    tokens, whose argmax at each position must be the next of them. Causal attention: position
    i's logits see tokens <= i only, so the prompt's logits are the prompt's alone, and greedy
    decoding one token at a time picks exactly the tokens whose prefixes' argmax they are (the
    dense generator's incremental decode equals the full forward: test_model_layers). Returns
    the greedy ids found."""
    p, g = case["prompt_ids"], case["greedy_ids"]
    logits = logits_of([p + g])[0]
    # The bound covers the whole forward pass's reduction chain (len(p + g) tokens attended).
    check_top5(logits, case["top5"], fp32_logits_atol(cfg, len(p) + len(g), logits[:len(p) + len(g)]))
    return logits[len(p) - 1:len(p) - 1 + len(g)].argmax(-1).tolist()


def check_top5(logits: np.ndarray, top5: list[dict], atol: float) -> None:
    for entry in top5:
        row = logits[entry["position"]]
        np.testing.assert_allclose(row[entry["ids"]], entry["logits"], atol=atol,
                                   err_msg=f"position {entry['position']}")
        # Our own top-5 must be at least as high as HF's 5th (no token missing from our top).
        assert np.sort(row)[-5] >= entry["logits"][-1] - atol


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_matches_hf(name):
    golden = json.loads((GOLDENS / f"{name}.json").read_text())
    model, loaded = checkpoints.load_model(ROOT / golden["checkpoint"], "float32")
    logits_of = dense_forward(model)
    for case in golden["cases"]:
        assert check_case(logits_of, case, model.cfg) == case["greedy_ids"], f"{name} prompt {case['prompt_ids']}"


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
    logits_of = dense_forward(lm.model)
    for case in smollm2_golden["cases"]:
        assert lm.tokenizer.encode(case["rendered"]) == case["prompt_ids"]
        out = check_case(logits_of, case, lm.model.cfg)
        assert out == case["greedy_ids"], case["prompt"]
        # HF stopped at EOS or at its max_new_tokens; an EOS may only come last.
        assert not set(out[:-1]) & set(lm.eos_token_ids), case["prompt"]
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
    from jaxserve.model.llama import flat_params
    a, b = flat_params(smollm2_converted.model), flat_params(smollm2.model)  # unpacked if packed at load
    for name in ("layers.wq", "layers.wk", "layers.w_down", "embed"):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


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
        out = list(gen.generate(ids, SamplingParams(temperature=0.0, max_tokens=n)))
        assert lm.tokenizer.decode(out).startswith(want), prompt


@pytest.mark.parametrize("drafts", [dict(num_speculative_tokens=3), dict(num_speculative_tokens=2, speculative_layers=20)],
                         ids=["ngram", "self-draft"])
def test_the_goldens_with_speculative_decoding(smollm2, drafts):
    """The same held-out continuations through the paged engine with drafts: greedy speculation
    must not change a token."""
    from conftest import drain, make_engine
    lm = smollm2
    eng = make_engine(lm.model, lm.tokenizer, lm.eos_token_ids, max_model_len=128, page_size=16, num_pages=32,
                      max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), **drafts)
    wants = []
    for i, (kind, prompt, want) in enumerate(MODELS_MD):
        text = (lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                if kind == "chat" else prompt)
        eng.add_request({"prompt_token_ids": lm.tokenizer.encode(text)},
                        SamplingParams(temperature=0.0, max_tokens=len(lm.tokenizer.encode(want)) + 1),
                        request_id=str(i))
        wants.append(want)
    drain(eng)
    assert eng.stats["draft_tokens"] > 0
    for i, want in enumerate(wants):
        assert eng.pop_finished(str(i)).outputs[0].text.startswith(want), MODELS_MD[i][1]
