"""Gemma 3 (text) and Gemma 2: one table, two registrations.

Against the Llama block: RMSNorm scales by (1 + w) (the model stores 1 + w, as llama.cpp's GGUF
does; HF files hold w: layout "norm1"), sandwich norms (post_attention_layernorm normalises the
attention output, pre/post_feedforward_layernorm wrap the MLP), GeGLU with tanh-approximated
GELU, embeddings times sqrt(hidden), scores scaled by query_pre_attn_scalar^-1/2, and layers
interleaving sliding-window and global attention (`layer_types`). Gemma 3 adds q/k RMSNorm and
a RoPE base of its own for the sliding layers (rope_local_base_freq, 10k; globals 1M, with
linear scaling on the 4B+ models); Gemma 2 adds tanh soft-capping of attention scores and of
the final logits, and alternates sliding and global layers.

GGUF files carry neither the layer pattern nor the local RoPE base nor the score scale:
llama.cpp hard-codes them (Gemma 3: every 6th layer global, local base 10000; scale
head_dim^-1/2 except the 27B's (hidden / heads)^-1/2), and so does `_from_gguf`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import ConfigError, ModelConfig, RopeScaling
from jaxserve.model.families.llama import B, P, llama_like_params
from jaxserve.model.family import Family, Param, register

_GEMMA_NAMES = {  # path -> (HF name, GGUF name) where Gemma differs from Llama
    "layers.mlp_norm": (P + "pre_feedforward_layernorm.weight", B + "ffn_norm.weight"),
}


def gemma_params(cfg: ModelConfig) -> list[Param]:
    rows = []
    for p in llama_like_params(cfg):
        if p.path in _GEMMA_NAMES:
            hf, gg = _GEMMA_NAMES[p.path]
            p = dataclasses.replace(p, hf=hf, gguf=gg)
        if p.path.endswith("norm"):
            p = dataclasses.replace(p, layout="norm1")
        rows.append(p)
        if p.path == "layers.wo":
            rows.append(Param("layers.post_attn_norm", "LD", ("layers", "embed"),
                              P + "post_attention_layernorm.weight", B + "post_attention_norm.weight",
                              "norm1", init="ones"))
        if p.path == "layers.w_down":
            rows.append(Param("layers.post_mlp_norm", "LD", ("layers", "embed"),
                              P + "post_feedforward_layernorm.weight", B + "post_ffw_norm.weight",
                              "norm1", init="ones"))
    return rows


def _pattern(n_layers: int, period: int) -> tuple[str, ...]:
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layers))


def _from_hf(d: dict, gemma3: bool) -> dict:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"hidden_activation: {act!r} is not supported for Gemma; supported: 'gelu_pytorch_tanh'")
    if d.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: true (an encoder, EmbeddingGemma) is not supported; "
                          "jaxserve runs causal decoders")
    n = d["num_hidden_layers"]
    layer_types = d.get("layer_types") or _pattern(n, d.get("sliding_window_pattern", 6 if gemma3 else 2))
    kw = dict(hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=True, qk_norm=gemma3,
              tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
              query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
              attn_logit_softcap=d.get("attn_logit_softcapping"),
              final_logit_softcap=d.get("final_logit_softcapping"),
              sliding_window=d.get("sliding_window") or 4096, layer_types=tuple(layer_types))  # HF default
    if gemma3:
        rp = d.get("rope_parameters") or {}
        local = (rp.get("sliding_attention") or {}).get("rope_theta", d.get("rope_local_base_freq", 10000.0))
        kw["rope_local_theta"] = float(local)
    return kw


def _to_hf(cfg: ModelConfig, gemma3: bool) -> dict:
    d = {"model_type": "gemma3_text" if gemma3 else "gemma2", "hidden_activation": "gelu_pytorch_tanh",
         "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
         "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types or ()),
         "attn_logit_softcapping": cfg.attn_logit_softcap, "final_logit_softcapping": cfg.final_logit_softcap,
         "attention_bias": False}
    if gemma3:
        d["rope_local_base_freq"] = cfg.rope_local_theta
    return d


def _from_gguf(meta, gemma3: bool) -> dict:
    n, heads = int(meta("block_count")), int(meta("attention.head_count"))
    hidden, head_dim = int(meta("embedding_length")), int(meta("attention.key_length"))
    big = n == (62 if gemma3 else 46)  # the 27B models, whose score scale llama.cpp special-cases
    kw = dict(hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=True, qk_norm=gemma3,
              query_pre_attn_scalar=float(hidden // heads if big else head_dim),
              sliding_window=int(meta("attention.sliding_window")),
              layer_types=_pattern(n, 6 if gemma3 else 2))
    if gemma3:
        kw["rope_local_theta"] = 10000.0
        if meta("rope.scaling.type", None) == "linear":
            kw["rope_scaling"] = RopeScaling("linear", float(meta("rope.scaling.factor")))
    else:
        kw["attn_logit_softcap"] = meta("attn_logit_softcapping", None)
        kw["final_logit_softcap"] = meta("final_logit_softcapping", None)
    return kw


GEMMA3 = register(Family(
    name="gemma3", hf_class="Gemma3ForCausalLM", params=gemma_params, gguf_arch="gemma3",
    hf_model_types=("gemma3_text",), from_hf=lambda d: _from_hf(d, True), to_hf=lambda c: _to_hf(c, True),
    from_gguf=lambda m: _from_gguf(m, True)))
GEMMA2 = register(Family(
    name="gemma2", hf_class="Gemma2ForCausalLM", params=gemma_params, gguf_arch="gemma2",
    from_hf=lambda d: _from_hf(d, False), to_hf=lambda c: _to_hf(c, False),
    from_gguf=lambda m: _from_gguf(m, False)))
