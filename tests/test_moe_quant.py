"""Quantized Mixture-of-Experts weights (--quantize int8 / int4 on a MoE checkpoint): the experts
are QuantizedWeight stacks [L, E, N, .], read as stored by the quantized grouped matmul
(layers.moe_mlp -> GroupedMatmul.quantized). Reference: the same model in float built from the
dequantized weights (dequantize_params), so the only difference left is fp32 summation order
(the quantized attention projections' and the experts')."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import byte_tokenizer, dense_forward, drain, make_engine

from checkpoints.quantize import QuantizeSpec, dequantize_params, load_quantized_params
from jaxserve.model.decoder import Decoder
from jaxserve.model.quant_linear import QuantizedWeight
from jaxserve.types import SamplingParams
from tests.tolerances import fp32_reorder_atol

MIXTRAL = Path(__file__).resolve().parent / "data" / "mixtral_moe"  # 4 experts, top 2, D 64, F 128
PROMPTS = [list(range(5, 17)), list(range(40, 60)), [7, 3, 9]]


def test_quantized_experts_match_the_float_model_and_run_in_the_engine():
    """int4 experts (int8: tests/test_grouped_matmul_quantized.py). Dense: logits equal the
    float model of the same dequantized weights up to fp32 summation order (the longest
    reduction is the experts' F = 128). Paged engine (chunked prefill, n = 2): greedy ids equal the
    dense quantized model's at tp = 2 (expert FFN columns split, quantized blocks and all), with
    no recompilation after warm-up."""
    loaded = load_quantized_params(MIXTRAL, QuantizeSpec("int4"))
    cfg, params = loaded.config, loaded.params
    for path in ("layers.we_gate", "layers.we_up", "layers.we_down"):
        w = params[path]
        assert isinstance(w, QuantizedWeight) and w.lead_shape == (2, 4) and w.bits == 4, path
    assert not isinstance(params["layers.w_router"], QuantizedWeight)
    model = Decoder.from_arrays(cfg, params)
    logits_of = dense_forward(model)
    quant = logits_of(PROMPTS)
    ref = dense_forward(Decoder.from_arrays(cfg, dequantize_params(params)))(PROMPTS)
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(quant[i, :len(p)], ref[i, :len(p)], rtol=0, atol=fp32_reorder_atol(128, ref[i]))
        assert (quant[i, :len(p)].argmax(-1) == ref[i, :len(p)].argmax(-1)).all()
    eng = make_engine(model, byte_tokenizer(), tp=2, max_model_len=64, page_size=4, num_pages=32, max_num_seqs=4,
                      max_num_batched_tokens=8, token_buckets=(8,))
    # tp = 2 on fake devices: w_down's quantized inputs (F = 128) split, 32 packed bytes each
    assert eng.runner._state["layers"]["we_down"][...].q.addressable_shards[0].data.shape == (2, 4, 64, 32)
    sp = SamplingParams(temperature=0.0, max_tokens=6, n=2, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request({"prompt_token_ids": p}, sp, request_id=str(i))
    drain(eng)
    assert eng.compiles_after_warmup == 0
    for i, p in enumerate(PROMPTS):
        outs = eng.pop_finished(str(i)).outputs
        seq = list(p)
        for _ in range(6):  # the dense model's greedy continuation
            seq.append(int(logits_of([seq])[0, len(seq) - 1].argmax()))
        assert [o.token_ids for o in outs] == [seq[len(p):]] * 2, i
