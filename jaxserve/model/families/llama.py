"""Llama 2/3/3.x (and SmolLM, TinyLlama): the parameter table the Llama-like families share.

Pre-norm decoder: RMSNorm -> attention (GQA, RoPE) -> residual, RMSNorm -> SwiGLU -> residual.
Optional rows: q/k/v biases (cfg.attention_bias: Qwen2), q/k norms over head_dim (cfg.qk_norm:
Qwen3), the untied LM head. `fused=True` reads q/k/v and gate/up as row ranges of Phi-3's
fused qkv_proj / gate_up_proj tensors (and GGUF's attn_qkv / ffn_up).
"""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.model.family import Family, Param, register

P, B = "model.layers.{i}.", "blk.{i}."


def llama_like_params(cfg: ModelConfig, fused: bool = False) -> list[Param]:
    N, K, H, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if fused:
        qkv, gate_up = P + "self_attn.qkv_proj.weight", P + "mlp.gate_up_proj.weight"
        q = dict(hf=qkv, gguf=B + "attn_qkv.weight", rows=(0, N * H))
        k = dict(hf=qkv, gguf=B + "attn_qkv.weight", rows=(N * H, K * H))
        v = dict(hf=qkv, gguf=B + "attn_qkv.weight", rows=(N * H + K * H, K * H))
        gate = dict(hf=gate_up, gguf=B + "ffn_up.weight", rows=(0, F))
        up = dict(hf=gate_up, gguf=B + "ffn_up.weight", rows=(F, F))
    else:
        q = dict(hf=P + "self_attn.q_proj.weight", gguf=B + "attn_q.weight")
        k = dict(hf=P + "self_attn.k_proj.weight", gguf=B + "attn_k.weight")
        v = dict(hf=P + "self_attn.v_proj.weight", gguf=B + "attn_v.weight")
        gate = dict(hf=P + "mlp.gate_proj.weight", gguf=B + "ffn_gate.weight")
        up = dict(hf=P + "mlp.up_proj.weight", gguf=B + "ffn_up.weight")
    rows = [
        Param("embed", "VD", ("vocab", "embed"), "model.embed_tokens.weight", "token_embd.weight"),
        Param("layers.attn_norm", "LD", ("layers", "embed"), P + "input_layernorm.weight",
              B + "attn_norm.weight", init="ones"),
        Param("layers.wq", "LDNH", ("layers", "embed", "heads", "head_dim"), layout="linear", **q),
        Param("layers.wk", "LDKH", ("layers", "embed", "kv_heads", "head_dim"), layout="linear", **k),
        Param("layers.wv", "LDKH", ("layers", "embed", "kv_heads", "head_dim"), layout="linear", **v),
        Param("layers.wo", "LNHD", ("layers", "heads", "head_dim", "embed"), P + "self_attn.o_proj.weight",
              B + "attn_output.weight", "linear", in_dims=2),
        Param("layers.mlp_norm", "LD", ("layers", "embed"), P + "post_attention_layernorm.weight",
              B + "ffn_norm.weight", init="ones"),
        Param("layers.w_gate", "LDF", ("layers", "embed", "mlp"), layout="linear", **gate),
        Param("layers.w_up", "LDF", ("layers", "embed", "mlp"), layout="linear", **up),
        Param("layers.w_down", "LFD", ("layers", "mlp", "embed"), P + "mlp.down_proj.weight",
              B + "ffn_down.weight", "linear"),
        Param("final_norm", "D", ("embed",), "model.norm.weight", "output_norm.weight", init="ones"),
    ]
    if cfg.attention_bias:
        rows += [Param("layers.bq", "LNH", ("layers", "heads", "head_dim"), P + "self_attn.q_proj.bias",
                       B + "attn_q.bias", "bias", init="zeros"),
                 Param("layers.bk", "LKH", ("layers", "kv_heads", "head_dim"), P + "self_attn.k_proj.bias",
                       B + "attn_k.bias", "bias", init="zeros"),
                 Param("layers.bv", "LKH", ("layers", "kv_heads", "head_dim"), P + "self_attn.v_proj.bias",
                       B + "attn_v.bias", "bias", init="zeros")]
    if cfg.qk_norm:
        rows += [Param("layers.q_norm", "LH", ("layers", "head_dim"), P + "self_attn.q_norm.weight",
                       B + "attn_q_norm.weight", init="ones"),
                 Param("layers.k_norm", "LH", ("layers", "head_dim"), P + "self_attn.k_norm.weight",
                       B + "attn_k_norm.weight", init="ones")]
    if not cfg.tie_word_embeddings:
        rows.append(Param("lm_head", "DV", ("embed", "vocab"), "lm_head.weight", "output.weight", "linear"))
    return rows


def _from_hf(d: dict) -> dict:
    return {}


def _to_hf(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias, "mlp_bias": False}


def _from_gguf(meta) -> dict:
    """llama.cpp writes Mistral and Mixtral as `llama`. A file with `llama.expert_count` is
    Mixtral (the mixtral family); else one with `llama.attention.sliding_window` is a windowed
    (Mistral) model and loads as the mistral family, so the window is kept (and `jaxserve
    convert` writes a MistralForCausalLM config that says so)."""
    w = meta("attention.sliding_window", None)
    experts = int(meta("expert_count", 0) or 0)
    if experts:  # Mixtral: llama attention, top-k of `expert_count` experts (softmax over top-k)
        return {"architecture": "mixtral", "num_experts": experts, "moe_norm_topk": True,
                "num_experts_per_tok": int(meta("expert_used_count")), "sliding_window": int(w) if w else None}
    return {} if not w else {"architecture": "mistral", "sliding_window": int(w)}


LLAMA = register(Family(name="llama", hf_class="LlamaForCausalLM", params=llama_like_params,
                        gguf_arch="llama", from_hf=_from_hf, to_hf=_to_hf, from_gguf=_from_gguf,
                        gguf_permuted_qk=True))
