"""`jaxserve compile` through the real TPU compiler: the tiny model's whole warm-up set for
v5e:2x2 at tp=4, one Llama-3.1-8B-shaped step (2 layers) for v6e, and a 70B refused on v5e."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
GiB = 2**30

# A Llama small enough to compile fast, with the shapes the TPU kernel takes (head dim 128).
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 2,
        "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


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


def test_tiny_warmup_set_v5e_tp4(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    proc, r = _compile(tmp_path, "--topology", "v5e:2x2", "--model", tmp_path / "tiny", "--tp", 4,
                       "--max-model-len", 512, "--max-num-batched-tokens", 16, "--max-num-seqs", 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (r["topology"], r["chip"], r["num_devices"], r["tp"], r["dtype"]) == ("v5e:2x2", "v5e", 4, 4, "bfloat16")
    # Exactly the runner's warm-up set: every default bucket of a 16-token step.
    assert [p["tokens"] for p in r["programs"]] == [1, 2, 4, 8, 16]
    assert r["weights_bytes_per_chip"] == _weights_per_chip(TINY, 4)
    assert r["fits"] and r["peak_bytes_per_chip"] <= 16 * GiB
    assert r["num_pages"] > 0 and r["kv_bytes_per_chip"] > 0
    L = TINY["num_hidden_layers"]
    for p in r["programs"]:
        assert p["copies"] == [], p  # no copy of the KV cache or of a weight in a step
        # The donated cache comes back in place: at least the cache is aliased, input to output.
        assert p["alias_bytes"] >= r["kv_bytes_per_chip"], p
        # tp=4 splits heads and MLP columns: at least one all-reduce after attention and one
        # after the MLP in every layer, per step.
        assert p["collectives"]["all-reduce"]["count"] >= 2 * L, p
        assert p["flops"] > 0 and p["predicted_s"] > 0
    assert "predicted" in r["predicted"]["label"]
    assert "step_T16" in proc.stdout and "fits" in proc.stdout


def test_llama_8b_shaped_two_layer_step_v6e(tmp_path):
    cfg = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "l8b").mkdir()
    (tmp_path / "l8b" / "config.json").write_text(json.dumps(cfg))
    proc, r = _compile(tmp_path, "--topology", "v6e:2x2", "--model", tmp_path / "l8b", "--max-model-len", 8192,
                       "--max-num-batched-tokens", 16, "--max-num-seqs", 16, "--token-buckets", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["chip"] == "v6e" and r["tp"] == 1 and [p["tokens"] for p in r["programs"]] == [16]
    assert r["weights_bytes_per_chip"] == _weights_per_chip(cfg, 1)
    p = r["programs"][0]
    assert p["copies"] == [] and p["collectives"] == {}  # one chip: no collectives at all
    # The weights are read once a step: the compiler's bytes are at least the weights'.
    assert p["bytes_accessed"] >= r["weights_bytes_per_chip"]
    # The pool is what the chip holds after weights and the compiled step's own temporaries.
    left = 0.9 * 32 * GiB - r["weights_bytes_per_chip"] - p["temp_bytes"] - (p["output_bytes"] - p["alias_bytes"])
    assert 0 <= left - r["kv_bytes_per_chip"] < r["kv_bytes_per_chip"] / r["num_pages"] * 2
    assert r["fits"] and r["peak_bytes_per_chip"] <= 32 * GiB


def test_70b_on_v5e_2x4_is_refused_in_one_line(tmp_path):
    proc, r = _compile(tmp_path, "--topology", "v5e:2x4", "--model", CONFIGS / "llama-3.1-70b", "--tp", 8)
    assert proc.returncode == 2 and r is None
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxserve: error: llama-3.1-70b does not fit v5e:2x4 at tp=8: ")
    assert "GiB of weights per chip" in last and " by " in last and "Traceback" not in proc.stderr


def test_unknown_topology_is_one_line(tmp_path):
    proc, _ = _compile(tmp_path, "--topology", "v5e:banana", "--model", CONFIGS / "llama-3.1-8b")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxserve: error: topology: 'v5e:banana'")
