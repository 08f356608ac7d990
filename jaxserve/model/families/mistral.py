"""Mistral: the Llama table, with a sliding window over every layer (`sliding_window`).
Mistral GGUFs say `llama` (their tensors are Llama's, q/k permuted alike); one that carries
`llama.attention.sliding_window` loads as this family (families/llama.py's GGUF hook)."""

from __future__ import annotations

from jaxserve.model.families.llama import llama_like_params
from jaxserve.model.family import Family, register

MISTRAL = register(Family(
    name="mistral", hf_class="MistralForCausalLM", params=llama_like_params,
    from_hf=lambda d: {"sliding_window": d.get("sliding_window")},
    to_hf=lambda cfg: {"sliding_window": cfg.sliding_window}, gguf_permuted_qk=True))
