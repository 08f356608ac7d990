"""Qwen2 / Qwen2.5: the Llama table with q/k/v biases (on unless config.json says otherwise).
GGUF `qwen2` files use NeoX (rotate-half) RoPE already: no q/k un-permuting.

Sliding windows (`use_sliding_window`) apply, as in HF, only to layers i >= max_window_layers
(or as an explicit `layer_types` says); the layers below attend to everything."""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.model.families.llama import llama_like_params
from jaxserve.model.family import Family, register


def window_fields(d: dict) -> dict:
    """config.json's use_sliding_window / sliding_window / max_window_layers / layer_types ->
    (sliding_window, layer_types), read as HF's Qwen2Config / Qwen3Config do. layer_types
    stays None when every layer is alike (all windowed, or none)."""
    w = d.get("sliding_window") if d.get("use_sliding_window") else None
    if w is None:
        return {"sliding_window": None}
    n = int(d["num_hidden_layers"])
    lt = d.get("layer_types") or ["sliding_attention" if i >= int(d.get("max_window_layers", 28))
                                  else "full_attention" for i in range(n)]
    if "sliding_attention" not in lt:
        return {"sliding_window": None}
    return {"sliding_window": w, "layer_types": None if set(lt) == {"sliding_attention"} else tuple(lt)}


def window_to_hf(cfg: ModelConfig) -> dict:
    lt = cfg.layer_types
    first = cfg.num_layers if cfg.sliding_window is None else (0 if lt is None else lt.index("sliding_attention"))
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": first, "layer_types": None if lt is None else list(lt)}


def _from_hf(d: dict) -> dict:
    return {"attention_bias": bool(d.get("attention_bias", True)), **window_fields(d)}


QWEN2 = register(Family(
    name="qwen2", hf_class="Qwen2ForCausalLM", params=llama_like_params, gguf_arch="qwen2",
    from_hf=_from_hf,
    to_hf=window_to_hf))
