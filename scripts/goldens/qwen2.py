"""Qwen2 tiny checkpoint.

    qwen2_bias   Qwen2, 4 / 2 heads, q/k/v biases, tied embeddings, float16 on disk,
                 transformers-5 spelling (`rope_parameters`).
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TINY = {
    "qwen2_bias": dict(
        cls=Qwen2ForCausalLM, cfg_cls=Qwen2Config, seed=1002, dtype=torch.float16, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)),
}
