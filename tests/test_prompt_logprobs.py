"""prompt_logprobs (vLLM's) on the tiny random model, against the dense model's log-softmax at
every prompt position: prompts chunked over several steps, n = 2, a prompt whose prefix is in the
prefix cache (a prompt_logprobs request must not use it), no compilation after warm-up; and
echo + logprobs on HTTP /v1/completions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_forward, drain, make_engine

from jaxserve.types import InvalidRequestError, SamplingParams

K = 4  # top logprobs asked for

# Paged (chunked, XLA) and dense attention sum the same fp32 products in different orders and
# chunkings, so logits differ by rounding that grows through the layers; the largest difference
# of a logprob measured here is 1.6e-5 (112 positions; log-softmax values near -log(256) = -5.5,
# float32 eps 1.2e-7). 1e-4 keeps a 6x margin and still catches a wrong position or token, whose
# logprobs differ by order 1.
ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model):
    from jaxserve.engine import step_program
    model, tok = tiny_model
    # 32-token steps: the 70-token prompt is computed in three chunks. Blocks of 12 positions:
    # bucket 32 is projected in three blocks, the last one padded (the HTTP test below keeps
    # the default, one block per bucket).
    mp = pytest.MonkeyPatch()
    mp.setattr(step_program, "PROMPT_LP_ROWS", 12)
    try:
        yield make_engine(model, tok, token_buckets=(8, 32), max_num_batched_tokens=32)
    finally:
        mp.undo()


def reference(model, prompts):
    """Dense log-softmax at every position: row i, position p -> distribution of token p + 1."""
    return dense_forward(model, lambda lg: jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1))(prompts)


def test_prompt_logprobs_match_the_dense_log_softmax(engine, tiny_model):
    model, _ = tiny_model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 40, 70)]
    # The third prompt's first 48 tokens go into the prefix cache first.
    engine.add_request({"prompt_token_ids": prompts[2][:48] + [9]}, SamplingParams(temperature=0.0, max_tokens=1), request_id="warm")
    drain(engine)
    engine.pop_finished("warm")
    params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K), SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0, n=2),
              SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K, logprobs=2), SamplingParams(temperature=0.0, max_tokens=3)]
    for i, (p, sp) in enumerate(zip(prompts + [prompts[2]], params)):
        engine.add_request({"prompt_token_ids": p}, sp, request_id=str(i))
    drain(engine)
    assert engine.compiles_after_warmup == 0  # (the dense reference below compiles its own)
    outs = [engine.pop_finished(str(i)) for i in range(4)]
    assert outs[2].num_cached_tokens == 0, "a prompt_logprobs request must not read the prefix cache"
    assert outs[3].num_cached_tokens > 0 and outs[3].prompt_logprobs is None
    ref = reference(model, prompts)
    for i, (p, out, sp) in enumerate(zip(prompts, outs, params)):
        got = out.prompt_logprobs
        assert len(got) == len(p) and got[0] is None
        for pos in range(1, len(p)):
            lp = got[pos]
            want = ref[i, pos - 1]
            assert lp.token_id == p[pos]
            assert abs(lp.logprob - want[p[pos]]) < ATOL, (i, pos, lp.logprob, want[p[pos]])
            n = sp.prompt_logprobs
            assert len(lp.top) == n
            if n:
                order = np.argsort(-want, kind="stable")[:n]
                assert [t for t, _ in lp.top] == order.tolist()
                np.testing.assert_allclose([v for _, v in lp.top], want[order], atol=ATOL)
    # Asking for prompt logprobs changes nothing about the samples.
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(engine, tiny_model):
    """Five 70-token prompts with 50 tokens to generate need 600 tokens of KV; the pool holds 384
    (96 pages of 4), so sequences are preempted and recomputed: every position is still
    reported once, with the dense model's value."""
    model, _ = tiny_model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=70).tolist() for _ in range(5)]
    before = engine.stats["preemptions"]
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=50, prompt_logprobs=1), request_id=f"p{i}")
    drain(engine)
    assert engine.stats["preemptions"] > before, "the pool was meant to force preemption"
    ref = reference(model, prompts)
    for i, p in enumerate(prompts):
        got = engine.pop_finished(f"p{i}").prompt_logprobs
        assert got[0] is None
        np.testing.assert_allclose([lp.logprob for lp in got[1:]], [ref[i, q - 1, p[q]] for q in range(1, len(p))],
                                   atol=ATOL)
        assert [lp.top[0][0] for lp in got[1:]] == ref[i, :len(p) - 1].argmax(-1).tolist()


def test_bad_prompt_logprobs_names_the_field():
    for v in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=v)
        assert e.value.field == "prompt_logprobs"


def test_echo_with_logprobs_and_prompt_logprobs_over_http(tiny_model):
    import httpx

    from jaxserve.server.app import BackgroundServer
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.generation_service import ModelDescription
    model, tok = tiny_model
    eng = make_engine(model, tok, token_buckets=(8, 32), max_num_batched_tokens=32)
    s = BackgroundServer(eng, ServerConfig(port=0, http_port=0, progress=False), description=ModelDescription("tiny"))
    s.start(ready_timeout=60)
    try:
        url = f"http://127.0.0.1:{s.server.http_port}/v1/completions"
        prompt = "The quick brown fox jumps"
        ids = tok.encode(prompt)
        r = httpx.post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                  "echo": True, "logprobs": 2, "prompt_logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        lp = c["logprobs"]
        P = len(ids)
        assert c["text"].startswith(prompt) and len(lp["tokens"]) == P + 2
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = reference(model, [ids])[0]
        np.testing.assert_allclose(lp["token_logprobs"][1:P], [want[p - 1, ids[p]] for p in range(1, P)], atol=ATOL)
        # OpenAI keys top_logprobs by token text: two byte tokens that both decode to U+FFFD
        # share one key, so a position may show fewer than 2.
        assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"][P] == len(prompt)
        # vLLM's prompt_logprobs: per token {id: {logprob, decoded_token}}, the token itself included.
        pl = c["prompt_logprobs"]
        assert pl[0] is None and len(pl) == P
        assert all(abs(pl[p][str(ids[p])]["logprob"] - want[p - 1, ids[p]]) < ATOL for p in range(1, P))
        bad = httpx.post(url, json={"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1, "stream": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
        # gRPC: the same values, unary and on the stream's last message.
        from jaxserve.server.proto import generation_pb2 as pb
        from test_server_support import gen_stub
        stub = gen_stub(s)
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=2, prompt_logprobs=1)
        unary = stub.GenerateUnary(req, timeout=60).prompt_logprobs
        last = list(stub.Generate(req, timeout=60))[-1].prompt_logprobs
        for got in (unary, last):
            assert [lp.token_id for lp in got] == ids[1:] and all(len(lp.top) == 1 for lp in got)
            # float32 on the wire: the same tolerance, the rounding (~3e-7 at |x| ~ 5) is far below it.
            np.testing.assert_allclose([lp.logprob for lp in got], [want[p - 1, ids[p]] for p in range(1, P)], atol=ATOL)
    finally:
        s.stop()
