"""The tensor-parallel test workload, shared by the in-process tests and tests/tp_worker.py."""

import numpy as np

from jaxserve.config import ModelConfig

TINY_TP = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=256)


def tiny_tp_model(quantize=None, quant_impl="auto"):
    """quantize: None (float) or a checkpoints.quantize.QuantizeSpec applied to the weights,
    whose matmuls then run `quant_impl` (sharding/quantized_matmul.py)."""
    from flax import nnx

    from jaxserve.model.llama import Llama, flat_params
    # Larger-than-default weights so logits are well separated and greedy ties cannot flip.
    model = Llama(TINY_TP, rngs=nnx.Rngs(7))
    arrays = {k: np.asarray(v) * (5.0 if not k.endswith("norm") else 1.0) for k, v in flat_params(model).items()}
    if quantize is not None:
        from checkpoints.quantize import quantize_params
        from sharding import quantized_matmul as qmm
        return Llama.from_arrays(TINY_TP, quantize_params(TINY_TP, arrays, quantize),
                                 quantized_matmul=qmm.resolve(quant_impl))
    return Llama.from_arrays(TINY_TP, arrays)


def tiny_tp_prompts() -> list[list[int]]:
    """run_tiny_tp's six prompts (1-39 random byte tokens; each then gets 8 greedy tokens)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, int(rng.integers(1, 40))).tolist() for _ in range(6)]


def run_tiny_tp(tp: int, mesh=None, logprobs: bool = False, quantize=None, **engine_kw):
    from conftest import byte_tokenizer, drain, make_engine

    from jaxserve.types import SamplingParams
    # One bucket (every step pads to 32 tokens): compiling is most of these tests' time, and
    # sharded executables compile once per bucket.
    eng = make_engine(tiny_tp_model(quantize), byte_tokenizer(), tp=tp, token_buckets=(32,),
                      **({"mesh": mesh} if mesh else {}), **engine_kw)
    for i, prompt in enumerate(tiny_tp_prompts()):
        eng.add_request({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3 if logprobs else None),
                        request_id=str(i))
    drain(eng)
    assert eng.compiles_after_warmup == 0
    outs = [eng.pop_finished(str(i)).outputs[0] for i in range(6)]
    if logprobs:
        return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], eng
    return [o.token_ids for o in outs]


def write_tiny_tp_folder(folder):
    """TINY_TP with tiny_tp_model's weights as an HF folder, with the byte tokenizer: what
    `jaxserve serve --model FOLDER` loads (sharded, with --tp)."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from checkpoints.name_table import params_to_hf
    from conftest import byte_tokenizer
    from jaxserve.model.llama import flat_params
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_TP.to_hf_dict()))
    params = {k: np.asarray(v) for k, v in flat_params(tiny_tp_model()).items()}
    save_file(params_to_hf(TINY_TP, params), str(folder / "model.safetensors"))
    byte_tokenizer().save_hf_folder(folder)
    return folder
