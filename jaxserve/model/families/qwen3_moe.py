"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm, no biases) with a sparse MoE MLP in every layer:
router softmax over `num_experts`, the top `num_experts_per_tok`, renormalised only when
`norm_topk_prob`; experts of width `moe_intermediate_size` (jaxserve's intermediate_size).
HF names: mlp.gate (router), mlp.experts.{e}.gate_proj / up_proj / down_proj. Dense layers
between sparse ones (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused. GGUF `qwen3moe`
files: experts fused per layer as Mixtral's (mixtral.py), width `expert_feed_forward_length`,
NeoX RoPE (nothing un-permuted); llama.cpp renormalises the top-k weights for this
architecture, so `expert_weights_norm` is read with True as its default."""

from __future__ import annotations

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model.families.mixtral import moe_params
from jaxserve.model.families.qwen3 import QWEN3
from jaxserve.model.family import Family, register


def _params(cfg: ModelConfig):
    return moe_params(cfg, moe="mlp.", names=("gate_proj", "up_proj", "down_proj"), router="gate")


def _from_hf(d: dict) -> dict:
    if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
        raise ConfigError(f"decoder_sparse_step / mlp_only_layers: dense layers between MoE layers are not "
                          f"implemented (got {d.get('decoder_sparse_step')}, {d.get('mlp_only_layers')})")
    kw = QWEN3.from_hf(d)
    kw.update(num_experts=int(d.get("num_experts") or d.get("num_local_experts", 128)), num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
              moe_norm_topk=bool(d.get("norm_topk_prob", False)),
              intermediate_size=int(d.get("moe_intermediate_size", 768)))  # HF's defaults
    return kw


def _to_hf(cfg: ModelConfig) -> dict:
    return {**QWEN3.to_hf(cfg), "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "norm_topk_prob": cfg.moe_norm_topk, "moe_intermediate_size": cfg.intermediate_size,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _from_gguf(meta) -> dict:
    return {"qk_norm": True, "num_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "intermediate_size": int(meta("expert_feed_forward_length")),
            "moe_norm_topk": bool(meta("expert_weights_norm", True))}


QWEN3_MOE = register(Family(name="qwen3_moe", hf_class="Qwen3MoeForCausalLM", params=_params,
                            gguf_arch="qwen3moe", from_hf=_from_hf, to_hf=_to_hf, from_gguf=_from_gguf))
