"""Mistral: the Llama table, with a sliding window over every layer (`sliding_window`).
Mistral GGUFs say `llama` (their tensors are Llama's), so they load as the llama family."""

from __future__ import annotations

from jaxserve.model.families.llama import llama_like_params
from jaxserve.model.family import Family, register

MISTRAL = register(Family(
    name="mistral", hf_class="MistralForCausalLM", params=llama_like_params,
    from_hf=lambda d: {"sliding_window": d.get("sliding_window")},
    to_hf=lambda cfg: {"sliding_window": cfg.sliding_window}))
