"""`jaxserve compile` through XLA:GPU and ptxas for Hopper: the tiny model's whole warm-up set
and one Llama-3.1-8B-shaped step (2 layers) on cuda:h100x8 at tp=8, with the Mosaic GPU paged
attention; the kernel cases a lent H200 would time (scripts/accelerator_check.py
--compile-for); and the one-line refusals."""

import json
import subprocess
import sys

from aot_cases import CONFIGS, ROOT, GiB, TINY, _compile, _weights_per_chip, compile_tiny, llama_8b_config


def test_tiny_warmup_set_h100_tp8(tmp_path):
    proc, r = compile_tiny(tmp_path, "cuda:h100x8", 8, "--log-level", "debug")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (r["platform"], r["chip"], r["num_devices"], r["tp"], r["dtype"]) == ("gpu", "h100", 8, 8, "bfloat16")
    assert "'pallas_gpu'" in proc.stderr  # the Mosaic GPU kernel, not a fallback
    assert [p["tokens"] for p in r["programs"]] == [1, 2, 4, 8, 16]
    assert r["weights_bytes_per_chip"] == _weights_per_chip(TINY, 8)
    # jax preallocates 0.75 of a GPU's memory: that is what serve sizes its pool from.
    assert r["allocator_bytes_per_chip"] == int(0.75 * r["hbm_bytes_per_chip"])
    assert r["fits"] and r["peak_bytes_per_chip"] <= r["allocator_bytes_per_chip"]
    for p in r["programs"]:
        assert [c for c in p["copies"] if not c["conditional"]] == [], p
        assert p["alias_bytes"] >= r["kv_bytes_per_chip"], p
        assert p["collectives"]["all-reduce"]["count"] >= 2 * TINY["num_hidden_layers"], p
        assert p["cost_source"].startswith("analytic")  # XLA:GPU gives no cost analysis without a device
        assert p["flops"] > 0 and p["predicted_s"] > 0
        # ptxas's verdict on the Mosaic GPU paged attention (its own -v report), every program:
        # one warpgroup a block, registers within the 255 a thread may have, no spills, and the
        # launch's shared memory leaving at least one block resident on an SM.
        (k,) = [k for k in p["ptxas"]["kernels"] if k["source"] == "mosaic_gpu"]
        assert k["threads"] == 128 and 0 < k["registers"] <= 255, k
        assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0, k
        assert k["dynamic_smem_bytes"] > 0 and k["blocks_per_sm"] >= 1 and k["occupancy"] > 0, k
        assert p["ptxas"]["xla_kernels"]["count"] > 0
    assert "anonymous_mosaic_gpu_kernel" in proc.stdout and "occupancy" in proc.stdout


def test_speculative_steps_compile_for_h100(tmp_path):
    """The step programs with draft slots and the on-device verify, through XLA:GPU (and the
    Mosaic GPU attention kernel's runs of 1 + k tokens)."""
    proc, r = compile_tiny(tmp_path, "cuda:h100x8", 8, "--num-speculative-tokens", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p["tokens"] for p in r["programs"]] == [1, 2, 4, 8, 16] and r["fits"]
    for p in r["programs"]:
        assert [c for c in p["copies"] if not c["conditional"]] == [], p


def test_llama_8b_shaped_two_layer_step_h100_tp8(tmp_path):
    cfg, folder = llama_8b_config(tmp_path, 2)
    proc, r = _compile(tmp_path, "--topology", "cuda:h100x8", "--model", folder, "--tp", 8,
                       "--max-model-len", 8192, "--max-num-batched-tokens", 16, "--max-num-seqs", 16,
                       "--token-buckets", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["tp"] == 8 and [p["tokens"] for p in r["programs"]] == [16]
    assert r["weights_bytes_per_chip"] == _weights_per_chip(cfg, 8)
    p = r["programs"][0]
    assert [c for c in p["copies"] if not c["conditional"]] == []
    assert p["collectives"]["all-reduce"]["count"] >= 2 * cfg["num_hidden_layers"]
    assert r["fits"] and r["kv_bytes_per_chip"] > 0 and r["peak_bytes_per_chip"] <= 0.75 * 80 * GiB


def test_bad_cuda_topology_is_one_line(tmp_path):
    proc, _ = _compile(tmp_path, "--topology", "cuda:a100x8", "--model", CONFIGS / "llama-3.1-8b")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxserve: error: topology: 'cuda:a100x8'")


def test_int8_weights_report_their_triton_matmuls_from_ptxas(tmp_path):
    """With int8 weights the projections run the Triton quantized matmul: ptxas's figures for
    each (from `ptxas -v` over the PTX XLA dumped, the launch from its thunk sequence)."""
    proc, r = compile_tiny(tmp_path, "cuda:h100x1", 1, "--quantize", "int8", "--token-buckets", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (p,) = r["programs"]
    mm = [k for k in p["ptxas"]["kernels"] if k["source"] == "triton"]
    assert mm and all(k["name"].startswith("quantized_matmul_int8") for k in mm), p["ptxas"]
    for k in mm:
        assert k["threads"] == 128 and 0 < k["registers"] <= 255 and k["dynamic_smem_bytes"] > 0, k
        assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0, k
        assert 0 < k["occupancy"] <= 1 and k["limited_by"] in ("registers", "shared memory", "warps", "blocks"), k


def test_accelerator_check_cases_compile_for_h200(tmp_path):
    """Every paged-attention and quantized-matmul case the one-shot H200 check would time
    (Llama-3-8B shapes), compiled for sm_90a here: each compiles and ptxas gives each kernel a
    register count, shared memory and no spills (the int8 attention's 128-key block spilled,
    which is why its block-size row says 64)."""
    out = tmp_path / "check.jsonl"
    proc = subprocess.run([sys.executable, "scripts/accelerator_check.py", "--compile-for", "cuda:h200x1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    cases = [r for r in recs if r["kind"] in ("attention", "qmatmul")]
    assert {r["kind"] for r in cases} == {"attention", "qmatmul"} and len(cases) >= 40
    assert [r for r in cases if r["status"] != "compiled"] == []
    assert recs[-1] == {**recs[-1], "kind": "summary", "compiled": len(cases), "error": 0}
    for r in cases:
        want = "mosaic_gpu" if r["kind"] == "attention" else "triton"
        (k,) = [k for k in r["ptxas"] if k["source"] == want]
        assert 0 < k["registers"] <= 255 and k["threads"] == 128 and k["blocks_per_sm"] >= 1, r
        assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0, r
