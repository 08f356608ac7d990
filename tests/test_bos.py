"""The one BOS rule (tokenizer.with_bos): a model whose tokenizer adds BOS (Gemma's does) gets it
in front of text and chat prompts through the offline API, the server and `generate` alike,
never twice, and never in front of the caller's own token ids. The fake model's next token is a
hash of the whole history, so an output proves which prompt ids the model really saw.

On the old code the offline API and the server sent "Hi" as [72, 105] (no BOS)."""

from __future__ import annotations

import pytest

from jaxserve.engine.llm import LLM
from jaxserve.server.fake_engine import BOS_ID, fake_generate, fake_tokenizer, make_fake_engine
from jaxserve.server.proto import generation_pb2 as pb, jetstream_pb2 as js
from jaxserve.tokenizer import with_bos
from jaxserve.types import SamplingParams
from test_server_support import fake_server, gen_stub, js_stub

HI = [72, 105]  # "Hi", byte-level
CHAT = [{"role": "user", "content": "Hi"}]


def bos_llm() -> LLM:
    llm = LLM.__new__(LLM)  # LLM's own generate / chat over the fake engine
    llm.engine = make_fake_engine(tokenizer=fake_tokenizer(bos=True))
    llm.tokenizer = llm.engine.tokenizer
    return llm


def expected(prompt_ids, max_tokens=6):
    return fake_generate(prompt_ids, max_tokens, ignore_eos=True)[0]


def test_the_offline_api_adds_bos_to_text_and_chat_once_and_never_to_token_ids():
    llm = bos_llm()
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text, chat, ids = llm.generate(["Hi", CHAT, {"prompt_token_ids": HI}], p, use_tqdm=False)
    assert text.prompt_token_ids == [BOS_ID, *HI]
    assert text.outputs[0].token_ids == expected([BOS_ID, *HI])  # the model saw the BOS
    # The chat template renders bos_token itself: one BOS, not two.
    assert chat.prompt_token_ids[0] == BOS_ID and chat.prompt_token_ids.count(BOS_ID) == 1
    assert ids.prompt_token_ids == HI and ids.outputs[0].token_ids == expected(HI)


def test_a_tokenizer_without_bos_leaves_prompts_alone():
    """SmolLM2's case (its tokenizer adds no BOS): the prompt ids are the text's, as before."""
    eng = make_fake_engine()
    assert eng.validate("Hi").prompt_ids == HI
    assert not eng.tokenizer.add_bos_token and with_bos(HI, eng.tokenizer) == HI


@pytest.mark.parametrize("tok_bos", [True, False])
def test_the_server_applies_the_same_rule(tok_bos):
    want = [BOS_ID, *HI] if tok_bos else HI
    with fake_server(tokenizer=fake_tokenizer(bos=tok_bos)) as s:
        stub = gen_stub(s)
        r = stub.GenerateUnary(pb.GenerateRequest(prompt="Hi", max_tokens=6, ignore_eos=True), timeout=10)
        assert r.usage.prompt_tokens == len(want) and list(r.completions[0].token_ids) == expected(want)
        r = stub.GenerateUnary(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=HI), max_tokens=6,
                                                  ignore_eos=True), timeout=10)
        assert r.usage.prompt_tokens == 2 and list(r.completions[0].token_ids) == expected(HI)
        chat = stub.Tokenize(pb.TokenizeRequest(messages=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="Hi")])), timeout=10)
        assert list(chat.token_ids).count(BOS_ID) == (1 if tok_bos else 0)
        # JetStream: has_bos=true says the text already has it, so none is added.
        out = list(js_stub(s).Decode(js.DecodeRequest(max_tokens=6, has_bos=True,
                                                      text_content=js.DecodeRequest.TextContent(text="Hi")),
                                     timeout=10))
        ids = [t for m in out for c in m.stream_content.samples for t in c.token_ids]
        assert ids == fake_generate(HI, 6)[0]  # JetStream stops at EOS


def test_smollm2_gets_no_bos(smollm2):
    """The default model's tokenizer adds none (its goldens and the demo answer stay as they
    were). The session's SmolLM2 fixture, which most workers load for other tests anyway."""
    tok = smollm2.tokenizer
    ids = tok.encode("Hello")
    assert tok.bos_token_id is not None and not tok.add_bos_token and with_bos(ids, tok) == ids
