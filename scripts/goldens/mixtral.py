"""Mixtral tiny checkpoint.

    mixtral_moe  Mixtral, 4 experts of width 128, top 2 per token (softmax over the top-2 logits),
                 one HF tensor per expert on disk (transformers writes the hub layout), untied.
"""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

TINY = {
    "mixtral_moe": dict(
        cls=MixtralForCausalLM, cfg_cls=MixtralConfig, seed=1009, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1000000.0, num_local_experts=4,
                 num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}
