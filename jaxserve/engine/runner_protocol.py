"""What `Engine` asks of the thing that runs its steps: the seam between the host loop and a model.

`Engine(model, tokenizer, config, eos, runner=factory)` builds its runner with
`factory(scheduler_config)` (the engine sizes the page pool first, so the runner is told how
many pages to hold). Without a factory the engine builds the real `ModelRunner`
(engine/runner.py). The other implementations are the fake model's runner
(server/fake_engine.py: `serve --fake-model` and the server tests) and wrappers such as
engine/faults.py's `FaultInjectingRunner`, which take any Runner.

Nothing here imports jax: a runner may be pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jaxserve.config import SchedulerConfig
    from jaxserve.engine.runner import RowInfo, StepResult
    from jaxserve.scheduler.plan import ScheduledSeq, StepPlan


@runtime_checkable
class Runner(Protocol):
    """Everything `Engine` calls on its runner, and nothing more."""

    buckets: tuple[int, ...]  # the step sizes (tokens) compiled at warm-up, ascending
    mask_words: int  # int32 words of a structured-output token bitmask: ceil(vocab / 32)

    def warmup(self, progress: bool = True) -> float:
        """Prepare every bucket (compile); returns the seconds it took."""

    def bucket_for(self, num_tokens: int) -> int:
        """The bucket a step of `num_tokens` tokens runs in; ValueError past the largest."""

    def execute(self, plan: StepPlan, rows: Sequence[RowInfo]) -> StepResult:
        """Run one step. Raising is a step fault (engine/faults.py): the engine blames the
        requests whose `check_row` fails, or else the step's, and goes on."""

    def check_row(self, seq: ScheduledSeq, row: RowInfo) -> None:
        """Build one sequence's share of the step's inputs alone; raise where a value does not fit."""

    def cache_intact(self) -> bool:
        """False once a failed step consumed the KV cache."""

    def reset_cache(self) -> None:
        """A new, empty KV cache (every page's content is lost)."""

    def forget(self, seq_ids: Sequence[int]) -> None:
        """These sequences ended: drop any per-sequence state (the real runner keeps none)."""


RunnerFactory = Callable[["SchedulerConfig"], Runner]


def check_runner(runner: Any) -> Runner:
    """A factory's product must be a Runner: say which members are missing, not fail mid-step."""
    missing = [name for name in ("buckets", "mask_words", "warmup", "bucket_for", "execute", "check_row",
                                 "cache_intact", "reset_cache", "forget") if not hasattr(runner, name)]
    if missing:
        raise TypeError(f"runner {type(runner).__name__} lacks {missing} of the Runner protocol "
                        f"(jaxserve/engine/runner_protocol.py)")
    return runner
