"""One jaxserve Engine driven by a thread of its own, fed from other threads: continuous
batching under Ray's concurrent batch calls.

Ray Data calls the stage's async `__call__` for several batches at once (max_concurrency); each
call hands its rows to `submit` and awaits their futures. This thread is the only one that
touches the engine: it adds whatever has arrived, runs one step, resolves the futures of the
requests that finished, and repeats, so rows of every batch in flight share each step and a
batch that finishes early is replaced by Ray's next one without draining the engine.

A step that raises fails every request in the engine (their futures raise, so Ray Data fails or
retries those batches as it is configured to) and the worker refuses new work from then on: an
engine in an unknown state is not reused. The engine's own per-request fault isolation is the
server's (server/engine_loop.py); a batch job prefers Ray's retry of the whole batch.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time

from jaxserve.batch_records import Work, error_record, field_message, result_record
from jaxserve.types import InvalidRequestError


class EngineWorker:
    def __init__(self, engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._broken: BaseException | None = None
        self._lock = threading.Lock()  # a submit racing the failure still gets its answer
        self.tokens = 0  # generated, over the worker's life
        self.busy_seconds = 0.0  # in engine steps
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> concurrent.futures.Future:
        """A future resolving to work's result record, or to an error record naming the field
        the engine refused."""
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"the engine failed earlier and takes no more work: {self._broken!r}")
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._inbox.put((f"ray-{next(self._ids)}", work, fut))
        return fut

    def _run(self) -> None:
        in_flight: dict[str, tuple[Work, concurrent.futures.Future]] = {}
        items: list = []  # taken from the inbox, not yet in the engine
        try:
            while True:
                # Idle: block until work arrives, so an idle actor burns no CPU.
                items = [self._inbox.get()] if not self.engine.has_unfinished() else []
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for request_id, work, fut in items:
                    try:
                        self.engine.add_request(work.prompt, work.params, request_id=request_id)
                        in_flight[request_id] = (work, fut)
                    except InvalidRequestError as e:
                        fut.set_result(error_record(work.id, work.line, e.field, field_message(e)))
                if not self.engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                deltas = self.engine.step()
                self.busy_seconds += time.perf_counter() - t0
                for d in deltas:
                    self.tokens += len(d.token_ids)
                    if d.finished and d.request_id in in_flight:
                        out = self.engine.pop_finished(d.request_id)
                        if out is not None:  # None until every sample of the request finished
                            work, fut = in_flight.pop(d.request_id)
                            fut.set_result(result_record(work, out))
        except BaseException as e:  # noqa: BLE001 - every waiting batch must hear of it
            with self._lock:
                self._broken = e
                waiting = [fut for _, fut in in_flight.values()] + [fut for _, _, fut in items]
                while True:
                    try:
                        waiting.append(self._inbox.get_nowait()[2])
                    except queue.Empty:
                        break
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(e)
