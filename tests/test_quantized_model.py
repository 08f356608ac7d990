"""The model running quantized weights, end to end: the function it computes, SmolLM2's accuracy
as shipped (4-bit) and at int8, the paged engine against the dense generator, Orbax checkpoints
through `jaxserve convert --to orbax` and `loading.load`, and every entry point's --quantize.

What the loaders produce is tests/test_quantize_load.py; the matmuls, tests/test_quantized_matmul.py;
tensor parallelism with quantized weights, tests/test_tensor_parallel.py.
"""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_dense_greedy, byte_tokenizer, drain, make_engine
from quant_text import TEXT, greedy_and_perplexity, logits
from tolerances import fp32_reorder_atol

import checkpoints
from checkpoints.errors import CheckpointError
from checkpoints.quantize import QuantizeSpec, dequantize_params, quantize_params
from jaxserve import loading
from jaxserve.cli import main as cli_main
from jaxserve.config import ConfigError
from jaxserve.engine.dense_generator import DenseGenerator
from jaxserve.model import quant_linear as ql
from jaxserve.model.llama import Llama, flat_params, replicate_kv_heads
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "llama_mqa"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny random HF checkpoint with a byte tokenizer beside it, so every entry point loads it."""
    d = tmp_path_factory.mktemp("tiny")
    for f in TINY.iterdir():
        shutil.copy(f, d)
    byte_tokenizer().save_hf_folder(d)
    return d


# ---- the function the quantized model computes ----------------------------------------------

@pytest.mark.parametrize("mode,dtype", [("int8", "float32"), ("int4", "float32"), ("int4", "bfloat16")])
def test_quantized_model_computes_the_dequantized_weights_function(mode, dtype):
    """Every projection, the LM head and the embedding run from the quantized arrays: the logits
    are the float model's on exactly the dequantized weights (fp32 summation order apart), and
    from_arrays kept the arrays as stored (no cast to the model dtype)."""
    fp = checkpoints.load_params(TINY)
    qp = quantize_params(fp.config, fp.params, QuantizeSpec(mode))
    model = Llama.from_arrays(fp.config, qp, dtype=jnp.dtype(dtype))
    wq = model.layers.wq[...]
    assert ql.is_quantized(wq) and wq.q.dtype == (jnp.int8 if mode == "int8" else jnp.uint8)
    assert wq.scale.dtype == qp["layers.wq"].scale.dtype  # fp16 groups; fp32 when per channel (int8 here)
    ids = list(range(5, 40))
    got = logits(model, ids)
    want = logits(Llama.from_arrays(fp.config, dequantize_params(qp), dtype=jnp.dtype(dtype)), ids)
    # fp32: only summation order differs (~1e-6 relative). bf16: activations are rounded to
    # bf16 between layers on both sides, but in different places (the quantized matmul takes
    # x in fp32 and rounds its output), so ~1% of the logit range.
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_from_arrays_checks_quantized_parameters():
    fp = checkpoints.load_params(TINY)
    qp = quantize_params(fp.config, fp.params, QuantizeSpec("int8"))
    wrong = dict(qp, **{"layers.wq": jax.tree.map(lambda a: a[:1], qp["layers.wq"])})
    with pytest.raises(ValueError, match=r"parameter layers.wq: quantized weight of full shape \(1, 64, 4, 16\), "
                                         r"expected \(2, 64, 4, 16\)"):
        Llama.from_arrays(fp.config, wrong)
    norm = ql.QuantizedWeight(q=np.zeros((2, 1, 64), np.int8), scale=np.ones((2, 1, 1), np.float32), zero=None,
                              bits=8, group_size=64, shape=(64,), in_axes=(0,))
    with pytest.raises(ValueError, match="parameter layers.attn_norm: cannot be quantized"):
        Llama.from_arrays(fp.config, dict(qp, **{"layers.attn_norm": norm}))
    import dataclasses
    # wq (D=64, 4 heads, 16) stored as if its heads were the inputs: the arrays fit, the model's contraction does not
    transposed = dataclasses.replace(qp["layers.wq"], in_axes=(1, 2))
    with pytest.raises(ValueError, match=r"parameter layers.wq: quantized along axes \(1, 2\).*contracts axes \(0,\)"):
        Llama.from_arrays(fp.config, dict(qp, **{"layers.wq": transposed}))


def test_kv_head_replication_repeats_quantized_rows_exactly():
    """replicate_kv_heads (tensor parallelism over more devices than KV heads) on quantized k/v:
    KV head j of the result stores exactly the packed rows (codes, scales, zeros) of head
    j // copies of the original, bit for bit; and the logits move only by fp32 reduction order."""
    fp = checkpoints.load_params(TINY)  # MQA: one KV head
    model = Llama.from_arrays(fp.config, quantize_params(fp.config, fp.params, QuantizeSpec("int4")))
    copies = 4
    wide = replicate_kv_heads(model, copies)
    assert wide.cfg.num_kv_heads == copies
    K, H = model.cfg.num_kv_heads, model.cfg.head_dim
    for name in ("wk", "wv"):
        a, b = getattr(model.layers, name)[...], getattr(wide.layers, name)[...]
        assert (b.bits, b.group_size, b.in_axes) == (a.bits, a.group_size, a.in_axes)
        for field in ("q", "scale", "zero"):
            # Stored rows are the output features, KV head by KV head: [L, K * H, ...] -> [L, K, H, ...].
            rows_a = np.asarray(getattr(a, field)).reshape(a.lead_shape + (K, H, -1))
            rows_b = np.asarray(getattr(b, field)).reshape(b.lead_shape + (K * copies, H, -1))
            assert rows_b.dtype == rows_a.dtype
            for j in range(K * copies):
                assert np.array_equal(rows_b[:, j], rows_a[:, j // copies]), (name, field, j)
    ids = list(range(3, 20))
    want = logits(model, ids)
    # Same weights, same math; what may change is the accumulation order XLA picks for the
    # wider k/v projections (it vectorizes by output width, and AVX2 and AVX-512 machines
    # differ): the fp32 reordering bound of the longest reduction, the hidden size.
    np.testing.assert_allclose(logits(wide, ids), want, rtol=0,
                               atol=fp32_reorder_atol(model.cfg.hidden_size, want))


# ---- SmolLM2: as shipped (Q4_1 projections, Q8_0 embedding) and int8 --------------------------

@pytest.fixture(scope="module")
def shipped():
    """The default GGUF's own 4-bit blocks through loading.load, as `--quantize as-shipped`."""
    return loading.load(None, "float32", quantize="as-shipped")


def test_smollm2_as_shipped_answers_paris_and_keeps_its_perplexity(smollm2, shipped):
    """Greedy text through the dense generator, and the perplexity of a fixed text against the
    same weights dequantized to fp32 (the session fixture: `--quantize none`)."""
    assert shipped.quantize == "as-shipped" and "int4/g32" in shipped.weights and "int8/g32" in shipped.weights
    assert ql.is_quantized(shipped.model.embed[...]) and ql.is_quantized(shipped.model.layers.w_down[...])
    tok = shipped.tokenizer
    prompt = tok.encode("The capital of France is")
    out = list(DenseGenerator(shipped.model, shipped.eos_token_ids).generate(prompt, SamplingParams(temperature=0.0, max_tokens=4)))
    assert tok.decode(out).startswith(" Paris"), tok.decode(out)
    text = tok.encode(" Paris.\n\n" + TEXT)
    g32, p32 = greedy_and_perplexity(smollm2.model, prompt, text)
    g4, p4 = greedy_and_perplexity(shipped.model, prompt, text)
    # int8 quantize-on-load, from the same fp32 weights the loader would read (quantize_params
    # is build_params' arithmetic on the model layout; the loader itself: the tiny tests here).
    int8 = Llama.from_arrays(smollm2.config, quantize_params(
        smollm2.config, {k: np.asarray(v) for k, v in flat_params(smollm2.model).items()}, QuantizeSpec("int8")))
    g8, p8 = greedy_and_perplexity(int8, prompt, text)
    print(f"\nperplexity of {len(text)} tokens: fp32 (the GGUF dequantized) {p32:.4f}, 4-bit as shipped "
          f"{p4:.4f} ({p4 / p32 - 1:+.3%}), int8 g64 {p8:.4f} ({p8 / p32 - 1:+.3%})")
    assert [tok.decode([g]) for g in (g32, g4, g8)] == [" Paris"] * 3
    # The shipped blocks are bit-identical to the fp32 weights (test_quantize_load), so only the
    # summation order differs: far inside the 2%. int8 rounds the weights: the 0.5%.
    assert abs(p4 / p32 - 1) < 0.02
    assert abs(p8 / p32 - 1) < 0.005


def test_paged_engine_matches_dense_generator_with_quantized_weights(shipped):
    lm = shipped
    prompts = ["The capital of France is", "Once upon a time, there was a little"]
    eng = make_engine(lm.model, lm.tokenizer, lm.eos_token_ids, page_size=16, num_pages=32, max_num_seqs=2,
                      max_num_batched_tokens=16, token_buckets=(2, 16))
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=10), request_id=str(i))
    drain(eng)
    got = [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(len(prompts))]
    assert eng.compiles_after_warmup == 0  # before the dense reference compiles its own program
    assert_dense_greedy(lm.model, [lm.tokenizer.encode(p) for p in prompts], got, 10, lm.eos_token_ids)


