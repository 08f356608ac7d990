"""Phi-3 tiny checkpoint.

    phi3_fused   Phi-3, 4 / 2 heads, fused qkv_proj and gate_up_proj, sliding_window 8, untied,
                 float32 on disk (rope_parameters carries partial_rotary_factor 1.0).
"""

import torch
from transformers import Phi3Config, Phi3ForCausalLM

TINY = {
    "phi3_fused": dict(
        cls=Phi3ForCausalLM, cfg_cls=Phi3Config, seed=1006, dtype=torch.float32, legacy_rope=False,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
}
