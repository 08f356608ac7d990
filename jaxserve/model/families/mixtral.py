"""Mixtral (sparse Mixture of Experts): Llama attention, and per layer a router over
`num_local_experts` SwiGLU experts of which each token runs the top `num_experts_per_tok`,
weighted by the router softmax renormalised over those k (= a softmax over the top-k logits).
HF checkpoints hold one tensor per expert (w1 gate, w3 up, w2 down); the table stacks them
[L, E, ...]. Expert FFN columns split over tp like a dense MLP's ("mlp" axis). --quantize
int8 / int4 quantizes the experts (not the router); layers.moe_mlp runs them through the
grouped matmul's quantized path, reading the int8 / int4 bytes as stored.
llama.cpp writes Mixtral as `llama` with `llama.expert_count`; such a file loads as this family
(families/llama.py's GGUF hook), q/k rows un-permuted as Llama's. Older GGUFs with one tensor per
expert (blk.N.ffn_gate.E.weight) are not read (unknown tensor names, refused)."""

from __future__ import annotations

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model.families.llama import B, P, llama_like_params
from jaxserve.model.family import Family, Param, register

_DENSE_MLP = ("layers.w_gate", "layers.w_up", "layers.w_down")


def moe_params(cfg: ModelConfig, moe: str = "block_sparse_moe.", names=("w1", "w3", "w2"),
               router: str = "gate") -> list[Param]:
    rows = [p for p in llama_like_params(cfg) if p.path not in _DENSE_MLP]
    x = P + moe + "experts.{e}."
    gate, up, down = names
    moe_rows = [
        # The router stays float under --quantize: it is tiny (D x E), and rounding its logits
        # could change which experts a token picks, a discrete change no tolerance covers.
        Param("layers.w_router", "LDE", ("layers", "embed", None), P + moe + router + ".weight",
              B + "ffn_gate_inp.weight", "linear", quantize=False),
        # GGUF: each layer's experts fused into one 3-D tensor [E, F, D] / [E, D, F]
        Param("layers.we_gate", "LEDF", ("layers", None, "embed", "mlp"), x + gate + ".weight",
              B + "ffn_gate_exps.weight", "linear", expert=True),
        Param("layers.we_up", "LEDF", ("layers", None, "embed", "mlp"), x + up + ".weight",
              B + "ffn_up_exps.weight", "linear", expert=True),
        Param("layers.we_down", "LEFD", ("layers", None, "mlp", "embed"), x + down + ".weight",
              B + "ffn_down_exps.weight", "linear", expert=True),
    ]
    return rows + moe_rows


def _from_hf(d: dict) -> dict:
    if d.get("router_jitter_noise"):
        raise ConfigError("router_jitter_noise: only used in training; must be 0 for inference")
    return {"num_experts": int(d.get("num_local_experts", 8)), "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
            "moe_norm_topk": True, "sliding_window": d.get("sliding_window")}


def _to_hf(cfg: ModelConfig) -> dict:
    return {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "sliding_window": cfg.sliding_window, "router_jitter_noise": 0.0}


MIXTRAL = register(Family(name="mixtral", hf_class="MixtralForCausalLM", params=moe_params,
                          from_hf=_from_hf, to_hf=_to_hf, gguf_permuted_qk=True))
