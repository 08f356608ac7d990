"""What the TPU and GPU compile groups (tests/tpu_compile, tests/gpu_compile) share: the tiny
model (and its warm-up set's compile: `compile_tiny`), the subprocess that runs `jaxserve compile` as a
user does, and weights per chip by hand."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
GiB = 2**30

# A Llama small enough to compile fast, with the shapes the TPU kernel takes (head dim 128).
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 2,
        "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def compile_tiny(tmp_path, topology: str, tp: int, *args):
    """`jaxserve compile` of the tiny model's warm-up set (a 16-token step budget, 8 sequences,
    context 512) for `topology` at `tp`, plus `args`: (process, report)."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    return _compile(tmp_path, "--topology", topology, "--model", tmp_path / "tiny", "--tp", tp,
                    "--max-model-len", 512, "--max-num-batched-tokens", 16, "--max-num-seqs", 8, *args)


def _compile(tmp_path, *args):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "compile", *map(str, args), "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _weights_per_chip(cfg: dict, tp: int, itemsize: int = 2) -> int:
    """Bytes per chip by hand: heads, KV heads (replicated up to tp), MLP columns and the
    vocabulary split over tp; norms replicated."""
    D, F, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, N, K = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    K_chip = max(K, tp) // tp
    per_layer = D * N * H // tp + 2 * D * K_chip * H + N * H * D // tp + 3 * D * F // tp
    elems = L * per_layer + 2 * V * D // tp + (2 * L + 1) * D
    return elems * itemsize


def llama_8b_config(tmp_path, layers: int) -> tuple[dict, Path]:
    """Llama-3.1-8B's published config cut to `layers` layers, written to a folder of tmp_path."""
    cfg = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    folder = tmp_path / "l8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg, folder


def skip_group_unless(installed: bool, items, group: str, reason: str) -> None:
    """Mark every test of the compile group `group` skipped with `reason` unless its compiler is
    `installed` (a conftest's pytest_collection_modifyitems)."""
    if installed:
        return
    import pytest
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if group in str(item.path):
            item.add_marker(skip)

