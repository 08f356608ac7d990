"""Mixture-of-Experts GGUFs: Mixtral (llama.cpp writes it as `llama` with `llama.expert_count`)
and Qwen3-MoE (`qwen3moe`), experts fused per layer into 3-D tensors (ffn_gate_exps [E, F, D],
ffn_up_exps, ffn_down_exps [E, D, F]; the router ffn_gate_inp [E, D]). The files are written
here from the tiny HF goldens' folders the way llama.cpp's converter lays them out; loading one
must give the HF folder's parameters bit for bit (F32), so it runs HF's golden tokens; and
as-shipped Q8_0 experts repack into int8 [L, E, N, K] stacks."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import dense_forward
from test_checkpoints import llama_cpp_permute
from test_goldens import check_case

import checkpoints
from checkpoints.hf import open_safetensors
from checkpoints.quantize import QuantizeSpec, load_quantized_params
from jaxserve.model import family
from jaxserve.model.decoder import Decoder
from jaxserve.model.quant_linear import QuantizedWeight

ROOT = Path(__file__).resolve().parents[1]
Q = gguf.GGMLQuantizationType


def write_moe_gguf(path: Path, name: str, experts_q8: bool = False) -> checkpoints.LoadedParams:
    """tests/data/<name> (an HF MoE folder) as a GGUF; returns the folder's float load."""
    ref = checkpoints.load_params(ROOT / "tests" / "data" / name)
    cfg = ref.config
    arch = "llama" if cfg.architecture == "mixtral" else "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size if arch == "llama" else 4 * cfg.hidden_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_expert_weights_norm(cfg.moe_norm_topk)
    with open_safetensors(ref.source) as (_, get):
        for gname, hf in family.gguf_to_hf_names(cfg).items():
            t = get(hf)
            if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
                t = llama_cpp_permute(t, cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads)
            w.add_tensor(gname, np.ascontiguousarray(t))
        for gname, hfs in family.gguf_expert_names(cfg).items():
            t = np.stack([get(h) for h in hfs])  # [E, out, in]
            if experts_q8:
                w.add_tensor(gname, gguf.quants.quantize(t, Q.Q8_0), raw_dtype=Q.Q8_0)
            else:
                w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.mark.parametrize("name", ["mixtral_moe", "qwen3_moe"])
def test_moe_gguf_loads_the_hf_weights_exactly(tmp_path, name):
    ref = write_moe_gguf(tmp_path / "m.gguf", name)
    got = checkpoints.load_params(tmp_path / "m.gguf")
    assert got.config.architecture == ref.config.architecture
    for f in ("num_experts", "num_experts_per_tok", "moe_norm_topk", "intermediate_size", "qk_norm"):
        assert getattr(got.config, f) == getattr(ref.config, f), f
    assert set(got.params) == set(ref.params)
    for k, v in ref.params.items():
        np.testing.assert_array_equal(got.params[k], v, err_msg=k)
    if name == "mixtral_moe":  # HF's golden tokens from the GGUF-loaded model (one compile)
        golden = json.loads((ROOT / "tests" / "goldens" / f"{name}.json").read_text())
        logits_of = dense_forward(Decoder.from_arrays(got.config, got.params))
        for case in golden["cases"]:
            assert check_case(logits_of, case, got.config) == case["greedy_ids"]


def test_moe_gguf_as_shipped_q8_experts(tmp_path):
    """Q8_0 experts: each expert's rows are its slice of the fused tensor's blocks; the stacks
    dequantize to gguf's own dequantize of the 3-D tensor exactly."""
    write_moe_gguf(tmp_path / "q.gguf", "mixtral_moe", experts_q8=True)
    shipped = load_quantized_params(tmp_path / "q.gguf", QuantizeSpec("as-shipped"))
    ck = checkpoints.load_params(tmp_path / "q.gguf")  # the float (dequantized) load
    for path in ("layers.we_gate", "layers.we_up", "layers.we_down"):
        qw = shipped.params[path]
        assert isinstance(qw, QuantizedWeight) and (qw.bits, qw.group_size, qw.lead_shape) == (8, 32, (2, 4))
        np.testing.assert_array_equal(np.asarray(qw.dequantize()), ck.params[path], err_msg=path)
    assert not isinstance(shipped.params["layers.w_router"], QuantizedWeight)  # F32 in the file


def test_per_expert_tensor_gguf_refused(tmp_path):
    """Old Mixtral GGUFs with one tensor per expert (blk.N.ffn_gate.E.weight): refused in one
    line naming the tensor."""
    write_moe_gguf(tmp_path / "m.gguf", "mixtral_moe")
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "llama")
    for k, f in r.fields.items():
        if not k.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name.replace("ffn_gate_exps", "ffn_gate.0"), np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(checkpoints.CheckpointError, match=r"GGUF tensor 'blk\.0\.ffn_gate\.0\.weight' has no known HF name"):
        checkpoints.load_params(tmp_path / "old.gguf")
