"""Qwen3-MoE tiny checkpoint.

    qwen3_moe    Qwen3-MoE, 8 experts of width 32, top 3 per token, softmax over all 8 and not
                 renormalised (norm_topk_prob false), q/k norms, tied.
"""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TINY = {
    "qwen3_moe": dict(
        cls=Qwen3MoeForCausalLM, cfg_cls=Qwen3MoeConfig, seed=1010, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=8,
                 num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)),
}
