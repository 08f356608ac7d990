"""Gemma 3 and Gemma 2 tiny checkpoints.

    gemma3_local_global  Gemma 3 text, 5 layers (sliding, sliding, global, sliding, sliding:
                 the 3-layer period runs once, then 2 leftover layers), sliding_window 8,
                 query_pre_attn_scalar 24 (not head_dim 16), local RoPE base 10k, global 1M with
                 linear scaling 2, q/k norms, sandwich norms, tied. Norm weights are N(0, 0.2)
                 here: Gemma scales by (1 + w). Embeddings N(0, 0.6 / 8): Gemma multiplies them by
                 sqrt(64) = 8, and at 0.6 they drowned every layer (greedy repeated the last token).
    gemma2_softcap  Gemma 2, 4 layers alternating sliding (8) and global, attention scores
                 soft-capped at 2 and logits at 5 (low, so the caps bite), query_pre_attn_scalar 24.
"""

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from goldens.common import EMBED_STD

TINY = {
    "gemma3_local_global": dict(
        cls=Gemma3ForCausalLM, cfg_cls=Gemma3TextConfig, seed=1007, dtype=torch.float32, legacy_rope=False,
        norm_offset=True, layers=5, embed_std=EMBED_STD / 8,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=24,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention",
                              "sliding_attention", "sliding_attention"],
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                 hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "gemma2_softcap": dict(
        cls=Gemma2ForCausalLM, cfg_cls=Gemma2Config, seed=1008, dtype=torch.float32, legacy_rope=False,
        norm_offset=True, layers=4, embed_std=EMBED_STD / 8,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=24,
                 rope_theta=10000.0, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                 hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
}
