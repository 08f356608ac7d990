"""The engine thread: the only thread that touches the `Engine`.

    asyncio thread                          engine thread (this module)
    --------------                          ---------------------------
    submit(EngineRequest) ──inbox──>  priority queue ──feed──> engine.add_request
    abort(request_id)     ──inbox──>  engine.abort_request (pages freed before the next step)
                                       engine.step() -> StepOutput deltas
    Frontend.dispatch(batch) <──call_soon_threadsafe── one batch of events per loop iteration

One iteration: drain the inbox (adds, aborts), feed the engine from the priority queue, run one
step, route its deltas, hand the batch to the asyncio thread. With nothing to do the thread
blocks on the inbox, so an idle server burns no CPU. An abort that arrives during a step is
handled right after it, so a cancelled request's pages are free before the next step.

Priority: requests wait here ordered by (priority, arrival) and are handed to the engine only
while its own waiting list is shorter than `feed_limit` (one step's worth of sequences), so the
engine always has enough to fill a step while the order of the rest is still ours to choose.
Under the scheduler's own policies (scheduling_policy="priority", fair_share) every request is
handed over at once: the scheduler's order (aging, tenant shares) is the one that counts.

Faults (jaxserve/engine/faults.py): a step that raises fails only the requests it can blame
(or, if none, the requests of that step): each ends with one Failed event (INVALID_ARGUMENT
naming the field when a field is to blame, else INTERNAL), its pages are free, and the engine
goes on with the rest and with new requests. Readiness is NOT_SERVING from the fault until a
step runs again or the engine is idle ("degraded", then "recovered"). Unrecoverable: a step
that fails `max_step_faults` times in a row, or an engine that cannot even make a new KV cache
(`EngineBroken`): every request ends INTERNAL, the loop reports "failed" (liveness NOT_SERVING,
`serve` exits non-zero so a supervisor restarts it) and answers later requests UNAVAILABLE. A bug
in this loop itself is reported the same way before the thread exits, so it never dies silently.

Disaggregated roles (jaxserve/disagg/, `serve --role`), through a `kv_port`:
    prefill  a request with `hand_over` runs to its first token; the engine exports it
             (engine/handover.py), the port offers its KV pages to a puller, and the request
             ends here with a HandedOver event carrying the port's ticket (what the router
             forwards to a decode engine).
    decode   a request with `incoming` (a handover and where its KV is) starts a pull on the
             port and waits beside the engine until the pages have arrived and the engine has
             room (NoRoomForHandover: retried each iteration); then it runs as any other. A pull
             that has not arrived, or found no room, within the port's timeout fails the request
             UNAVAILABLE, never the engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable

import grpc

from jaxserve.server.backpressure import QueueLimiter
from jaxserve.server.engine_gauges import EngineGauges
from jaxserve.server.loop_events import EngineRequest, Failed, Finished, HandedOver, LoopStatus
from jaxserve.types import InvalidRequestError

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass
class _Live:
    req: EngineRequest
    finished_samples: int = 0


class EngineLoop:
    def __init__(self, engine, limiter: QueueLimiter, sink: Callable[[list], None], *,
                 feed_limit: int | None = None, warmup: bool = True, progress: bool = True,
                 metrics=None, on_step: Callable[["EngineLoop"], None] | None = None,
                 max_step_faults: int = 3, kv_port=None):
        self.engine = engine
        self.kv_port = kv_port  # disaggregated roles only (module doc)
        self._pulls: dict[str, tuple[EngineRequest, Any]] = {}  # decode role: KV on its way
        self.limiter = limiter
        self._sink = sink
        self.feed_limit = feed_limit or engine.scheduler_config.max_num_seqs
        sc = engine.scheduler_config
        if feed_limit is None and (sc.fair_share or sc.scheduling_policy == "priority"):
            # The scheduler orders by tenant share / aged priority itself (scheduler/policy.py):
            # it must see every waiting request, or this queue's order would decide instead.
            self.feed_limit = 1 << 30
        self._do_warmup = warmup
        self._progress = progress
        self._metrics = metrics
        self.on_step = on_step  # tests: called on this thread after every step
        self.max_step_faults = max_step_faults  # faults in a row that mean the device is gone
        self.degraded = False  # a step fault since the last step that ran
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._heap: list[tuple[int, int, str]] = []
        self._order = itertools.count()
        self._waiting: dict[str, EngineRequest] = {}  # in the heap, not yet in the engine
        self._live: dict[str, _Live] = {}  # in the engine
        self._unscheduled: set[str] = set()  # in the engine, not yet scheduled (still queued)
        self._events: list[Any] = []
        self._paused = False
        self._gauges = None if metrics is None else EngineGauges(metrics)
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        # Read by other threads (single attribute reads are atomic under the GIL):
        self.warm = False
        self.failed: str | None = None
        self.steps = 0
        self.step_started_at: float | None = None  # time.monotonic() of the running step
        # (id, steps when the abort was asked, steps when done): the last few, for tests and logs.
        self.abort_log: collections.deque[tuple[str, int, int]] = collections.deque(maxlen=4096)

    # ---- any thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: EngineRequest) -> None:
        self._inbox.put(("add", req))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, self.steps))

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Forget the engine's cached prefixes between two steps; the future gets the number of
        cached pages freed (or the engine's exception)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("reset_prefix_cache", fut))
        return fut

    def pause(self) -> None:
        """Stop feeding and stepping (adds and aborts are still handled). Tests use it to hold
        the engine in a chosen phase; `on_step` may call it from the engine thread."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._inbox.put(("wake",))

    def stop(self, timeout: float | None = None) -> None:
        self._inbox.put(("stop",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting_here(self) -> int:
        """Requests queued here, not yet in the engine: waiting to be fed, or (decode role)
        waiting for their KV pages to arrive."""
        return len(self._waiting) + len(self._pulls)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._do_warmup:
                # A prefill or decode role also compiles the KV page read / write programs.
                # Only a prefill / decode engine is asked for the handover programs; the other
                # engines (multi-host leader, fault injector) keep warmup(progress).
                seconds = (self.engine.warmup(self._progress, handover=True) if self.kv_port is not None
                           else self.engine.warmup(self._progress))
                log.info("engine warm in %.1f s (buckets %s)", seconds, list(self.engine.runner.buckets))
            self.warm = True
            self._events.append(LoopStatus("warm"))
            self._flush()
            while self._drain_inbox():
                if not self._paused and self.failed is None:
                    if self._pulls:
                        self._admit_pulled()
                    self._feed()
                    if self.engine.has_unfinished():
                        self._step()
                    elif self.degraded:  # nothing left that could fail again
                        self.degraded = False
                        self._events.append(LoopStatus("recovered"))
                self._flush()
        except BaseException as e:  # a bug here must still end every request and flip health
            self._fail(f"engine thread died: {type(e).__name__}: {e}", traceback.format_exc())
            self._flush()

    def _has_work(self) -> bool:
        return bool(self._waiting) or self.engine.has_unfinished()

    _PULL_POLL_S = 0.002  # how often an otherwise idle loop looks at the pulls in flight

    def _drain_inbox(self) -> bool:
        """Handle every message; block for one first when there is nothing else to do.
        False once asked to stop."""
        # A degraded loop goes round once more without waiting, to see whether it has recovered.
        block = self._paused or self.failed is not None or not (self._has_work() or self.degraded)
        while True:
            try:
                if not block:
                    msg = self._inbox.get_nowait()
                elif self._pulls and not self._paused:  # KV on its way: look again soon
                    msg = self._inbox.get(timeout=self._PULL_POLL_S)
                else:
                    msg = self._inbox.get()
            except queue.Empty:
                return True
            block = False
            kind = msg[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._on_add(msg[1])
            elif kind == "abort":
                self._on_abort(msg[1], msg[2])
            elif kind == "reset_prefix_cache":
                fut = msg[1]
                try:
                    fut.set_result(self.engine.reset_prefix_cache())
                except Exception as e:
                    fut.set_exception(e)
                self._update_gauges()

    def _on_add(self, req: EngineRequest) -> None:
        if self.failed is not None:
            self._release(req)
            self._events.append(Failed(req.request_id, grpc.StatusCode.UNAVAILABLE,
                                       f"the engine failed ({self.failed}); restart the server"))
            return
        if req.incoming is not None:  # decode role: the KV comes from a prefill engine
            try:
                self._pulls[req.request_id] = (req, self.kv_port.pull(self.engine, req.incoming))
            except Exception as e:
                log.exception("starting the KV pull of %s failed", req.request_id)
                self._release(req)
                self._events.append(Failed(req.request_id, grpc.StatusCode.UNAVAILABLE,
                                           f"the KV transfer could not start: {type(e).__name__}: {e}"))
            return
        self._waiting[req.request_id] = req
        heapq.heappush(self._heap, (req.priority, next(self._order), req.request_id))
        self._update_gauges()

    def _on_abort(self, request_id: str, steps_at_request: int) -> None:
        req = self._waiting.pop(request_id, None)
        pulling = self._pulls.pop(request_id, None)
        if pulling is not None:
            self._release(pulling[0])  # its KV, if it still comes, is dropped with the pull
        elif req is not None:
            self._release(req)  # its heap entry is skipped when it comes up
        else:
            live = self._live.pop(request_id, None)
            if live is not None:
                self.engine.abort_request(request_id)  # frees its pages now
                self.engine.pop_finished(request_id)
                self._unscheduled.discard(request_id)
                self._release(live.req)
        self.abort_log.append((request_id, steps_at_request, self.steps))
        self._update_gauges()

    def _feed(self) -> None:
        sched = self.engine.scheduler
        while self._heap and sched.num_waiting < self.feed_limit:
            _, _, rid = heapq.heappop(self._heap)
            req = self._waiting.pop(rid, None)
            if req is None:
                continue  # aborted while waiting here
            if self.slo is not None and self._slo_refused(rid, req):
                continue
            try:
                # hand_over only when asked: the multi-host leader's add_request has no such word.
                extra = {"hand_over": True} if req.hand_over else {}
                self.engine.add_request({"prompt_token_ids": req.prompt_ids}, req.params,
                                        request_id=rid, arrival_time=req.arrival,
                                        priority=req.priority, tenant=req.tenant, **extra)
            except InvalidRequestError as e:
                # The server checks these before queuing; the engine's own check is the last word.
                self._release(req)
                self._events.append(Failed(rid, grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field))
            except Exception as e:  # add_request allocates nothing before it can fail
                log.exception("engine.add_request failed for %s", rid)
                self._release(req)
                self._events.append(Failed(rid, grpc.StatusCode.INTERNAL,
                                           f"engine could not add the request: {type(e).__name__}: {e}"))
            else:
                self._live[rid] = _Live(req)
                self._unscheduled.add(rid)

    slo = None  # a scheduler.slo.SloAdmission when the server has --slo-ttft-ms (app.py)

    def _slo_refused(self, rid: str, req: EngineRequest) -> bool:
        refusal = self.slo.refusal(self.engine.scheduler, len(req.prompt_ids),
                                   time.perf_counter() - req.arrival)
        if refusal is None:
            return False
        self._release(req)
        self._events.append(Failed(rid, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal[0], "slo_ttft_ms"))
        if self._metrics is not None:
            self._metrics.rejections.labels("slo_ttft").inc()
            self._metrics.reject_tenant(req.tenant, "slo_ttft_ms")
        return True

    def _step(self) -> None:
        t0 = time.perf_counter()
        tokens0 = self.engine.stats["computed_tokens"]
        self.step_started_at = time.monotonic()
        faults_before = self.engine.stats.get("step_faults", 0)
        try:
            outputs = self.engine.step()
        except Exception as e:  # EngineBroken, or a bug outside the runner call
            self.step_started_at = None
            self._fail(f"engine step failed: {type(e).__name__}: {e}", traceback.format_exc())
            return
        self.step_started_at = None
        self.steps += 1
        engine = self.engine
        faulted = engine.stats.get("step_faults", 0) != faults_before
        for d in outputs:
            live = self._live.get(d.request_id)
            if live is None:
                continue  # the ABORT delta of a request the client already left
            if d.finish_reason == "error":
                self._fail_request(d.request_id, live)
                continue
            self._events.append(d)
            if d.finished:
                live.finished_samples += 1
                if live.finished_samples == live.req.params.n:
                    del self._live[d.request_id]
                    self._unscheduled.discard(d.request_id)
                    self._release(live.req)
                    self._events.append(Finished(d.request_id, engine.pop_finished(d.request_id)))
        if engine.handovers:
            self._hand_over_exported()
        for rid in list(self._unscheduled):
            state = engine.get_request(rid)
            if state is None or state.metrics.first_scheduled_time is not None:
                self._unscheduled.discard(rid)
                self._release(self._live[rid].req)
        if self.slo is not None:
            self.slo.observe_step(self.engine.stats["computed_tokens"] - tokens0, time.perf_counter() - t0)
            self.slo.size_steps(self.engine.scheduler)
        if self._metrics is not None:
            self._metrics.step_seconds.observe(time.perf_counter() - t0)
        self._update_gauges()
        if faulted:
            in_a_row = engine.consecutive_step_faults
            if in_a_row >= self.max_step_faults:
                self._fail(f"the engine step failed {in_a_row} times in a row (last: "
                           f"{engine.last_step_fault}); the device is not usable", "")
                return
            if not self.degraded:
                self.degraded = True
                self._events.append(LoopStatus("degraded", engine.last_step_fault or ""))
        elif self.degraded:
            self.degraded = False
            self._events.append(LoopStatus("recovered"))
        if self.on_step is not None:
            self.on_step(self)

    def _admit_pulled(self) -> None:
        """Decode role: import every handover whose KV has arrived, while the engine has room."""
        from jaxserve.engine import HandoverRefused, NoRoomForHandover
        for rid, (req, pull) in list(self._pulls.items()):
            arrived = pull.ready()
            if arrived:
                h = req.incoming.handover
                try:
                    self.engine.import_request(h, pull.data, arrival_time=req.arrival)
                except NoRoomForHandover as e:
                    if not pull.expired():
                        continue  # running sequences will finish and free room; try next time
                    why = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"the decode engine had no room for the "
                           f"handover within {pull.timeout_s:g} s: {e}", None)
                except HandoverRefused as e:
                    why = (grpc.StatusCode.FAILED_PRECONDITION, str(e), None)
                except InvalidRequestError as e:
                    why = (grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field)
                except Exception as e:
                    log.exception("importing the handover of %s failed", rid)
                    why = (grpc.StatusCode.INTERNAL, f"importing the handover failed: {type(e).__name__}: {e}",
                           None)
                else:
                    del self._pulls[rid]
                    # Samples that finished on the prefill engine did not come: count them done.
                    self._live[rid] = _Live(req, finished_samples=req.params.n - len(h.samples))
                    self._release(req)  # running now, no longer queued
                    if self._metrics is not None:
                        self._metrics.observe_kv_pull(pull.seconds, pull.nbytes)
                    continue
            elif not pull.expired():
                continue
            else:
                why = (grpc.StatusCode.UNAVAILABLE, pull.timeout_message(), None)
            del self._pulls[rid]
            self._release(req)
            if self._metrics is not None:
                self._metrics.handover_failures.labels("decode", why[0].name.lower()).inc()
            self._events.append(Failed(rid, *why))

    def _hand_over_exported(self) -> None:
        """Prefill role: offer each exported request's KV on the port; the request ends here."""
        for rid in list(self.engine.handovers):
            h, data = self.engine.pop_handover(rid)
            live = self._live.pop(rid, None)
            self._unscheduled.discard(rid)
            if live is None:
                continue  # aborted meanwhile: nothing waits for it
            self._release(live.req)
            try:
                ticket = self.kv_port.offer(h, data)
            except Exception as e:
                log.exception("offering the KV of %s failed", rid)
                if self._metrics is not None:
                    self._metrics.handover_failures.labels("prefill", "internal").inc()
                self._events.append(Failed(rid, grpc.StatusCode.INTERNAL,
                                           f"offering the KV pages failed: {type(e).__name__}: {e}"))
                continue
            if self._metrics is not None:
                self._metrics.handover_bytes.labels("prefill").observe(h.kv_bytes)
            self._events.append(HandedOver(rid, ticket))

    def _fail_request(self, rid: str, live: _Live) -> None:
        """The engine ended this request with an error (engine/faults.py): one Failed event."""
        del self._live[rid]
        self._unscheduled.discard(rid)
        self._release(live.req)
        out = self.engine.pop_finished(rid)
        err = next((c for c in out.outputs if c.error), None) if out is not None else None
        message = err.error if err is not None else "the engine step failed"
        field = err.error_field if err is not None else None
        code = grpc.StatusCode.INVALID_ARGUMENT if field else grpc.StatusCode.INTERNAL
        self._events.append(Failed(rid, code, message, field))

    def _release(self, req: EngineRequest) -> None:
        if not req.released:
            req.released = True
            self.limiter.release(req.reserved_samples, req.reserved_tokens)

    def _fail(self, reason: str, tb: str) -> None:
        log.error("%s\n%s", reason, tb)
        self.failed = reason
        pulling = [(k, v[0]) for k, v in self._pulls.items()]
        for rid, req in list(self._waiting.items()) + [(k, v.req) for k, v in self._live.items()] + pulling:
            self._release(req)
            self._events.append(Failed(rid, grpc.StatusCode.INTERNAL, reason))
        self._waiting.clear()
        self._pulls.clear()
        self._heap.clear()
        self._live.clear()
        self._unscheduled.clear()
        try:  # best effort: give the pages back so the bookkeeping stays sane for inspection
            self.engine.abort_all()
        except Exception:
            log.exception("cleaning up after the engine fault failed")
        self._events.append(LoopStatus("failed", reason))

    def _flush(self) -> None:
        if self._events:
            batch, self._events = self._events, []
            self._sink(batch)

    def _update_gauges(self) -> None:
        if self._gauges is not None:
            self._gauges.update(self.engine, len(self._waiting))
