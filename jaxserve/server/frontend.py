"""The asyncio side of every generation call: admission, tokenization, routing of engine events.

    handler ──submit(spec)──> Engine.check_request + the server's own checks (no I/O)
            -> queue reservation -> Engine.validate (thread pool: tokenize, BOS, lengths,
               context, pages) -> EngineLoop.submit -> Submission
    engine thread ──batch──> dispatch() (on the event loop) -> Submission.queue (one per request)
    handler ──stream(sub)──> batches of deltas, then the Finished event, or a ServingError
    handler finally ──close(sub)──> EngineLoop.abort if it had not ended (cancel, deadline,
                                    disconnect): the engine frees its pages before its next step

All of it runs on the event loop thread except tokenization, which goes to a small thread pool
so a 1 MB prompt never blocks other calls. Everything here is touched from that one thread, so
no locks; the QueueLimiter is shared with the engine thread and has its own.

Order of checks, cheapest first: the server is serving (UNAVAILABLE), the request's own fields
(INVALID_ARGUMENT, no I/O), room in the queue (RESOURCE_EXHAUSTED, before tokenizing), then the
token-level limits once tokenized (INVALID_ARGUMENT). A request that passes them all is
"accepted" and ends with exactly one terminal event: its Finished event (the handler's final
message), a Failed event (one non-OK status), or its cancellation by the caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc

from jaxserve.server.backpressure import QueueLimiter
from jaxserve.server.messages import RequestSpec
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.loop_events import EngineRequest, Failed, Finished, HandedOver
from jaxserve.server.metrics import ServerMetrics
from jaxserve.types import InvalidRequestError, StepOutput

log = logging.getLogger("jaxserve.server")


class ServingError(Exception):
    """Ends a call with a non-OK status; `field` names the request field for INVALID_ARGUMENT.
    `rejected`: refused before acceptance (counted as a rejection), not a failure of a request."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None,
                 rejected: bool = True):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.rejected = rejected

    @classmethod
    def invalid(cls, e: InvalidRequestError) -> "ServingError":
        return cls(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field)


class BoundedPool:
    """The thread pool a front door runs its blocking work on (rendering, tokenizing,
    detokenizing: never on the event loop), its backlog bounded: beyond `max_backlog` jobs
    waiting or running, a call is refused RESOURCE_EXHAUSTED at once instead of queueing without
    end. `refused(tenant)` counts a refusal (against the caller's tenant, as a full waiting
    queue's is)."""

    def __init__(self, executor: Executor, refused, name: str = "the tokenizer pool", max_backlog: int = 1024):
        self.executor = executor
        self.refused = refused
        self.name = name
        self.max_backlog = max_backlog
        self.jobs = 0  # handed to the pool and not yet done

    async def run(self, fn, *args, tenant: str):
        if self.jobs >= self.max_backlog:
            self.refused(tenant)
            raise ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name} is busy ({self.jobs} jobs); retry later")
        self.jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.jobs -= 1


class Submission:
    """One accepted request on the event loop: where its engine events arrive."""

    def __init__(self, request_id: str, spec: RequestSpec, prompt_tokens: int):
        self.request_id = request_id  # the server's id (the engine's)
        self.client_id = spec.request_id or request_id  # echoed to the caller
        self.spec = spec
        self.n = spec.params.n
        self.prompt_tokens = prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.outcome: str | None = None  # set once, by the terminal event
        # Tenant quotas (scheduler/quotas.py): reserved n * max_tokens output tokens, of which
        # `generated` were used; `started` once the first token came (no longer queued).
        self.quota_reserved = False
        self.generated = 0
        self.started = False
        self.doomed = False  # a Failed event from the server itself is queued (fail_all)


def engine_prompt(spec: RequestSpec):
    """The request's prompt in the form Engine.validate takes."""
    if spec.text is not None:
        return spec.text
    if spec.messages is not None:
        return spec.messages
    return {"prompt_token_ids": spec.token_ids}


