"""Qwen3 dense tiny checkpoint.

    qwen3_qknorm Qwen3, 4 / 2 heads, q/k RMSNorm (random weights like every norm), no biases,
                 tied embeddings, float32 on disk.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

TINY = {
    "qwen3_qknorm": dict(
        cls=Qwen3ForCausalLM, cfg_cls=Qwen3Config, seed=1005, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=3)),
}
