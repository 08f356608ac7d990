"""Qwen3 (dense): the Llama table without q/k/v biases, plus an RMSNorm over head_dim on q and
k before RoPE (`q_norm`, `k_norm`); tied or untied embeddings. GGUF `qwen3` files use NeoX
(rotate-half) RoPE, so nothing is un-permuted. Qwen3-MoE is another family (not here)."""

from __future__ import annotations

from jaxserve.model.families.llama import llama_like_params
from jaxserve.model.families.qwen2 import QWEN2, window_fields
from jaxserve.model.family import Family, register


def _from_hf(d: dict) -> dict:
    return {"qk_norm": True, "attention_bias": bool(d.get("attention_bias", False)), **window_fields(d)}


QWEN3 = register(Family(
    name="qwen3", hf_class="Qwen3ForCausalLM", params=llama_like_params, gguf_arch="qwen3",
    from_hf=_from_hf, to_hf=lambda cfg: {**QWEN2.to_hf(cfg), "attention_bias": cfg.attention_bias},
    from_gguf=lambda meta: {"qk_norm": True}))
