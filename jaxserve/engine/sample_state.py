"""One sample stream's host state: its tokens, text, logprobs and finish, and the deltas it emits.

Stop strings are matched on the detokenized text, across token boundaries, and the text is cut
exactly before the stop string (vLLM's default: the stop string is not part of the output).
While the tail of the text could still grow into a stop string, that tail is held back from
the stream, so the joined deltas always equal the final text.
"""

from __future__ import annotations

from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.types import CompletionOutput, FinishReason, SamplingParams, StepOutput, TokenLogprob


class SampleState:
    def __init__(self, request_id: str, index: int, seq_id: int, seed: int, params: SamplingParams,
                 tokenizer: Tokenizer, prompt_ids: list[int]):
        self.request_id = request_id
        self.index = index
        self.seq_id = seq_id
        self.seed = seed
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of `text` already streamed
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.error = None  # engine/faults.py's Blame, with finish_reason ERROR
        self.stop_reason: int | str | None = None  # the stop string or stop token id that ended it
        self.matcher = None  # structured outputs: its llguidance matcher (engine/grammar.py)
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                             context_ids=prompt_ids[-8:])
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def restore(self, token_ids: list[int], text: str, emitted: int, logprobs) -> None:
        """Take up a sample another engine started (engine/handover.py): its tokens go through
        this detokenizer again, whose text must be the one handed over (the same tokenizer),
        and the first `emitted` characters count as streamed."""
        for t in token_ids:
            self.text += self._detok.add(t)
        if self.text != text:
            raise ValueError(f"request {self.request_id!r} sample {self.index}: its tokens detokenize to "
                             f"{self.text[:40]!r} here but to {text[:40]!r} on the engine that started it "
                             f"(another tokenizer?)")
        self.token_ids = list(token_ids)
        self.emitted = emitted
        if self.logprobs is not None:
            self.logprobs = list(logprobs or [])

    def append(self, token_id: int, result, slot: int, finish: FinishReason | None) -> StepOutput:
        """Add one sampled token (logit slot `slot` of the step result) and return its delta."""
        self.token_ids.append(token_id)
        new_lp = None
        if self.logprobs is not None:
            n = self.params.logprobs
            top = [(int(result.top_ids[slot, j]), float(result.top_logprobs[slot, j])) for j in range(n)]
            new_lp = [TokenLogprob(token_id, float(result.logprob[slot]), top)]
            self.logprobs.extend(new_lp)
        start = len(self.text)
        self.text += self._detok.add(token_id)
        if finish is not None:
            # A length cut may fall inside a multi-byte character: its bytes stay in token_ids,
            # the text leaves it out (no U+FFFD the model did not produce).
            self.text += self._detok.flush(drop_incomplete=finish == FinishReason.LENGTH)
        if finish == FinishReason.STOP and token_id in self.params.stop_token_ids:
            self.stop_reason = token_id
        if self.params.stop:
            found = self._find_stop(start)
            if found is not None:
                self.text = self.text[:found[0]]
                self.stop_reason = found[1]
                finish = FinishReason.STOP
        self.finish_reason = finish
        return self._delta([token_id], new_lp)

    def _find_stop(self, new_from: int) -> tuple[int, str] | None:
        """(earliest index where a stop string starts, that string), among matches touching the
        new text."""
        best = None
        for stop in self.params.stop:
            i = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _delta(self, token_ids, logprobs) -> StepOutput:
        end = len(self.text) if self.finish_reason is not None else max(self.emitted, len(self.text) - self._hold)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return StepOutput(self.request_id, self.index, token_ids, piece, logprobs, self.finish_reason is not None,
                          self.finish_reason.value if self.finish_reason is not None else None,
                          self.stop_reason if self.finish_reason is not None else None)

    def finish(self, reason: FinishReason) -> StepOutput:
        """End without a new token (abort, error): flush what was held back."""
        self.finish_reason = reason
        return self._delta([], None)

    def completion(self) -> CompletionOutput:
        cum = None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                self.finish_reason.value if self.finish_reason else None, self.logprobs,
                                self.error.message if self.error else None,
                                self.error.field if self.error else None,
                                stop_reason=self.stop_reason, cumulative_logprob=cum)
