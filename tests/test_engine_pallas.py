"""The whole engine through the Pallas kernels in interpret mode (attention_impl
"pallas_*_interpret") against the XLA reference path: same greedy tokens for a mixed batch.

Interpret mode runs every kernel step through Python callbacks, so these are among the slowest
tests of the suite: a few requests, 8 tokens, and SmolLM2 cut to its first 4 layers (the kernel
runs the same code for every layer; all 30 took ~65 s a case here).
The interpreters also compile small helpers of their own while stepping, so the strict
no-compile-after-warm-up guard stays on for the XLA engine only.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import first_layers, make_engine
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model.llama import Llama
from jaxserve.types import SamplingParams
from pallas_kernels.interpret import FILL_ENV


def _greedy(model, tokenizer, eos, prompts, impl, max_tokens=8, with_logprobs=False, **kw):
    """Requests arrive one step apart, so steps mix prefill chunks with decodes."""
    eng = make_engine(model, tokenizer, eos, attention_impl=impl, **kw)
    eng.strict_compiles = impl == "xla"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2 if with_logprobs else None)
    for i, p in enumerate(prompts):
        eng.add_request({"prompt_token_ids": p}, params, request_id=str(i))
        eng.step()
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_finished(str(i)).outputs[0] for i in range(len(prompts))]
    tokens = [o.token_ids for o in outs]
    return (tokens, [o.logprobs for o in outs]) if with_logprobs else tokens


@pytest.mark.parametrize("kv_cache_dtype,fill", [("auto", "nan"), ("int8", "zero")])
def test_smollm2_greedy_through_tpu_kernel_equals_xla(smollm2, kv_cache_dtype, fill, monkeypatch):
    """fp32 SmolLM2 (first 4 layers); with int8 KV both paths dequantize the same codes, so
    they agree too. The two cases split the fills of uninitialised memory (NaN, zeros) between
    them: each kernel test in test_pallas_attention.py runs both, and doubling these engine
    runs would cost a minute."""
    monkeypatch.setenv(FILL_ENV, fill)
    lm = smollm2
    model = first_layers(lm.model, 4)
    prompts = [lm.tokenizer.encode(t) for t in
               ("The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):")]
    kw = dict(max_model_len=128, page_size=16, num_pages=32, max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(32,), kv_cache_dtype=kv_cache_dtype)  # one bucket: see below
    got = _greedy(model, lm.tokenizer, lm.eos_token_ids, prompts, "pallas_tpu_interpret", **kw)
    want = _greedy(model, lm.tokenizer, lm.eos_token_ids, prompts, "xla", **kw)
    assert got == want
    assert len({tuple(t) for t in want}) == len(prompts), "the cut model should still answer each prompt differently"


def _random_model(seed=0):
    """Two layers, head dim 64 (the smallest the GPU kernel takes), 4 query heads on 2 KV
    heads. At the default init (std 0.02) the residual stream is all embedding and greedy
    decoding just repeats the last token; layer weights 5x larger make attention decide the
    output (the tokens vary)."""
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True)
    model = Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = getattr(model.layers, name)
        w.set_value(w[...] * 5.0)
    return model


NEAR_TIE = 0.02  # logprob gap between the top two tokens below which bf16 MMA may pick either


def test_random_model_greedy_through_gpu_kernel_equals_xla(tiny_model, monkeypatch):
    """The GPU kernel's interpret mode is several times slower than the TPU one, too slow for
    SmolLM2's 30 layers; a 2-layer model with the same head dim runs the same code paths.

    Its MMA runs in bf16 (P and fp32 inputs rounded), and a random model's next-token
    distribution is nearly flat (top-two gaps of 1e-3 occur), so exact greedy equality with
    the fp32 reference cannot hold at near-ties. Each sequence must equal the XLA path's up to
    and including its first near-tie (the XLA top-two gap < NEAR_TIE); after a legitimate
    divergence the two continue from different prefixes. Half the tokens or more are compared.
    Uninitialised memory is zeros, as stale device memory is finite (the NaN fill, the
    interpreter's default, is covered by test_pallas_attention.py)."""
    monkeypatch.setenv(FILL_ENV, "zero")
    _, tok = tiny_model  # the byte tokenizer
    model = _random_model()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 23, 5)]
    # One token bucket: every step pads to 32 tokens (the kernels skip padding); a second
    # bucket only doubled the compiling, which is most of these tests' time.
    kw = dict(max_model_len=128, page_size=16, num_pages=32, max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(32,))
    got = _greedy(model, tok, (), prompts, "pallas_gpu_interpret", **kw)
    want, logprobs = _greedy(model, tok, (), prompts, "xla", with_logprobs=True, **kw)
    assert all(len(set(w)) > 3 for w in want), want  # attention matters: not one token repeated
    compared = 0
    for g, w, lps in zip(got, want, logprobs):
        for i, lp in enumerate(lps):
            if lp.top[0][1] - lp.top[1][1] < NEAR_TIE:
                break
            assert g[i] == w[i], (got, want)
            compared += 1
    assert compared >= 12, f"only {compared} of 24 tokens clear of near-ties"
