"""The tokenizer files an HF folder may hold instead of tokenizer.json, read into an HF
`tokenizers.Tokenizer`, and what a folder without any of them can still do.

    tokenizer.json                  the fast tokenizer, as is (jaxserve.tokenizer)
    tokenizer.model                 SentencePiece (Llama 1/2, Mistral): its pieces, scores and
                                    types become the GGUF-style vocabulary jaxserve.
                                    tokenizer_gguf builds from (BPE models only)
    vocab.json + merges.txt         GPT-2 style byte-level BPE
    none of them                    token ids only (vLLM's skip_tokenizer_init): token-id prompts
                                    work, outputs carry ids and no text, a text prompt or a chat
                                    is refused with an error naming the missing files

SentencePiece's ModelProto is parsed with a schema declared here (the fields read, by number,
as in sentencepiece_model.proto), so no sentencepiece package is needed.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from jaxserve.types import TokenizerError
from jaxserve.tokenizer_gguf import tokenizer_from_gguf_metadata

TOKENIZER_FILES = "tokenizer.json, tokenizer.model (SentencePiece) or vocab.json + merges.txt"
_SPM_BPE = 2  # TrainerSpec.ModelType: UNIGRAM = 1 (the proto default), BPE = 2, WORD = 3, CHAR = 4


def _spm_model_class():
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="jaxserve_spm_subset.proto", package="jaxserve_spm",
                                             syntax="proto2")

    def message(name, *fields):
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name, default in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
            if default is not None:
                f.default_value = default
        return m

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("Piece", ("piece", 1, F.TYPE_STRING, opt, None, None), ("score", 2, F.TYPE_FLOAT, opt, None, None),
            ("type", 3, F.TYPE_INT32, opt, None, "1"))  # an enum on the wire: varint; NORMAL = 1
    message("TrainerSpec", ("model_type", 3, F.TYPE_INT32, opt, None, "1"),
            ("byte_fallback", 35, F.TYPE_BOOL, opt, None, "false"),
            ("unk_id", 40, F.TYPE_INT32, opt, None, "0"), ("bos_id", 41, F.TYPE_INT32, opt, None, "1"),
            ("eos_id", 42, F.TYPE_INT32, opt, None, "2"), ("pad_id", 43, F.TYPE_INT32, opt, None, "-1"))
    message("NormalizerSpec", ("name", 1, F.TYPE_STRING, opt, None, None),
            ("add_dummy_prefix", 3, F.TYPE_BOOL, opt, None, "true"))
    message("ModelProto", ("pieces", 1, F.TYPE_MESSAGE, rep, ".jaxserve_spm.Piece", None),
            ("trainer_spec", 2, F.TYPE_MESSAGE, opt, ".jaxserve_spm.TrainerSpec", None),
            ("normalizer_spec", 3, F.TYPE_MESSAGE, opt, ".jaxserve_spm.NormalizerSpec", None))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("jaxserve_spm.ModelProto"))


SentencePieceModel = _spm_model_class()


def from_sentencepiece(path: Path) -> tuple[tokenizers.Tokenizer, dict]:
    """(the HF tokenizer, {"bos": id, "eos": id}) of a SentencePiece BPE tokenizer.model."""
    try:
        m = SentencePieceModel.FromString(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise TokenizerError(f"{path}: not a SentencePiece model ({type(e).__name__}: {e})") from None
    if not m.pieces:
        raise TokenizerError(f"{path}: a SentencePiece model with no pieces")
    if m.trainer_spec.model_type != _SPM_BPE:
        raise TokenizerError(f"{path}: SentencePiece model type {m.trainer_spec.model_type} is not supported "
                             f"(only BPE = 2, what Llama-family models use)")
    n = len(m.pieces)
    t = m.trainer_spec

    def special(i):
        return i if 0 <= i < n else None
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p.piece for p in m.pieces],
            "tokenizer.ggml.scores": [p.score for p in m.pieces],
            "tokenizer.ggml.token_type": [p.type for p in m.pieces],
            "tokenizer.ggml.add_space_prefix": m.normalizer_spec.add_dummy_prefix}
    for key, i in (("unknown", t.unk_id), ("bos", t.bos_id), ("eos", t.eos_id), ("padding", t.pad_id)):
        if special(i) is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = i
    try:
        hf = tokenizer_from_gguf_metadata(meta)
    except TokenizerError as e:
        raise TokenizerError(f"{path}: {e}") from None
    return hf, {"bos": special(t.bos_id), "eos": special(t.eos_id)}


def from_vocab_merges(vocab: Path, merges: Path, config: dict) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE from vocab.json + merges.txt; the special tokens that
    tokenizer_config.json declares (added_tokens_decoder) are matched whole."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    try:
        model = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise TokenizerError(f"{vocab.parent}: cannot load vocab.json + merges.txt: {e}") from None
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    added = config.get("added_tokens_decoder") or {}
    if isinstance(added, dict):
        toks = [AddedToken(v["content"], special=bool(v.get("special", True)), normalized=False)
                for _, v in sorted(added.items(), key=lambda kv: int(kv[0]))
                if isinstance(v, dict) and isinstance(v.get("content"), str)]
        hf.add_special_tokens([t for t in toks if t.special])
        hf.add_tokens([t for t in toks if not t.special])
    return hf


def ids_only_tokenizer(folder: Path, vocab_size: int) -> tokenizers.Tokenizer:
    """A stand-in for a folder with no tokenizer files: ids 0..vocab_size-1 exist, every id
    decodes to no text. jaxserve.tokenizer.Tokenizer refuses text through it (`ids_only`)."""
    from tokenizers import models
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise TokenizerError(f"{folder}: no tokenizer ({TOKENIZER_FILES}) and no vocab_size in config.json")
    hf = tokenizers.Tokenizer(models.WordLevel({f"<id:{i}>": i for i in range(vocab_size)}, unk_token="<id:0>"))
    return hf
