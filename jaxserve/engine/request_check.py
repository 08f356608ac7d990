"""The one request check: a prompt and its SamplingParams, refused with an InvalidRequestError
naming the field and the limit, or turned into the token ids the engine will run.

    check_prompt        the prompt's form and size, no tokenizing (cheap: the server runs it
                        before it reserves room in its queue)
    tokenize            render chat messages through the model's template, encode, BOS rule
    fill_context        max_tokens = what the context has left (OpenAI chat without max_tokens)
    scheduler admission the token-level limits: max_prompt_len, max_output_len, max_model_len,
                        the KV pool (scheduler/admission.py)

`Engine.validate` runs them in that order; `Engine.add_request` and the server's frontend both
go through it, so an offline caller and a server client meet the same limits and messages.
Everything here reads fixed configuration only, so it may run on any thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import SchedulerConfig
from jaxserve.tokenizer import Tokenizer, with_bos
from jaxserve.types import MAX_PROMPT_CHARS, InvalidRequestError, SamplingParams, TokenizerError

PROMPT_FORMS = "a string, a list of chat messages or {'prompt_token_ids': [...]}"


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    text: str | None  # the prompt text, or the rendered chat; None for token ids
    prompt_ids: list[int]  # what the engine runs, BOS included where the model wants it
    params: SamplingParams  # the caller's, with max_tokens filled in if asked to


def _is_int(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def check_prompt(prompt: Any, vocab_size: int, max_prompt_len: int) -> None:
    """Limits decidable from the prompt alone. Characters count what the server counts: the
    text, or every message's role and content."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError("prompt", f"{len(prompt)} characters exceeds the limit of "
                                                f"{MAX_PROMPT_CHARS} (checked before tokenizing)")
    elif isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        # Length before content: a huge list is refused without walking it.
        if len(ids) > max_prompt_len:
            raise InvalidRequestError("prompt_token_ids", f"{len(ids)} tokens is more than "
                                                          f"max_prompt_len={max_prompt_len}")
        bad = next((t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)), None)
        if bad is not None:
            if not _is_int(bad):
                raise InvalidRequestError("prompt_token_ids", f"must be a list of integers, got {bad!r:.40}")
            # Checked on the host: on device an out-of-range id gathers garbage, a negative wraps.
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} outside [0, {vocab_size})")
    elif isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("messages", "must hold at least one message")
        chars = 0
        for i, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise InvalidRequestError(f"messages[{i}]", "each message needs string 'role' and 'content'")
            chars += len(m["role"]) + len(m["content"])
        if chars > MAX_PROMPT_CHARS:
            raise InvalidRequestError("messages", f"{chars} characters of roles and content exceeds "
                                                  f"the limit of {MAX_PROMPT_CHARS}")
    else:
        raise InvalidRequestError("prompt", f"must be {PROMPT_FORMS}, got {type(prompt).__name__}")


def check_params(params: Any, vocab_size: int) -> None:
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
    params.check_vocab(vocab_size)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # the template is fixed, so what it refuses is the messages
        raise InvalidRequestError("messages", f"the model's chat template refused them: {e}") from None


def tokenize(prompt: Any, tokenizer: Tokenizer, add_bos: bool | None = None) -> tuple[str | None, list[int]]:
    """(text, ids) of a prompt `check_prompt` accepted. `add_bos`: None = the model's rule for
    text and chat (tokenizer.with_bos), never for token ids (the caller's ids are what runs);
    True / False = apply the rule / not, whatever the form (JetStream's has_bos)."""
    if isinstance(prompt, dict):
        ids = list(prompt["prompt_token_ids"])
        return None, with_bos(ids, tokenizer) if add_bos else ids
    field = "prompt" if isinstance(prompt, str) else "messages"
    text = prompt if isinstance(prompt, str) else render_chat(tokenizer, prompt)
    try:
        ids = tokenizer.encode(text) if text else []
    except TokenizerError as e:  # a model served on token ids only (no tokenizer files)
        raise InvalidRequestError(field, str(e)) from None
    return text, with_bos(ids, tokenizer) if add_bos is not False else ids


def output_room(prompt_tokens: int, sc: SchedulerConfig) -> int:
    """The most tokens a prompt of `prompt_tokens` leaves (at least 1, so a prompt that fills the
    context is refused by admission naming the limit)."""
    # A sample holds prompt + max_tokens - 1 tokens of KV (admission.py), in whole pages.
    fits_cache = sc.num_usable_pages * sc.page_size - prompt_tokens + 1
    return max(1, min(sc.max_output_len, sc.max_model_len - prompt_tokens, fits_cache))


def fill_context(params: SamplingParams, prompt_tokens: int, sc: SchedulerConfig) -> SamplingParams:
    """max_tokens = what the context leaves after the prompt (`output_room`)."""
    return dataclasses.replace(params, max_tokens=output_room(prompt_tokens, sc))
