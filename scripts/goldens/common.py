"""What every tiny checkpoint's goldens share: the weight distribution, the checkpoint writer and
the HF transformers greedy / top-5 recording (scripts/make_goldens.py's docstring says what is
recorded and why).

A family module's TINY maps a checkpoint name to its spec: cls / cfg_cls (the transformers model
and config classes), seed, dtype on disk, legacy_rope (rewrite config.json in the transformers-4
spelling), cfg (the config beyond COMMON), and optionally layers, norm_offset, embed_std, shard.
"""

from __future__ import annotations

import json
import pathlib

import torch
import transformers
from transformers import AutoModelForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[2]
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
