"""`jaxserve compile` through the real TPU compiler: the tiny model's whole warm-up set for
v5e:2x2 at tp=4 (with and without speculative decoding's draft slots), one Llama-3.1-8B-shaped
step (4 layers) for v6e, a Qwen3-30B-A3B-shaped step (2 layers) with int8 experts and int8 KV
for v6e at tp=4, and a 70B refused on v5e."""

import json

from aot_cases import CONFIGS, GiB, TINY, _compile, _weights_per_chip, compile_tiny, llama_8b_config


def test_tiny_warmup_set_v5e_tp4(tmp_path):
    proc, r = compile_tiny(tmp_path, "v5e:2x2", 4, "--aot-dir", tmp_path / "aot")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every step serialized for `serve --aot-dir` (executable_store.py), keyed by its program
    # and these chips; loading them needs the TPUs themselves, which this test does not have.
    manifest = json.loads((tmp_path / "aot" / "manifest.json").read_text())
    assert sorted(e["tokens"] for e in manifest.values()) == [1, 2, 4, 8, 16]
    for key, e in manifest.items():
        assert (e["platform"], e["num_devices"], e["mesh"]) == ("tpu", 4, {"dp": 1, "tp": 4}), e
        assert (tmp_path / "aot" / f"{key}.bin").stat().st_size == e["serialized_bytes"] > 0
        assert (tmp_path / "aot" / f"{key}.trees").exists()
    assert [p["serialized_bytes"] for p in r["programs"]] == [
        e["serialized_bytes"] for e in sorted(manifest.values(), key=lambda e: e["tokens"])]
    assert (r["topology"], r["chip"], r["num_devices"], r["tp"], r["dtype"]) == ("v5e:2x2", "v5e", 4, 4, "bfloat16")
    # Exactly the runner's warm-up set: every default bucket of a 16-token step.
    assert [p["tokens"] for p in r["programs"]] == [1, 2, 4, 8, 16]
    assert r["weights_bytes_per_chip"] == _weights_per_chip(TINY, 4)
    assert r["fits"] and r["peak_bytes_per_chip"] <= 16 * GiB
    assert r["num_pages"] > 0 and r["kv_bytes_per_chip"] > 0
    L = TINY["num_hidden_layers"]
    for p in r["programs"]:
        # No copy of the KV cache or of a weight in a step (a cond branch's, e.g. prompt_logprobs',
        # runs only in steps that take it, and is reported apart).
        assert [c for c in p["copies"] if not c["conditional"]] == [], p
        # The donated cache comes back in place: at least the cache is aliased, input to output.
        assert p["alias_bytes"] >= r["kv_bytes_per_chip"], p
        # tp=4 splits heads and MLP columns: at least one all-reduce after attention and one
        # after the MLP in every layer, per step.
        assert p["collectives"]["all-reduce"]["count"] >= 2 * L, p
        assert p["flops"] > 0 and p["predicted_s"] > 0
    assert "predicted" in r["predicted"]["label"]
    assert "step_T16" in proc.stdout and "fits" in proc.stdout


def test_speculative_steps_compile_for_v5e(tmp_path):
    """With drafts every step program carries the draft slots and the on-device verify
    (rejection_sampler.verify_slots: sampling_probs, scatter-min/max segments, threefry draws)
    behind a cond: the TPU compiler takes them, and nothing outside a cond is copied."""
    proc, r = compile_tiny(tmp_path, "v5e:2x2", 4, "--num-speculative-tokens", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p["tokens"] for p in r["programs"]] == [1, 2, 4, 8, 16] and r["fits"]
    for p in r["programs"]:
        assert [c for c in p["copies"] if not c["conditional"]] == [], p
        assert p["alias_bytes"] >= r["kv_bytes_per_chip"], p


def test_llama_8b_shaped_four_layer_step_v6e(tmp_path):
    cfg, folder = llama_8b_config(tmp_path, 4)
    proc, r = _compile(tmp_path, "--topology", "v6e:2x2", "--model", folder, "--max-model-len", 8192,
                       "--max-num-batched-tokens", 16, "--max-num-seqs", 16, "--token-buckets", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["chip"] == "v6e" and r["tp"] == 1 and [p["tokens"] for p in r["programs"]] == [16]
    assert r["weights_bytes_per_chip"] == _weights_per_chip(cfg, 1)
    p = r["programs"][0]
    assert [c for c in p["copies"] if not c["conditional"]] == [] and p["collectives"] == {}  # one chip
    # Every weight is read once a step and each does 2 FLOPs per token: the counts are at least
    # that. cost_analysis() alone counts the layer scan's body once (one layer of four), which
    # fails both bounds: the report adds the other iterations.
    assert p["layer_scan_trips"] == 4 and p["compiler_flops"] < p["flops"]
    assert p["bytes_accessed"] >= r["weights_bytes_per_chip"] - 2 * 128256 * 4096  # all but the unread embedding
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layer_params = D * 4096 * 2 + 2 * D * 1024 + 3 * D * F
    assert p["flops"] >= 2 * 16 * (4 * layer_params + D * V)
    # The pool is what the chip holds after the weights and the largest step's temporaries and
    # outputs, as the sizing compile (at a small pool) measured them: within a page of it.
    page = r["kv_bytes_per_chip"] / (r["num_pages"] + 1)  # + the null page
    left = 0.9 * 32 * GiB - r["weights_bytes_per_chip"] - r["sizing_temp_bytes"] - r["sizing_output_bytes"]
    assert 0 <= left - r["kv_bytes_per_chip"] < page
    # ... and the step compiled at the full pool needs no more temporaries than that one did
    # (the cache is donated and written in place: temporaries do not grow with the pool).
    assert p["temp_bytes"] <= r["sizing_temp_bytes"] + 2**20
    assert r["fits"] and r["peak_bytes_per_chip"] <= 32 * GiB


def test_qwen3_moe_int8_experts_and_int8_kv_compile_without_copies_v6e(tmp_path):
    """Int8 KV on TPU stores its scales lane-dense (pallas_kernels/kv_cache.py): with the
    paged [L, P, K, page] scales XLA:TPU copied the whole scale array of every layer twice per
    layer and step, and this model's full pool needed 32 GiB of temporaries on a 32 GiB chip.
    Now no cache or weight array is copied in a step (int8 experts included: XLA's per-layer
    retile of a stack inside a fusion moves only the layer it slices), and the pool fills the
    chip with the step's temporaries under 1% of it."""
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "q3").mkdir()
    (tmp_path / "q3" / "config.json").write_text(json.dumps(cfg))
    proc, r = _compile(tmp_path, "--topology", "v6e:2x2", "--model", tmp_path / "q3", "--tp", 4,
                       "--quantize", "int8", "--quantize-group-size", 64, "--kv-cache-dtype", "int8",
                       "--max-model-len", 4096, "--max-num-batched-tokens", 16, "--max-num-seqs", 16,
                       "--token-buckets", "1,16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (r["quantize"], r["kv_cache_dtype"], r["tp"]) == ("int8", "int8", 4)
    assert [p["tokens"] for p in r["programs"]] == [1, 16] and r["fits"]
    assert r["kv_bytes_per_chip"] > 0.5 * 32 * GiB  # two layers: the pool is most of the chip
    for p in r["programs"]:
        assert [c for c in p["copies"] if not c["conditional"]] == [], p
        assert p["temp_bytes"] < 0.01 * 32 * GiB, p
        assert p["alias_bytes"] >= r["kv_bytes_per_chip"], p


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