def test_llm_api_takes_quantize(tiny_folder):
    """jaxserve.LLM(quantize=...) runs the engine on the quantized weights: the dense generator's
    greedy tokens from loading.load with the same option."""
    from jaxserve import LLM
    llm = LLM(str(tiny_folder), quantize="int8", progress=False, max_model_len=256, num_pages=64,
              max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), compilation_cache_dir=None)
    assert llm.loaded.quantize == "int8" and ql.is_quantized(llm.loaded.model.layers.wq[...])
    got = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    lm = loading.load(tiny_folder, quantize="int8")
    assert got == list(DenseGenerator(lm.model).generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))


# ---- Orbax: convert --to orbax, then load with no conversion ---------------------------------

def test_convert_to_orbax_then_load_gives_identical_logits(tiny_folder, tmp_path, capsys):
    out = tmp_path / "tiny-int4"
    assert cli_main(["convert", str(tiny_folder), str(out), "--to", "orbax", "--quantize", "int4"]) == 0
    assert "Orbax, --quantize int4" in capsys.readouterr().out
    direct = loading.load(tiny_folder, quantize="int4")
    back = loading.load(out)  # detected as Orbax: no --quantize needed, nothing converted
    assert (back.format, back.quantize) == ("orbax", "int4") and back.load_s > 0
    ids = list(range(4, 30))
    np.testing.assert_array_equal(logits(back.model, ids), logits(direct.model, ids))
    assert back.tokenizer.encode("hi there") == direct.tokenizer.encode("hi there")
    # generate --stats reports where the weights came from and the load time
    assert cli_main(["generate", "--model", str(out), "--prompt", "ab", "--max-tokens", "2", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "load " in err and "(orbax, " in err and "int4/g32" in err, err


# ---- bad options name the option -------------------------------------------------------------

def test_bad_quantize_options_name_the_option(tiny_folder, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="--quantize as-shipped needs a quantized checkpoint"):
        loading.load(tiny_folder, quantize="as-shipped")
    # The quantize fields are load configuration: ConfigErrors naming the field.
    with pytest.raises(ConfigError, match="^quantize: 'int3' is not supported"):
        loading.load(tiny_folder, quantize="int3")
    with pytest.raises(ConfigError, match="^quantize_group_size: int4 group size 48 not in"):
        loading.load(tiny_folder, quantize="int4", quantize_group_size=48)
    with pytest.raises(ConfigError, match="^quantize_group_size: a group size applies to int8/int4 only"):
        loading.load(tiny_folder, quantize_group_size=32)
    with pytest.raises(ConfigError, match="quant_impl: 'fast' is not available"):
        loading.load(tiny_folder, quantize="int8", quant_impl="fast")
    with pytest.raises(ConfigError, match="quant_impl: 'pallas_tpu' needs a TPU backend"):
        loading.load(tiny_folder, quantize="int8", quant_impl="pallas_tpu")
    with pytest.raises(ConfigError, match="quant_impl: 'xla' applies to quantized weights"):
        loading.load(tiny_folder, quant_impl="xla")
    with pytest.raises(ConfigError, match="^quantize: 'int2' is not supported"):
        from jaxserve import LLM
        LLM(str(tiny_folder), quantize="int2")
    orbax = tmp_path / "o"
    assert cli_main(["convert", str(tiny_folder), str(orbax), "--to", "orbax", "--quantize", "int8"]) == 0
    with pytest.raises(CheckpointError, match="quantize: 'int4', but .* Orbax checkpoint written with quantize 'int8'"):
        loading.load(orbax, quantize="int4")
    capsys.readouterr()
    # the command line: argparse names the flag; our errors are one line, exit status 2
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "--prompt", "x", "--quantize", "int3"])
    assert e.value.code == 2 and "argument --quantize/--quantization: invalid choice: 'int3'" in capsys.readouterr().err
    assert cli_main(["convert", str(checkpoints.default_model_path()), str(tmp_path / "hf"), "--quantize", "int8"]) == 2
    assert "jaxserve: error: quantize: applies to `convert --to orbax`" in capsys.readouterr().err
    assert cli_main(["generate", "--model", str(tiny_folder), "--prompt", "x", "--quantize", "as-shipped"]) == 2
    assert "--quantize as-shipped needs a quantized checkpoint" in capsys.readouterr().err


def test_every_entry_point_takes_the_quantize_flags(tiny_folder):
    """serve, and the scripts (their flags: jaxserve.flags, generated from LoadConfig) pass
    --quantize / --quantize-group-size / --quant-impl on (tests/test_config_flags.py walks every
    entry point's parser)."""
    import argparse

    from jaxserve import flags
    from jaxserve.cli import build_parser
    from jaxserve.server.cli import build_engine
    args = build_parser().parse_args(["serve", "--model", str(tiny_folder), "--quantize", "int4",
                                      "--quantize-group-size", "64", "--max-model-len", "64"])
    engine, description = build_engine(args)
    wo = engine.runner._state["layers"]["wo"][...]
    assert ql.is_quantized(wo) and (wo.bits, wo.group_size) == (4, 64)
    assert description.quantization.startswith("int4: ")
    ap = argparse.ArgumentParser()
    flags.add_engine_flags(ap)
    load, engine = flags.engine_configs(ap.parse_args(["--quantize", "int8", "--quant-impl", "xla", "--max-num-seqs", "4"]))
    assert (load.quantize, load.quantize_group_size, load.quant_impl) == ("int8", None, "xla")
    assert engine.scheduler.max_num_seqs == 4
