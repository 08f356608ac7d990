"""Sliding windows read from each format as the reference reads them: a Mistral GGUF (llama.cpp
writes it as `llama`) keeps `llama.attention.sliding_window`; Qwen2 / Qwen3 window only the
layers at or above `max_window_layers`, as HF's Qwen2Config / Qwen3Config build layer_types."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import dense_forward
from test_checkpoints import random_params, tiny_cfg, write_tiny_gguf

import checkpoints
from checkpoints.quantize import QuantizeSpec, load_quantized_params
from jaxserve.config import ModelConfig
from jaxserve.model.decoder import Decoder


def test_mistral_gguf_loads_with_its_window(tmp_path):
    cfg = tiny_cfg(hidden_size=32, head_dim=8)
    params = random_params(cfg, seed=3)
    write_tiny_gguf(tmp_path / "m.gguf", cfg, params, quantize_embed=True, sliding_window=6)
    loaded = checkpoints.load_params(tmp_path / "m.gguf")
    assert loaded.config == dataclasses.replace(cfg, architecture="mistral", sliding_window=6)
    for k in params:
        if k != "embed":  # Q8_0 in the file
            np.testing.assert_array_equal(loaded.params[k], params[k], err_msg=k)
    d = loaded.config.to_hf_dict()  # what `jaxserve convert` writes
    assert (d["architectures"], d["sliding_window"]) == (["MistralForCausalLM"], 6)
    # as-shipped goes through the mistral family too (its q/k rows un-permuted like llama's)
    shipped = load_quantized_params(tmp_path / "m.gguf", QuantizeSpec("as-shipped"))
    assert shipped.config.sliding_window == 6
    np.testing.assert_array_equal(shipped.params["layers.wq"], params["layers.wq"])
    # without the key: plain llama, no window (as before)
    write_tiny_gguf(tmp_path / "l.gguf", cfg, params)
    assert checkpoints.load_params(tmp_path / "l.gguf").config == cfg


def _qwen2(**kw) -> dict:
    return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=64, hidden_size=16,
                intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, eos_token_id=2, **kw)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("mwl,window,types", [
    (1, 4, ("full_attention", "sliding_attention", "sliding_attention")),  # HF: i >= max_window_layers
    (0, 4, None),  # every layer windowed: the one-window form
    (3, None, None),  # no layer reaches max_window_layers: no window at all
])
def test_qwen_max_window_layers(arch, mwl, window, types):
    d = _qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=mwl)
    if arch == "qwen3":
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.sliding_window, cfg.layer_types) == (window, types)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # use_sliding_window false: no window whatever max_window_layers says (HF's rule)
    off = ModelConfig.from_hf_dict(dict(d, use_sliding_window=False))
    assert (off.sliding_window, off.layer_types) == (None, None)


def test_qwen2_lower_layers_attend_to_everything():
    """Behaviour, on a prompt longer than the window: max_window_layers = 1 differs from both the
    unwindowed and the all-windowed model (its layer 0 sees the whole prompt, layers 1-2 only
    the window). max_window_layers = 3 (no layer windowed) is the unwindowed config itself."""
    base = _qwen2(sliding_window=4)
    cfgs = {k: ModelConfig.from_hf_dict(dict(base, use_sliding_window=u, max_window_layers=m))
            for k, (u, m) in {"none": (False, 0), "mwl3": (True, 3), "mwl1": (True, 1), "all": (True, 0)}.items()}
    assert cfgs.pop("mwl3") == cfgs["none"]
    params = random_params(cfgs["none"], seed=4)
    ids = list(range(3, 20))  # 17 tokens, window 4
    out = {k: dense_forward(Decoder.from_arrays(c, params))([ids])[0][:len(ids)] for k, c in cfgs.items()}
    for other in ("none", "all"):
        assert np.abs(out["mwl1"][5:] - out[other][5:]).max() > 1e-3, other
    # inside the window every variant is the same model
    np.testing.assert_allclose(out["mwl1"][:4], out["none"][:4], rtol=1e-5, atol=1e-5)