class Frontend:
    quotas = None  # a scheduler.quotas.TenantQuotas when the server has tenant limits (app.py)

    def __init__(self, engine_loop: EngineLoop, limiter: QueueLimiter, metrics: ServerMetrics,
                 executor: Executor, unavailable_reason):
        engine = engine_loop.engine
        self.engine = engine
        self.engine_loop = engine_loop
        self.limiter = limiter
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.sched_config = engine.scheduler_config
        self.eos_token_ids = engine.eos_token_ids
        self.pool = BoundedPool(executor, lambda tenant: metrics.reject_tenant(tenant, "max_pool_backlog"))
        self._unavailable_reason = unavailable_reason  # () -> str | None, from the health state
        self._ids = itertools.count()
        self._live: dict[str, Submission] = {}  # server id -> accepted, not yet closed
        self._client_ids: set[str] = set()  # callers' ids in flight (unique while in flight)
        self.inflight = 0  # calls between the serving check and close (drain waits for 0)
        self.stats = {"accepted": 0, "terminal": 0, "tokenized": 0}

    @property
    def max_output_tokens(self) -> int:
        """The most tokens one sample may generate: what the shortest prompt leaves."""
        from jaxserve.engine import output_room
        return output_room(1, self.sched_config)

    @property
    def max_queued_samples(self) -> int:
        return self.limiter.max_samples

    # ---- admission -------------------------------------------------------------------------

    def check_serving(self) -> None:
        reason = self._unavailable_reason()
        if reason is not None:
            raise ServingError(grpc.StatusCode.UNAVAILABLE, reason)

    def _check_fields(self, spec: RequestSpec) -> None:
        """Limits decidable from the message alone, so nothing is reserved or tokenized for them:
        the engine's (Engine.check_request) and the server's own (queue size, ids in flight)."""
        self.engine.check_request(engine_prompt(spec), spec.params)
        if spec.params.n > self.limiter.max_samples:
            raise InvalidRequestError("n", f"{spec.params.n} samples can never fit the waiting queue "
                                           f"of {self.limiter.max_samples} (max_queued_requests)")
        if spec.request_id and spec.request_id in self._client_ids:
            raise InvalidRequestError("request_id", f"{spec.request_id!r} is already in flight")

    def _validate(self, spec: RequestSpec):
        """Engine.validate, the single request check (tokenizing included)."""
        return self.engine.validate(engine_prompt(spec), spec.params, add_bos=spec.add_bos,
                                    fill_context=spec.max_tokens_to_context)

    def _render_and_tokenize(self, spec: RequestSpec) -> tuple[str, list[int]]:
        """On a pool thread, for the Tokenize calls: the text and ids as a generation call with
        this prompt would run them (the BOS rule included)."""
        return self.engine.tokenize(engine_prompt(spec))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.engine.render_chat(messages)

    async def off_loop(self, fn, *args, tenant: str):
        """Run `fn(*args)` on the tokenizer pool for `tenant`'s call (BoundedPool: generation
        calls are bounded before this by the waiting queue; Tokenize and Detokenize by this
        alone)."""
        return await self.pool.run(fn, *args, tenant=tenant)

    async def tokenize(self, spec: RequestSpec) -> list[int]:
        return (await self.render_and_tokenize(spec))[1]

    async def render_and_tokenize(self, spec: RequestSpec) -> tuple[str, list[int]]:
        return await self.off_loop(self._render_and_tokenize, spec, tenant=spec.tenant)

    async def submit(self, spec: RequestSpec, hand_over: bool = False) -> Submission:
        """Admit `spec` or raise ServingError; the caller must `close()` what this returns.
        `hand_over` (prefill role): the request ends after its first token with HandedOver."""
        arrival = time.perf_counter()
        self.check_serving()
        try:
            self._check_fields(spec)
        except InvalidRequestError as e:
            raise ServingError.invalid(e) from None
        n = spec.params.n
        full = self.limiter.try_reserve(n)
        if full is not None:
            lim = self.limiter
            self.metrics.reject_tenant(spec.tenant, "max_queued_" + full)  # "requests" / "tokens"
            raise ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the waiting queue is full: {lim.queued_samples} of {lim.max_samples} "
                               f"samples (max_queued_requests) and {lim.queued_tokens} of "
                               f"{lim.max_tokens} prompt tokens (max_queued_tokens) are waiting; "
                               f"this request needs {n} sample(s). Retry later.")
        if spec.request_id:
            self._client_ids.add(spec.request_id)
        self.inflight += 1
        request_id = f"s{next(self._ids)}"
        tokens = 0
        try:
            if spec.token_ids is not None:  # nothing to tokenize: checked here, on the loop
                valid = self._validate(spec)
            else:
                try:
                    valid = await self.off_loop(self._validate, spec, tenant=spec.tenant)
                finally:  # counted here, on the loop; refused after tokenizing counts too
                    self.stats["tokenized"] += 1
            ids, spec.params = valid.prompt_ids, valid.params
            if len(ids) > self.limiter.max_tokens:
                raise InvalidRequestError("prompt", f"{len(ids)} tokens can never fit the waiting queue "
                                                    f"of {self.limiter.max_tokens} tokens (max_queued_tokens)")
            tokens = len(ids)
            self.limiter.add_tokens(tokens)
            self.check_serving()  # the server may have started draining while we tokenized
            self._reserve_quota(spec, len(ids))
        except BaseException as e:
            self.limiter.release(n, tokens)
            self._forget(spec)
            if isinstance(e, InvalidRequestError):
                raise ServingError.invalid(e) from None
            raise
        sub = Submission(request_id, spec, len(ids))
        sub.quota_reserved = self.quotas is not None
        self._live[request_id] = sub
        self.stats["accepted"] += 1
        self.metrics.prompt_tokens.inc(len(ids))
        self.engine_loop.submit(EngineRequest(request_id, ids, spec.params, spec.priority, arrival,
                                              n, tokens, tenant=spec.tenant, hand_over=hand_over))
        return sub

    def submit_handover(self, incoming, tenant: str) -> Submission:
        """Decode role: admit a request a prefill engine handed over (`incoming`: the kv_port's,
        its `handover` already read and checked). It waits in the queue's sample count until
        its KV has arrived and the engine runs it; the caller must `close()` what this returns."""
        self.check_serving()
        h = incoming.handover
        n = len(h.samples)
        full = self.limiter.try_reserve(n)
        if full is not None:
            self.metrics.reject_tenant(tenant, "max_queued_" + full)
            raise ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the waiting queue is full ({self.limiter.queued_samples} of "
                               f"{self.limiter.max_samples} samples); retry later")
        self.inflight += 1
        request_id = f"s{next(self._ids)}"
        incoming.handover = dataclasses.replace(h, request_id=request_id)  # this engine's own ids
        spec = RequestSpec(h.params, token_ids=list(h.prompt_ids), priority=h.priority, tenant=tenant)
        sub = Submission(request_id, spec, len(h.prompt_ids))
        self._live[request_id] = sub
        self.stats["accepted"] += 1
        self.engine_loop.submit(EngineRequest(request_id, list(h.prompt_ids), h.params, h.priority,
                                              time.perf_counter(), n, 0, tenant=tenant, incoming=incoming))
        return sub

    def _reserve_quota(self, spec: RequestSpec, prompt_tokens: int) -> None:
        """The tenant's limits (the last check: nothing reserved here needs undoing after it)."""
        if self.quotas is None:
            return
        refusal = self.quotas.check_and_reserve(spec.tenant, prompt_tokens, spec.params.max_tokens,
                                                spec.params.n)
        if refusal is not None:
            self.metrics.reject_tenant(spec.tenant, refusal.limit)
            if refusal.retry_after_s is None:  # can never pass: not a retry-later
                raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{refusal.limit}: {refusal.message}",
                                   refusal.limit)
            raise ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{refusal.limit}: {refusal.message} (retry after "
                               f"{refusal.retry_after_s:.1f} s)", refusal.limit)

    def _release_quota(self, sub: Submission) -> None:
        if self.quotas is not None and sub.quota_reserved:
            sub.quota_reserved = False
            unused = max(0, sub.n * sub.spec.params.max_tokens - sub.generated)
            self.quotas.ended(sub.spec.tenant, unused, was_queued=not sub.started)

    def _forget(self, spec: RequestSpec) -> None:
        self.inflight -= 1
        if spec.request_id:
            self._client_ids.discard(spec.request_id)

    # ---- results ---------------------------------------------------------------------------

    def dispatch(self, batch: list) -> None:
        """On the event loop: route one batch of engine events to their submissions."""
        for ev in batch:
            sub = self._live.get(ev.request_id)
            if isinstance(ev, StepOutput):
                self.metrics.generation_tokens.inc(len(ev.token_ids))
                if sub is not None and sub.quota_reserved:
                    sub.generated += len(ev.token_ids)
                    if not sub.started and ev.token_ids:
                        sub.started = True
                        self.quotas.started(sub.spec.tenant)
            elif isinstance(ev, Finished):
                self.metrics.observe_finished(ev.output)
            if sub is not None:
                sub.queue.put_nowait(ev)

    async def stream(self, sub: Submission) -> AsyncIterator[tuple[list[StepOutput], Finished | HandedOver | None]]:
        """Yield (deltas, finished) per batch until the request ends; a failure raises."""
        while True:
            batch = [await sub.queue.get()]
            while not sub.queue.empty():
                batch.append(sub.queue.get_nowait())
            failed = next((e for e in batch if isinstance(e, Failed)), None)
            if failed is not None:
                self._end(sub, failed.code.name.lower())
                raise ServingError(failed.code, failed.message, failed.field,
                                   rejected=failed.code == grpc.StatusCode.INVALID_ARGUMENT)
            deltas = [e for e in batch if isinstance(e, StepOutput)]
            # HandedOver (prefill role) ends the request here as Finished does.
            finished = next((e for e in batch if isinstance(e, (Finished, HandedOver))), None)
            if finished is not None:
                self._end(sub, "ok" if isinstance(finished, Finished) else "handed_over")
            yield deltas, finished
            if finished is not None:
                return

    def _end(self, sub: Submission, outcome: str) -> None:
        if sub.outcome is not None:
            raise AssertionError(f"request {sub.request_id} ended twice ({sub.outcome}, then {outcome})")
        sub.outcome = outcome
        self.stats["terminal"] += 1
        self.metrics.finished.labels(outcome).inc()

    def close(self, sub: Submission, left: str = "cancelled") -> None:
        """The handler is done with `sub`. Not ended = the caller left (`left`: "cancelled", or
        "deadline_exceeded" when its deadline passed): abort it in the engine."""
        if self._live.pop(sub.request_id, None) is None:
            return
        self._forget(sub.spec)
        self._release_quota(sub)
        if sub.outcome is None:
            self._end(sub, left)
            self.engine_loop.abort(sub.request_id)

    def fail_all(self, code: grpc.StatusCode, message: str) -> int:
        """End every live request with `code` (drain deadline, dead engine thread)."""
        n = 0
        for sub in list(self._live.values()):
            if sub.outcome is None and not sub.doomed:
                sub.doomed = True
                sub.queue.put_nowait(Failed(sub.request_id, code, message))
                self.engine_loop.abort(sub.request_id)
                n += 1
        return n

    @property
    def num_live(self) -> int:
        return len(self._live)
