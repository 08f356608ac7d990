"""Mistral tiny checkpoint.

    mistral_swa  Mistral, 4 / 2 heads, sliding_window 8, bfloat16 on disk, transformers-4 spelling.
                 HF's window: query i sees keys j with i - 8 < j <= i (8 keys including itself).
"""

import torch
from transformers import MistralConfig, MistralForCausalLM

TINY = {
    "mistral_swa": dict(
        cls=MistralForCausalLM, cfg_cls=MistralConfig, seed=1003, dtype=torch.bfloat16, legacy_rope=True,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}
