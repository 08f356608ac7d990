"""Rebuild an HF `tokenizers.Tokenizer` from the tokenizer metadata stored in a GGUF file.

A GGUF file carries its vocabulary as plain lists (`tokenizer.ggml.tokens`, `.merges`, `.scores`,
`.token_type`) plus a label (`tokenizer.ggml.pre`) naming the pre-tokenizer llama.cpp compiled in.
We rebuild the same pipeline HF's own tokenizer.json describes for that family, so GGUF and HF
checkpoints of one model encode identically and `jaxserve convert` can write a tokenizer.json.

Supported:
  * `gpt2` (byte-level BPE) with `tokenizer.ggml.pre` in `_BYTE_LEVEL_PRE`;
  * `llama` (SentencePiece BPE with byte fallback: Llama 2, TinyLlama, Mistral v0.1), built the
    way transformers' LlamaConverter builds it (merges derived from vocab and scores).
Anything else raises TokenizerError (a ValueError): a wrong tokenizer gives fluent nonsense, so
there is no silent fallback.

It lives with the tokenizer, not in checkpoints/: it reads no file, only the metadata dict the
GGUF reader (checkpoints/gguf_loader.py) hands over, so the tokenizer never imports checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from jaxserve.types import TokenizerError

# GGUF token types (gguf.TokenType / llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Split regexes copied from the models' published tokenizer.json files (the originals, not
# llama.cpp's rewrites without `(?i:)`), checked against Meta-Llama-3-8B and Qwen2 tokenizer.json.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_smollm() -> tuple[Any, Any]:
    # SmolLM/SmolLM2 tokenizer.json: one token per digit, then GPT-2's byte-level regex.
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return None, pre


def _pre_llama3() -> tuple[Any, Any]:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    return None, pre


def _pre_qwen2() -> tuple[Any, Any]:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    return normalizers.NFC(), pre  # Qwen2's tokenizer.json normalizes to NFC first.


def _pre_gpt2() -> tuple[Any, Any]:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


# tokenizer.ggml.pre -> (builder of (normalizer, pre_tokenizer), BPE ignore_merges, default add_bos).
# ignore_merges and the add_bos defaults follow llama.cpp's llama-vocab.cpp for each label.
# "default" is deliberately absent: llama.cpp uses it for *unrecognised* tokenizers and applies
# its own ad-hoc regex set, so no HF tokenizer is known to match it.
_BYTE_LEVEL_PRE: dict[str, tuple[Callable[[], tuple[Any, Any]], bool, bool]] = {
    "smollm": (_pre_smollm, False, False),
    "llama-bpe": (_pre_llama3, True, True),
    "qwen2": (_pre_qwen2, False, False),
    "gpt2": (_pre_gpt2, False, False),
    "gpt-2": (_pre_gpt2, False, False),  # the spelling llama.cpp's converter writes
}
SUPPORTED_MODELS = ("gpt2", "llama")


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise TokenizerError(f"GGUF metadata has no {key!r}; cannot build the tokenizer")
    return meta[key]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            # An HF vocab maps strings to one id; a duplicate would make one id undecodable.
            raise TokenizerError(f"tokenizer.ggml.tokens: {tok!r} appears at ids {vocab[tok]} and {i}")
        vocab[tok] = i
    return vocab


def _add_tokens(tok: Tokenizer, meta: dict[str, Any], tokens: list[str]) -> None:
    """Control (and unknown) tokens become special AddedTokens; user-defined ones non-special.

    Both are matched whole in input text. Only special ones are dropped by
    `decode(skip_special_tokens=True)`, as in HF, where e.g. Qwen's `<tool_call>` is non-special
    and must survive decoding. llama.cpp's converter writes HF special tokens as CONTROL.
    """
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return
    if len(types) != len(tokens):
        raise TokenizerError(
            f"tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has "
            f"{len(tokens)}"
        )
    pairs = list(zip(tokens, types))
    special = [AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == _USER_DEFINED]
    tok.add_special_tokens(special)  # add_special_tokens marks everything it gets as special
    tok.add_tokens(user)


def _token_id(meta: dict[str, Any], key: str, n_vocab: int) -> int | None:
    tid = meta.get(key)
    if tid is None:
        return None
    if not 0 <= int(tid) < n_vocab:
        raise TokenizerError(f"{key} = {tid} is outside the vocabulary [0, {n_vocab})")
    return int(tid)


def _post_processor(meta: dict[str, Any], tokens: list[str], default_add_bos: bool) -> Any:
    """TemplateProcessing adding BOS/EOS only when the GGUF asks for it (what llama.cpp does)."""
    wanted = {
        "bos": bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        "eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    added: dict[str, str] = {}  # "bos"/"eos" -> token text
    specials: dict[str, int] = {}
    for which, flag in wanted.items():
        if flag:
            key = f"tokenizer.ggml.{which}_token_id"
            tid = _token_id(meta, key, len(tokens))
            if tid is None:
                raise TokenizerError(f"tokenizer.ggml.add_{which}_token is true but {key} is missing")
            added[which] = tokens[tid]
            specials[tokens[tid]] = tid
    if not specials:
        return None

    def seq(name: str, type_id: int) -> list[str]:
        head = [f"{added['bos']}:{type_id}"] if "bos" in added else []
        tail = [f"{added['eos']}:{type_id}"] if "eos" in added else []
        return [*head, f"${name}:{type_id}", *tail]

    return processors.TemplateProcessing(
        single=seq("A", 0), pair=seq("A", 0) + seq("B", 1), special_tokens=list(specials.items())
    )


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    pre = _require(meta, "tokenizer.ggml.pre")
    if pre not in _BYTE_LEVEL_PRE:
        raise TokenizerError(
            f"tokenizer.ggml.pre = {pre!r} is not supported for tokenizer.ggml.model = 'gpt2'; "
            f"supported: {sorted(_BYTE_LEVEL_PRE)}"
        )
    build_pre, ignore_merges, default_add_bos = _BYTE_LEVEL_PRE[pre]
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    merges = []
    for m in _require(meta, "tokenizer.ggml.merges"):
        left, sep, right = m.partition(" ")  # byte-level tokens never contain a raw space
        if not sep or not left or not right:
            raise TokenizerError(f"tokenizer.ggml.merges: malformed entry {m!r} (expected 'a b')")
        merges.append((left, right))
    try:
        model = models.BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=ignore_merges)
    except Exception as e:  # tokenizers raises a bare Exception for merges outside the vocab
        raise TokenizerError(f"GGUF BPE vocabulary is inconsistent: {e}") from None
    tok = Tokenizer(model)
    normalizer, pre_tokenizer = build_pre()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, meta, tokens)
    post = _post_processor(meta, tokens, default_add_bos)
    if post is not None:
        tok.post_processor = post
    return tok


def _spm_merges(vocab: dict[str, int], scores: list[float], tokens: list[str]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary, as transformers' `generate_merges` does.

    Every split of a piece into two in-vocab pieces is a merge ranked by the piece's score
    (higher first); ties go to longer left, then longer right parts, as in transformers.
    """
    merges = []
    for piece, score in zip(tokens, scores):
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)  # stable, like sorted()
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    scores = [float(s) for s in _require(meta, "tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise TokenizerError(
            f"tokenizer.ggml.scores has {len(scores)} entries but tokenizer.ggml.tokens has {len(tokens)}"
        )
    vocab = _vocab(tokens)
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(vocab, scores, tokens),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,  # characters outside the vocab become <0xNN> byte tokens
    )
    tok = Tokenizer(model)
    # llama.cpp defaults add_space_prefix to true for SentencePiece vocabularies.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # The "legacy" HF Llama pipeline (what Llama 2's tokenizer.json holds): spaces become "▁",
    # and a "▁" is prepended to the text; the decoder undoes both.
    steps = [normalizers.Replace(" ", "▁")]
    if prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    _add_tokens(tok, meta, tokens)
    post = _post_processor(meta, tokens, default_add_bos=True)  # llama.cpp's default for SPM
    if post is not None:
        tok.post_processor = post
    return tok


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """Build the HF tokenizer described by GGUF metadata (`{key: field.contents()}`)."""
    model = _require(meta, "tokenizer.ggml.model")
    if model == "gpt2":
        return _byte_level_bpe(meta)
    if model == "llama":
        return _sentencepiece_bpe(meta)
    raise TokenizerError(
        f"tokenizer.ggml.model = {model!r} is not supported; supported: {list(SUPPORTED_MODELS)}"
    )
