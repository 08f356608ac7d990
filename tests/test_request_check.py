"""Engine.validate is the single request check (engine/request_check.py): the offline API and
the server refuse the same requests with the same field and message."""

from __future__ import annotations

import grpc
import pytest

from jaxserve.server.fake_engine import fake_tokenizer, make_fake_engine
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.tokenizer import Tokenizer
from jaxserve.types import MAX_PROMPT_CHARS, InvalidRequestError, SamplingParams
from test_server_support import code_and_field, fake_server, gen_stub


def refusal(fn, *args, **kw) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        fn(*args, **kw)
    return e.value


def test_offline_chat_counts_roles_against_the_character_limit_as_the_server_does():
    """Fails on the old engine, which counted contents only (then tokenized a 1M-char chat)."""
    eng = make_fake_engine()
    msgs = [{"role": "r" * (MAX_PROMPT_CHARS - 5), "content": "0123456789"}]
    e = refusal(eng.add_request, msgs, SamplingParams(max_tokens=2))
    assert e.field == "messages" and "roles and content" in str(e) and not eng.has_unfinished()


def test_text_for_a_model_without_tokenizer_files_is_an_invalid_request_naming_the_prompt():
    """Was a bare TokenizerError offline (generate_batch could not make an error record of it)."""
    eng = make_fake_engine()
    eng.tokenizer = Tokenizer(fake_tokenizer().hf_tokenizer, ids_only="no tokenizer.json in /m")
    e = refusal(eng.validate, "Hi")
    assert e.field == "prompt" and "tokenizer.json" in str(e)
    assert eng.validate({"prompt_token_ids": [72, 105]}).prompt_ids == [72, 105]


def test_fill_context_gives_max_tokens_what_the_context_leaves():
    eng = make_fake_engine(max_model_len=64)
    v = eng.validate("Hi", SamplingParams(max_tokens=1), fill_context=True)
    assert v.prompt_ids == [72, 105] and v.params.max_tokens == 62
    v = eng.validate("Hi", SamplingParams(max_tokens=1))
    assert v.params.max_tokens == 1


@pytest.mark.parametrize("prompt,params", [
    ("x" * 300, SamplingParams(max_tokens=1)),  # over max_model_len=256
    ("Hi", SamplingParams(max_tokens=255)),  # prompt + max_tokens over the context
    ({"prompt_token_ids": [72, 999]}, SamplingParams()),  # outside the vocabulary
    ("Hi", SamplingParams(stop_token_ids=(400,))),
])
def test_the_server_and_the_offline_api_refuse_alike(prompt, params):
    offline = refusal(make_fake_engine().add_request, prompt, params)
    req = pb.GenerateRequest(max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids))
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt["prompt_token_ids"])
    with fake_server() as s:
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(s).GenerateUnary(req, timeout=10)
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, offline.field)
    assert e.value.details() == str(offline)
