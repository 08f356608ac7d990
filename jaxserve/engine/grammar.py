"""Structured outputs: llguidance grammars that give the sampler a per-row allowed-token bitmask.

Why llguidance (1.9.1) and not xgrammar: it is one self-contained wheel (no torch, no
transformers), builds its token trie from the tokenizer.json we already hold, and its mask
costs ~0.02 ms median / 0.12 ms mean per token on SmolLM2's 49,152-token vocabulary on the
2-core CI machine (scripts/bench_structured.py). xgrammar 0.2.8 requires torch.

The mask enters the compiled step as a fixed-shape input (`[S, ceil(V/32)]` int32 words, bit j
of word w = token 32w + j allowed), so no schema ever compiles anything; a step with no grammar
row passes one cached all-ones array and skips the masking (`has_mask` False).

Per sample: a matcher is made when the request is added (a grammar error is an
InvalidRequestError naming the field), its mask is filled before every step that samples the
row, and every token the row emits is consumed. Once the grammar is complete it allows only EOS,
so the sample ends with finish_reason "stop".
"""

from __future__ import annotations

import json
import re

import numpy as np

from jaxserve.types import InvalidRequestError, StructuredOutputsParams

FIELD = "structured_outputs"
# JSON as json.dumps writes it (", " and ": ", no other whitespace). llguidance's default allows
# any run of whitespace between tokens, and a model unsure how to go on then fills max_tokens
# with newlines; a schema's own "x-guidance" options still win.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """One per engine: the llguidance view of the tokenizer, built on first use (~0.4 s for
    SmolLM2), then a matcher per constrained sample."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll = None

    def _lltokenizer(self):
        if self._ll is None:
            import llguidance
            if not self._eos:
                raise InvalidRequestError(FIELD, "the model has no EOS token, so a grammar could "
                                                 "never end its output")
            self._ll = llguidance.LLTokenizer(self._tokenizer.hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self._eos)
        return self._ll

    @staticmethod
    def grammar(sop: StructuredOutputsParams) -> tuple[str, str]:
        """(llguidance grammar, the field to name in errors)."""
        import llguidance
        M = llguidance.LLMatcher
        try:
            if sop.json is not None:
                json.loads(sop.json)  # a clear error for text that is not JSON at all
                return M.grammar_from_json_schema(sop.json, defaults=JSON_STYLE), f"{FIELD}.json"
            if sop.json_object:
                return (M.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE),
                        f"{FIELD}.json_object")
            if sop.regex is not None:
                return M.grammar_from_regex(sop.regex), f"{FIELD}.regex"
            alts = "|".join(re.escape(c) for c in sop.choice)
            return M.grammar_from_regex(f"({alts})"), f"{FIELD}.choice"
        except (ValueError, TypeError) as e:
            field = next(f for f in ("json", "regex") if getattr(sop, f) is not None)
            raise InvalidRequestError(f"{FIELD}.{field}", f"not a valid grammar: {e}") from None

    @classmethod
    def check(cls, sop: StructuredOutputsParams) -> None:
        """Compile the grammar without a tokenizer (a front door's check before queuing, so a
        bad schema is refused up front rather than failing an accepted request)."""
        import llguidance
        grammar, field = cls.grammar(sop)
        err = llguidance.LLMatcher.validate_grammar(grammar)
        if err:
            raise InvalidRequestError(field, f"not a valid grammar: {err[:500]}")

    def matcher(self, sop: StructuredOutputsParams):
        import llguidance
        grammar, field = self.grammar(sop)
        try:
            m = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        except ValueError as e:
            raise InvalidRequestError(field, f"not a valid grammar: {str(e)[:500]}") from None
        if m.is_error():
            raise InvalidRequestError(field, f"not a valid grammar: {m.get_error()[:500]}")
        return m

    def fill(self, matcher, out: np.ndarray) -> None:
        """Write the matcher's allowed tokens into `out` (one row of int32 words, C-contiguous)."""
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)

    def draft_masks(self, matcher, draft, first: np.ndarray) -> tuple[np.ndarray, ...]:
        """The bitmask of each draft slot of a speculative run: the grammar's state after the
        drafts before it, on a copy of the matcher (`first`: its mask now, before draft 0).
        From the first draft the grammar refuses on, the slots repeat the last mask: that
        draft has probability 0 under the masked target, so the run stops there and the later
        slots are never read."""
        copy, mask, out, walking = None, first, [], True
        for tok in draft:
            if walking:
                ok = bool((mask.view(np.uint32)[tok // 32] >> np.uint32(tok % 32)) & 1)
                if ok:
                    copy = copy or matcher.deep_copy()
                    ok = bool(copy.consume_token(int(tok))) and not copy.is_error()
                if ok:
                    mask = np.empty_like(first)
                    self.fill(copy, mask)
                walking = ok
            out.append(mask)
        return tuple(out)
