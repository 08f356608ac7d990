"""Text <-> token ids for the engine: one `Tokenizer` for HF folders and GGUF files alike.

`Tokenizer` wraps an HF `tokenizers.Tokenizer` (Rust, fast) and adds what serving needs around
it: the special ids that end generation, the model's chat template rendered the way HF
transformers renders it (so prompts match what the model was trained on), input checks, and a
writer for an HF tokenizer folder (`jaxserve convert`). `IncrementalDetokenizer` turns a stream
of sampled ids into text deltas for streaming without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import functools
import json
import operator
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import tokenizers

from jaxserve import tokenizer_files as tf
from jaxserve.tokenizer_gguf import tokenizer_from_gguf_metadata
from jaxserve.types import TokenizerError  # noqa: F401  (declared with the other request errors)

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError", "with_bos"]


def with_bos(ids: Sequence[int], tokenizer: Any) -> list[int]:
    """The one BOS rule (`generate`, the engine, the server): BOS in front when the model's
    tokenizer adds one (HF tokenizer.json's post-processor, GGUF tokenizer.ggml.add_bos_token:
    `Tokenizer.add_bos_token`), and never twice (a chat template that renders `bos_token`
    already starts with it). SmolLM2's tokenizer adds none, so its prompts stay as they are."""
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer.add_bos_token and list(ids[:1]) != [bos]:
        return [bos, *ids]
    return list(ids)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as "text" or as {"content": "text", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    # config.json / generation_config.json hold one id, a list of ids, or null.
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _pick_chat_template(value: Any) -> str | None:
    # Some tokenizer_config.json files hold a list of named templates; "default" is the chat one.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _make_jinja_env() -> Any:
    """A sandboxed jinja2 environment set up like transformers' `_compile_jinja_template`.

    Same whitespace rules, `tojson` that does not HTML-escape, `raise_exception` and
    `strftime_now`, so templates written for HF render byte-identically here.
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """An HF `tokenizers.Tokenizer` plus the special ids and chat template serving needs."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
        ids_only: str | None = None,
    ) -> None:
        """`ids_only`: no tokenizer files were found (this says which were looked for); `hf` is
        a stand-in that knows the ids only, and text in or out is refused (skip_tokenizer_init)."""
        self._hf = hf
        self.ids_only = ids_only
        self._vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._bos = bos_token_id
        self._eos = tuple(dict.fromkeys(int(i) for i in eos_token_ids))  # dedupe, keep order
        self._pad = pad_token_id
        self._chat_template = chat_template
        self._compiled_template: Any = None
        self.model_max_length = model_max_length
        for name, tid in [("bos", bos_token_id), ("pad", pad_token_id)] + [("eos", i) for i in self._eos]:
            if tid is not None and not 0 <= tid < self._vocab_size:
                raise TokenizerError(
                    f"{name} token id {tid} is outside the vocabulary [0, {self._vocab_size})"
                )

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (else tokenizer.model, else vocab.json + merges.txt: see
        jaxserve/tokenizer_files.py), with special tokens and chat template from the JSON files
        beside it. A folder with none of them loads in token-ids-only mode."""
        folder = Path(path)
        tj = folder / "tokenizer.json"
        cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        spm = {}
        ids_only = None
        if tj.is_file():
            try:
                hf = tokenizers.Tokenizer.from_file(str(tj))
            except Exception as e:  # tokenizers raises a bare Exception on bad files
                raise TokenizerError(f"{tj}: cannot load: {e}") from None
        elif (folder / "tokenizer.model").is_file():
            hf, spm = tf.from_sentencepiece(folder / "tokenizer.model")
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            hf = tf.from_vocab_merges(folder / "vocab.json", folder / "merges.txt", cfg)
        else:
            ids_only = (f"{folder} has no tokenizer ({tf.TOKENIZER_FILES}): the model runs on token "
                        f"ids only; send prompt_token_ids")
            hf = tf.ids_only_tokenizer(folder, model_cfg.get("vocab_size"))
        gen = _read_json(folder / "generation_config.json")

        def id_of(key: str) -> int | None:
            text = _token_text(cfg.get(key))
            return hf.token_to_id(text) if text is not None else None

        bos = id_of("bos_token")
        if bos is None:
            bos = next(iter(_ids(gen.get("bos_token_id")) + _ids(model_cfg.get("bos_token_id"))
                            + _ids(spm.get("bos"))), None)
        # The tokenizer's eos first, then every id generation_config / config.json call an eos
        # (instruct models often end turns with a different token than the tokenizer's eos).
        eos = [i for i in [id_of("eos_token")] if i is not None]
        eos += _ids(gen.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id")) + _ids(spm.get("eos"))
        pad = id_of("pad_token")
        if pad is None:
            pad = next(iter(_ids(gen.get("pad_token_id"))), None)
        template = _pick_chat_template(cfg.get("chat_template"))
        jinja_file = folder / "chat_template.jinja"  # newer transformers save it beside the config
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        max_len = cfg.get("model_max_length")
        # transformers writes a huge sentinel (1e30) when the length is unknown.
        max_len = int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 else None
        return cls(hf, bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad, chat_template=template,
                   model_max_length=max_len, ids_only=ids_only)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`{key: field.contents()}` of a gguf.GGUFReader)."""
        hf = tokenizer_from_gguf_metadata(meta)
        # llama.cpp stops on eos and also on eot/eom (Llama 3 instruct's <|eot_id|>, <|eom_id|>).
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        arch = meta.get("general.architecture")
        ctx = meta.get(f"{arch}.context_length") if arch else None
        return cls(
            hf,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in eos if i is not None],
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            model_max_length=int(ctx) if ctx is not None else None,
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included); may be < the model's."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def _token_str(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._hf.id_to_token(token_id)

    @functools.cached_property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS (the post-processor's
        choice; asked once: every prompt's BOS rule reads it)."""
        ids = self._hf.encode("", add_special_tokens=True).ids
        return self._bos is not None and ids[:1] == [self._bos]

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in `text` (e.g. "<|im_start|>") map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if self.ids_only:
            raise TokenizerError(f"a text prompt needs a tokenizer: {self.ids_only}")
        # encode_batch releases the GIL while it works (encode holds it: a 1 MB prompt stalled
        # every other thread, the server's event loop included, for over a second).
        return self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def check_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as a list of ints, or ValueError naming the first id outside [0, vocab_size)."""
        out = [operator.index(i) for i in ids]
        for i in out:
            if not 0 <= i < self._vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self._vocab_size})")
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = self.check_ids(ids)
        if self.ids_only:
            return ""  # outputs carry their token ids; there is no text to give
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat template ------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's chat template, as transformers does (not tokenized).

        Extra keyword arguments (e.g. `tools`) are passed to the template as variables.
        """
        if self.ids_only:
            raise TokenizerError(f"a chat needs a tokenizer: {self.ids_only}")
        if self._chat_template is None:
            raise TokenizerError("this tokenizer has no chat template; send a raw prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _make_jinja_env().from_string(self._chat_template)
        variables = {
            "bos_token": self._token_str(self._bos) or "",
            "eos_token": self._token_str(self._eos[0] if self._eos else None) or "",
            "pad_token": self._token_str(self._pad) or "",
            **kwargs,
        }
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    # -- saving -------------------------------------------------------------------------------

    def save_hf_folder(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json loadable by transformers' AutoTokenizer.

        Only the first eos id fits tokenizer_config.json; the full list belongs in
        generation_config.json, which the checkpoint writer owns.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        if self.ids_only:
            return  # nothing to write: the copy runs on token ids only, as the source did
        self._hf.save(str(folder / "tokenizer.json"))
        specials = {
            "bos_token": self._token_str(self._bos),
            "eos_token": self._token_str(self._eos[0] if self._eos else None),
            "pad_token": self._token_str(self._pad),
        }
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{k: v for k, v in specials.items() if v is not None},
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            # Decoding must reproduce the text exactly; HF's clean-up would drop spaces.
            "clean_up_tokenization_spaces": False,
        }
        if self.model_max_length is not None:
            cfg["model_max_length"] = self.model_max_length
        if self._chat_template is not None:
            cfg["chat_template"] = self._chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")


class IncrementalDetokenizer:
    """Turns ids arriving one at a time into text deltas whose concatenation is `decode(all ids)`.

    Uses the prefix/read offset technique (as in TGI and vLLM): each step decodes only the ids
    from `prefix_offset` on, and returns what that window adds beyond the already-emitted text
    of `ids[prefix_offset:read_offset]`. Decoding a short window keeps each step O(1)-ish, and
    starting it a few tokens back lets context-dependent decoders (SentencePiece's leading-space
    strip) behave as in a full decode. A delta whose text ends in U+FFFD is held back: it is a
    multi-byte character whose remaining bytes are in tokens not yet seen.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()) -> None:
        """`context_ids` (e.g. the prompt) are decoded for context but never emitted."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = tokenizer.check_ids(context_ids)
        # A few context tokens are enough to decide spacing at the boundary.
        self._prefix_offset = max(0, len(self._ids) - 5)
        self._read_offset = len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one id; return the newly completed text ('' while a character is incomplete)."""
        self._ids.extend(self._tok.check_ids([token_id]))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self, drop_incomplete: bool = False) -> str:
        """Return whatever is held back (at the end of generation), even an incomplete character.

        `drop_incomplete`: the generation was cut (max_tokens, a full context), not ended by the
        model, so a character whose remaining bytes were never generated is left out instead of
        becoming U+FFFD; its bytes stay in the token ids. A model that ends (EOS) on such bytes
        produced invalid text, and keeps its U+FFFD."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text):
            return ""
        # Advance as `add` does, keeping a non-empty window so later ids still decode in context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        piece = new_text[len(prefix_text):]
        return piece.rstrip("\ufffd") if drop_incomplete else piece
