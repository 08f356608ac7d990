"""Write an HF checkpoint folder (config.json + model.safetensors) from a GGUF file.

The weights are written in fp32 under HF names with q/k un-permuted, so HF transformers loads the
folder as it would a checkpoint from the hub. The tokenizer files are written by the caller
(jaxserve.tokenizer), which owns tokenizer logic; see `jaxserve convert`.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.numpy import save_file

from checkpoints.gguf_loader import GGUFCheckpoint


def write_hf_weights(ckpt: GGUFCheckpoint, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = ckpt.config.to_hf_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = ckpt.hf_tensors()
    if ckpt.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    gen = {"do_sample": False}
    if ckpt.config.bos_token_id is not None:
        gen["bos_token_id"] = ckpt.config.bos_token_id
    if ckpt.config.eos_token_ids:
        gen["eos_token_id"] = list(ckpt.config.eos_token_ids)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
