"""The bounded waiting queue: how many samples and prompt tokens may wait to run.

"Waiting" = accepted by the server and not yet scheduled by the engine (in the server's
priority queue or in the scheduler's waiting list). The asyncio thread reserves, the engine
thread releases (when the engine first schedules a request, or when it ends before that), so
the counters sit behind a lock.

The rule (docs for users are in generation.proto):
  - before tokenizing: refuse (RESOURCE_EXHAUSTED) if queued samples + n > max_queued_requests,
    or if the queued prompt tokens already reach max_queued_tokens. n samples are reserved
    together, so a request with n > 1 is admitted all or nothing.
  - after tokenizing: the request's exact prompt tokens are added. The token bound is thus
    checked before the count is known, and can be passed by the requests being tokenized at
    that moment (at most tokenizer_threads + the in-flight handlers' prompts) - never by more.
  - a request that could never fit (n > max_queued_requests, or more prompt tokens than
    max_queued_tokens) is an INVALID_ARGUMENT, not a RESOURCE_EXHAUSTED to retry forever.
"""

from __future__ import annotations

import threading


class QueueLimiter:
    def __init__(self, max_samples: int, max_tokens: int):
        self.max_samples = max_samples
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._samples = 0
        self._tokens = 0

    def try_reserve(self, n: int) -> str | None:
        """Reserve `n` sample slots; None on success, else why not ("requests" or "tokens")."""
        with self._lock:
            if self._samples + n > self.max_samples:
                return "requests"
            if self._tokens >= self.max_tokens:
                return "tokens"
            self._samples += n
            return None

    def add_tokens(self, tokens: int) -> None:
        with self._lock:
            self._tokens += tokens

    def release(self, n: int, tokens: int) -> None:
        with self._lock:
            self._samples -= n
            self._tokens -= tokens
            if self._samples < 0 or self._tokens < 0:
                raise AssertionError(f"queue counters went negative ({self._samples} samples, "
                                     f"{self._tokens} tokens): a reservation was released twice")

    @property
    def queued_samples(self) -> int:
        return self._samples

    @property
    def queued_tokens(self) -> int:
        return self._tokens
