"""Phi-3 (mini / medium, 4k context): the Llama block, with q/k/v fused into one `qkv_proj`
and gate/up into one `gate_up_proj` (gate first) in both HF and GGUF files; the table reads
each projection as a row range of the fused tensor, so the model and the quantized path see
the usual separate weights (a fused as-shipped GGUF tensor is cut by whole rows, exactly).
The long-context variants' `longrope` / `su` RoPE scaling is refused, as is partial rotary
(Phi-3.5 / Phi-4-mini)."""

from __future__ import annotations

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model.families.llama import llama_like_params
from jaxserve.model.family import Family, register


def _from_hf(d: dict) -> dict:
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype not in (None, "default"):
        raise ConfigError(f"rope_scaling.type: Phi-3's {rtype!r} RoPE scaling (the 128k-context models) is "
                          f"not implemented; the 4k-context Phi-3 models (rope_scaling null) are supported")
    prf = d.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise ConfigError(f"partial_rotary_factor: {prf} (RoPE on part of each head) is not implemented; "
                          f"only 1.0 is supported")
    return {"sliding_window": d.get("sliding_window")}


def _from_gguf(meta) -> dict:
    if meta("rope.scaling.original_context_length", None) is not None:
        raise ConfigError("rope.scaling: Phi-3's longrope scaling (the 128k-context models) is not "
                          "implemented; the 4k-context Phi-3 models are supported")
    return {"sliding_window": meta("attention.sliding_window", None)}


def _to_hf(cfg: ModelConfig) -> dict:
    return {"sliding_window": cfg.sliding_window, "rope_scaling": None}


PHI3 = register(Family(
    name="phi3", hf_class="Phi3ForCausalLM", params=lambda cfg: llama_like_params(cfg, fused=True),
    gguf_arch="phi3", from_hf=_from_hf, to_hf=_to_hf, from_gguf=_from_gguf))
