"""HF folders without tokenizer.json (jaxserve/tokenizer_files.py): SentencePiece tokenizer.model,
vocab.json + merges.txt, or no tokenizer at all (token ids only), and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from conftest import assert_dense_greedy
from jaxserve.server.app import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.fake_engine import VOCAB_SIZE, fake_generate, make_fake_engine
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.tokenizer import Tokenizer, TokenizerError
from jaxserve.tokenizer_files import SentencePieceModel
from test_server_support import code_and_field, gen_stub, wait_idle

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "llama_mqa"  # config + weights, no tokenizer files


# ---- SentencePiece ------------------------------------------------------------------------

def spm_folder(tmp_path: Path, model_type: int = 2) -> Path:
    """A hand-made SentencePiece BPE model: <unk> <s> </s>, five characters, four merges whose
    scores fix their order, and the 256 byte pieces for byte fallback."""
    m = SentencePieceModel()
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("▁", -10, 1), ("h", -11, 1), ("e", -12, 1),
              ("l", -13, 1), ("o", -14, 1), ("▁h", -1, 1), ("ll", -2, 1), ("▁he", -3, 1), ("llo", -4, 1)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    for piece, score, typ in pieces:
        m.pieces.add(piece=piece, score=score, type=typ)
    m.trainer_spec.model_type = model_type
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id = 0, 1, 2
    (tmp_path / "tokenizer.model").write_bytes(m.SerializeToString())
    return tmp_path


def test_sentencepiece_bpe_merges_by_score_and_falls_back_to_bytes(tmp_path):
    tok = Tokenizer.from_hf_folder(spm_folder(tmp_path))
    ids = {p: tok.hf_tokenizer.token_to_id(p) for p in ("▁he", "llo", "▁h", "<0xC3>", "<0xA9>")}
    # "▁hello": ▁+h (score -1), l+l (-2), ▁h+e (-3), ll+o (-4) -> ▁he llo
    assert tok.encode("hello") == [ids["▁he"], ids["llo"]]
    assert tok.encode("hé") == [ids["▁h"], ids["<0xC3>"], ids["<0xA9>"]]  # é is not a piece: its bytes
    assert tok.decode(tok.encode("hello hé")) == "hello hé"
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
    assert not tok.ids_only


def test_sentencepiece_unigram_and_garbage_are_refused_naming_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="model type 1 is not supported"):
        Tokenizer.from_hf_folder(spm_folder(tmp_path, model_type=1))
    (tmp_path / "tokenizer.model").write_bytes(b"\xff\xff not a protobuf")
    with pytest.raises(TokenizerError, match="tokenizer.model: not a SentencePiece model"):
        Tokenizer.from_hf_folder(tmp_path)


# ---- vocab.json + merges.txt --------------------------------------------------------------

def test_vocab_and_merges_load_as_byte_level_bpe_matching_the_gguf_tokenizer(tmp_path):
    """SmolLM2's own vocabulary written as GPT-2 files: the same ids as its GGUF tokenizer on
    text without digits (GPT-2's pre-tokenizer keeps digit runs whole, SmolLM2's splits them)."""
    import checkpoints
    from checkpoints.gguf_loader import GGUFCheckpoint
    meta = GGUFCheckpoint(checkpoints.resolve_model_path(None)).metadata
    ref = Tokenizer.from_gguf_metadata(meta)
    tokens = list(meta["tokenizer.ggml.tokens"])
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(meta["tokenizer.ggml.merges"]) + "\n",
                                         encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>",
        "added_tokens_decoder": {str(i): {"content": tokens[i], "special": True} for i in range(3)}}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    text = "The capital of France is Paris. Ünïcödé, 日本語 and emoji 🙂!\n<|im_start|>user"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == (2,)


# ---- no tokenizer: token ids only ---------------------------------------------------------

def _cli(capsys, *args) -> tuple[int, str, str]:
    """`jaxserve ARGS` in this process (no interpreter and jax start-up per case)."""
    from jaxserve.cli import main
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_without_tokenizer_refuses_text_in_one_line_and_runs_token_ids(capsys, tiny_model):
    code, _, err = _cli(capsys, "generate", "--model", str(TINY), "--prompt", "hello", "--max-tokens", "3")
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("jaxserve: error: "), err
    assert "tokenizer.json" in err and "prompt_token_ids" in err
    code, out, err = _cli(capsys, "generate", "--model", str(TINY), "--prompt-token-ids", "5,6,7",
                          "--max-tokens", "3")
    assert code == 0, err
    model, tok = tiny_model
    assert_dense_greedy(model, [[5, 6, 7]], [[int(x) for x in out.strip().split(",")]], 3,
                        stop_ids=tok.eos_token_ids)


def test_every_generate_error_is_one_line_with_status_2(capsys, tmp_path):
    for f in TINY.iterdir():  # the tiny model's weights, beside a broken tokenizer.model
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    cases = [("--model", str(tmp_path), "--prompt", "x"),  # a broken tokenizer.model
             ("--prompt-token-ids", "1,x"),  # argparse's own error (usage line, then the error)
             ("--prompt", "x", "--top-k", "2147483648"),
             ("--model", "/nope", "--prompt", "x")]
    for args in cases:
        code, _, err = _cli(capsys, "generate", *args)
        assert code == 2, (args, err)
        assert "Traceback" not in err, (args, err)
        assert err.strip().splitlines()[-1].startswith("jaxserve") and "error:" in err, (args, err)
    assert "tokenizer.model: not a SentencePiece model" in _cli(capsys, "generate", *cases[0])[2]


def test_a_server_on_token_ids_only_refuses_text_naming_the_files_and_serves_ids(tmp_path):
    engine = make_fake_engine()
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    engine.tokenizer = Tokenizer.from_hf_folder(folder)
    assert engine.tokenizer.ids_only and engine.tokenizer.vocab_size == VOCAB_SIZE
    with BackgroundServer(engine, ServerConfig(port=0, progress=False)) as s:
        stub = gen_stub(s)
        for req, field in ((pb.GenerateRequest(prompt="hello", max_tokens=2), "prompt"),
                           (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(
                               role="user", content="hi")]), max_tokens=2), "messages")):
            with pytest.raises(grpc.RpcError) as e:
                stub.GenerateUnary(req, timeout=10)
            assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, field), e.value.details()
            assert "tokenizer.json" in e.value.details()
        prompt = [72, 105]
        out = stub.GenerateUnary(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=6,
                                                    ignore_eos=True), timeout=10).completions[0]
        want, _ = fake_generate(prompt, 6, ignore_eos=True)
        assert (list(out.token_ids), out.text) == (want, "")
        wait_idle(s)
