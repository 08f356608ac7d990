"""What a step that raises costs: only the requests it can blame, and the engine goes on.

    Engine.step -> runner.execute raises
      1. the plan is discarded (the scheduler is as before the step)
      2. blame: every request of the step is validated again, field by field, and its row of the
         step's arrays is built alone (`runner.check_row`): a request whose values do not fit
         (a range a validation missed) is to blame. None to blame -> every request of the step.
      3. the KV cache: a failed device call may have consumed the donated cache. If it is gone,
         a fresh one is made and every request in the engine fails (their KV went with it); if
         the device cannot even make one, the engine is broken (`EngineBroken`).
      4. each failed request ends with finish_reason "error", its error message and, if a field
         is to blame, that field (CompletionOutput.error / error_field); its pages are freed.
The engine counts faults in a row (`Engine.consecutive_step_faults`, reset by a step that runs);
the owner decides when a streak means the device is gone (the server: ServerConfig.
max_consecutive_step_faults, then liveness NOT_SERVING and `serve` exits non-zero).

`FaultInjectingRunner` wraps any Runner (engine/runner_protocol.py) and raises on chosen steps
or rows, for tests and `serve --fake-model --fake-fail-from-step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.engine.runner_protocol import Runner
from jaxserve.types import InvalidRequestError


class EngineBroken(RuntimeError):
    """The engine cannot go on (the device cannot even make a new KV cache): restart the process."""


@dataclasses.dataclass(frozen=True)
class Blame:
    message: str
    field: str | None = None


def blame_request(params, prompt_ids: Sequence[int], vocab_size: int, row_check: Callable[[], Any]
                  ) -> Blame | None:
    """Why this request cannot run, or None if nothing in it is wrong.

    Validates everything again (dataclasses.replace re-runs SamplingParams' checks), then builds
    the request's own row of the step arrays, which is where a value outside its dtype raises."""
    try:
        dataclasses.replace(params)
        params.check_vocab(vocab_size)
        bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} outside [0, {vocab_size})")
        row_check()
    except InvalidRequestError as e:
        return Blame(str(e), e.field)
    except Exception as e:  # noqa: BLE001 - any failure to build its own row blames the request
        return Blame(f"this request's values do not fit the step's arrays: {type(e).__name__}: {e}")
    return None


class FaultInjectingRunner:
    """Any Runner (engine/runner_protocol.py), raising `exc()` instead of stepping when
    `when(step, plan, rows)` is true.

    `step` counts calls to execute from 0. With `lose_cache`, the injected fault also drops the
    KV cache, as a failed device call that consumed the donated buffers would. Every other
    member of the protocol is the wrapped runner's; other attributes are read through to it."""

    def __init__(self, runner: Runner, when: Callable[[int, Any, Sequence[Any]], bool],
                 exc: Callable[[], BaseException] = lambda: RuntimeError("injected fault"),
                 lose_cache: bool = False):
        self.inner = runner
        self.when = when
        self.exc = exc
        self.lose_cache = lose_cache
        self.calls = 0
        self.injected = 0
        self.cache_lost = False

    def __getattr__(self, name):  # only for attributes not defined here: the wrapped runner's
        return getattr(self.inner, name)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.inner.buckets

    @property
    def mask_words(self) -> int:
        return self.inner.mask_words

    def warmup(self, progress: bool = True) -> float:
        return self.inner.warmup(progress)

    def bucket_for(self, num_tokens: int) -> int:
        return self.inner.bucket_for(num_tokens)

    def check_row(self, seq, row) -> None:
        self.inner.check_row(seq, row)

    def forget(self, seq_ids) -> None:
        self.inner.forget(seq_ids)

    def execute(self, plan, rows):
        step, self.calls = self.calls, self.calls + 1
        if self.when(step, plan, rows):
            self.injected += 1
            self.cache_lost = self.cache_lost or self.lose_cache
            raise self.exc()
        return self.inner.execute(plan, rows)

    def cache_intact(self) -> bool:
        return not self.cache_lost and self.inner.cache_intact()

    def reset_cache(self) -> None:
        self.inner.reset_cache()
        self.cache_lost = False
