"""Llama tiny checkpoints.

    llama3_rope  Llama, 4 heads / 2 KV heads, llama3 rope scaling (factor 8, low/high freq factors
                 1/4, original length 64), rope_theta 500000. With head_dim 16 the 8 RoPE
                 wavelengths are 6.3, 32.4, 167, ... positions, so the original length 64 puts one
                 frequency in each llama3 regime: kept (6.3 < 64/4), smoothly interpolated
                 (16 <= 32.4 <= 64; factor 0.409) and divided by 8 (the rest). Untied
                 embeddings, float32 on disk. config.json uses the transformers-4 spelling (`rope_theta` + `rope_scaling`), like real Llama 3.x repos.
    llama_mqa    Llama, 4 heads / 1 KV head (MQA), tied embeddings, float32 on disk, sharded into
                 several safetensors files with model.safetensors.index.json; transformers-5 spelling.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY = {
    "llama3_rope": dict(
        cls=LlamaForCausalLM, cfg_cls=LlamaConfig, seed=1001, dtype=torch.float32, legacy_rope=True,
        cfg=dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "llama_mqa": dict(
        cls=LlamaForCausalLM, cfg_cls=LlamaConfig, seed=1004, dtype=torch.float32, legacy_rope=False,
        shard="100KB",
        cfg=dict(num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
}
