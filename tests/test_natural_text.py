"""scripts/natural_text.py's chat prompts (bench_offline's default workload) share no KV page
of their own content: the prefix cache may answer only the chat template's preamble, which
every real request to the model carries too (SmolLM2's default system prompt)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import natural_text  # noqa: E402

WORKLOAD = Path("/work/shared/workloads/offline-mixed-48.json")
PAGE = 16  # the engine's default page_size: the prefix cache matches whole pages


@pytest.fixture(scope="module")
def tok():
    import checkpoints
    from checkpoints.gguf_loader import GGUFCheckpoint
    from jaxserve.tokenizer import Tokenizer
    return Tokenizer.from_gguf_metadata(GGUFCheckpoint(checkpoints.default_model_path()).metadata)


def test_chat_prompts_share_no_page_past_the_template_preamble(tok):
    # bench_offline's lengths where the shared workload file is here, else a spread like it.
    lengths = ([r["prompt_tokens"] for r in json.loads(WORKLOAD.read_text())["requests"]] if WORKLOAD.exists()
               else [20 + 53 * i for i in range(48)])
    prompts = [tok.encode(tok.apply_chat_template(m)) for seed in (0, 1)
               for m in natural_text.chat_prompts(tok, lengths, seed)]
    # The preamble: what an empty user turn's template shares with every prompt (the system
    # prompt and the user header), found from the template alone, not from the prompts.
    empty = tok.encode(tok.apply_chat_template([{"role": "user", "content": ""}]))
    preamble = next(i for i, t in enumerate(empty) if any(len(p) <= i or p[i] != t for p in prompts))
    assert preamble >= 1
    # Every prompt's first page that holds any of its own content (the label onward) is its own.
    own_page_end = (preamble // PAGE + 1) * PAGE
    assert all(len(p) >= own_page_end for p in prompts)
    firsts = [tuple(p[:own_page_end]) for p in prompts]
    assert len(set(firsts)) == len(prompts)
    # And the lengths still come out about as asked (the label is counted in the overhead);
    # below ~100 tokens the template, label and task words alone are most of a prompt.
    for p, n in zip(prompts, lengths * 2):
        if n >= 100:
            assert abs(len(p) - n) <= max(8, n // 10), (len(p), n)


def test_both_prompt_kinds_open_with_the_one_label(tok):
    label = natural_text.prompt_label(3, 1)
    assert natural_text.chat_prompts(tok, [120, 120], 3)[1][0]["content"].startswith(label)
    assert tok.decode(natural_text.token_prompts(tok, [40, 40], 3)[1]).startswith(label)
    assert label != natural_text.prompt_label(3, 2) != natural_text.prompt_label(4, 1)
