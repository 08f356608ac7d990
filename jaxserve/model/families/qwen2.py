"""Qwen2 / Qwen2.5: the Llama table with q/k/v biases (on unless config.json says otherwise).
GGUF `qwen2` files use NeoX (rotate-half) RoPE already: no q/k un-permuting."""

from __future__ import annotations

from jaxserve.model.families.llama import llama_like_params
from jaxserve.model.family import Family, register


def _from_hf(d: dict) -> dict:
    return {"attention_bias": bool(d.get("attention_bias", True)),
            "sliding_window": d.get("sliding_window") if d.get("use_sliding_window") else None}


QWEN2 = register(Family(
    name="qwen2", hf_class="Qwen2ForCausalLM", params=llama_like_params, gguf_arch="qwen2",
    from_hf=_from_hf,
    to_hf=lambda cfg: {"use_sliding_window": cfg.sliding_window is not None,
                       "sliding_window": cfg.sliding_window}))
