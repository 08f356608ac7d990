"""One engine over many processes: process 0 decides, every process steps in lockstep.

In a multi-process job (one JAX process per host, one global mesh) the sharded step is SPMD:
every process must launch the same step on the same inputs. Process 0 (`Leader`) owns the
requests: it wraps its Engine, and every add_request and abort_request it applies is also
recorded; each step first broadcasts the events recorded since the last one (sharding/
host_messages.py), then steps. Every other process (`follow`) applies the same events in the
same order and steps when told, so all schedulers stay identical and plan the same batch.

    process 0: add, abort, add ... | step: send {events, "step"}, Engine.step
    process k:                       receive -> add, abort, add -> Engine.step (outputs dropped)

Why events and not step plans: an event is tiny (a new request's token ids and sampling
parameters, or an aborted id), most decode steps carry none, and the scheduler stays the one
deterministic function of its inputs on every process; a plan would carry every sequence's
block table every step and need a second code path into the runner. The cost: every process
must run the same code and the same engine configuration (checked at the first message; a
summary of the scheduler's state is compared at every message, so a divergence stops the job
loudly instead of stepping on different inputs), and every process detokenizes (stop strings
end sequences, so they are part of the state).

Seeds: an add carries the request's seed as process 0 resolved it, so unseeded requests sample
identically everywhere. While idle, process 0 sends an empty "tick" every TICK_S seconds, so no
process waits in a collective long enough to hit the backend's timeout (gloo: 30 minutes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from jaxserve.types import SamplingParams
from sharding import host_messages

log = logging.getLogger("jaxserve.lockstep")

TICK_S = 10.0
ACTIONS = ("warmup", "step", "tick", "stop")


class LockstepError(RuntimeError):
    """The processes disagree: they are not running the same code or configuration."""


def fingerprint(engine) -> str:
    """What must be equal on every process for the schedulers to plan the same steps."""
    import jaxserve
    # The cache folder is a host's own business; everything else shapes the plans.
    config = dataclasses.replace(engine.config, compilation_cache_dir=None)
    return repr((jaxserve.__version__, config, engine.model_config, engine.scheduler_config,
                 engine.eos_token_ids, engine.tokenizer.vocab_size))


def state(engine) -> list[int]:
    """A cheap summary of the scheduler that must agree on every process before every step."""
    s = engine.scheduler
    # Cached pages count as free; their number is compared too, since prefix hits shape plans.
    return [s.num_free_pages, s.num_running, s.num_waiting, int(engine.has_unfinished()),
            s.num_cached_pages]


class Leader:
    """Process 0's engine: add_request / abort_request / step are recorded and sent to every
    process; every other attribute (tokenizer, scheduler, stats, ...) is read from the engine.
    Thread-safe against its own ticker; `close()` tells the other processes to stop."""

    def __init__(self, engine, tick_s: float = TICK_S):
        self._engine = engine
        self._lock = threading.Lock()  # one message or step at a time: collectives must pair up
        self._events: list[list] = []
        self._first = True
        self._closed = False
        self._last_sent = time.monotonic()
        self.steps = 0
        self._stop_ticking = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, args=(tick_s,),
                                        name="jaxserve-lockstep-tick", daemon=True)
        self._ticker.start()

    def __getattr__(self, name):
        if name.startswith("_"):  # never forward our own (unset) internals
            raise AttributeError(name)
        return getattr(self._engine, name)

    def warmup(self, progress: bool = True) -> float:
        with self._lock:
            self._send("warmup")  # the others compile at the same time as we do
        return self._engine.warmup(progress)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0, tenant: str = "") -> str:
        with self._lock:
            rid = self._engine.add_request(prompt, params, request_id, arrival_time,
                                           priority=priority, tenant=tenant)
            req = self._engine.get_request(rid)
            self._events.append(["add", rid, list(req.prompt_ids), dataclasses.asdict(req.params), req.seed,
                                 priority, tenant])
            return rid

    def abort_request(self, request_id: str) -> bool:
        with self._lock:
            found = self._engine.abort_request(request_id)
            if found:
                self._events.append(["abort", request_id])
            return found

    def reset_prefix_cache(self) -> int:
        """Replayed everywhere: every scheduler must forget the same cached prefixes."""
        with self._lock:
            freed = self._engine.reset_prefix_cache()
            self._events.append(["reset_prefix_cache", ""])
            return freed

    def step(self):
        with self._lock:
            self._send("step")
            self.steps += 1
            return self._engine.step()

    def close(self) -> None:
        """Send "stop" (once); the other processes return from `follow`."""
        self._stop_ticking.set()
        with self._lock:
            if not self._closed:
                self._send("stop")
                self._closed = True

    def _send(self, action: str) -> None:
        if self._closed:
            raise LockstepError("the other processes were already told to stop")
        msg = {"action": action, "events": self._events, "state": state(self._engine)}
        if self._first:
            msg["fingerprint"] = fingerprint(self._engine)
        host_messages.exchange(json.dumps(msg, separators=(",", ":")).encode())
        self._events = []
        self._first = False
        self._last_sent = time.monotonic()

    def _tick_loop(self, tick_s: float) -> None:
        while not self._stop_ticking.wait(tick_s / 2):
            with self._lock:
                if self._closed:
                    return
                if time.monotonic() - self._last_sent < tick_s:
                    continue
                try:
                    self._send("tick")
                except Exception:  # the next step meets the same fault and reports it
                    log.exception("lockstep tick failed")
                    return


def follow(engine, progress: bool = False) -> int:
    """Process k > 0: replay process 0's events and steps until it sends "stop". Returns the
    number of steps. Step outputs are dropped: only process 0 answers clients."""
    import jax
    me = jax.process_index()
    steps = 0
    first = True
    while True:
        msg = json.loads(host_messages.exchange(None))
        if first and msg.get("fingerprint") != fingerprint(engine):
            raise LockstepError(f"process {me} differs from process 0 (same code and engine "
                                f"configuration needed on every process):\n  process 0: "
                                f"{msg.get('fingerprint')}\n  process {me}: {fingerprint(engine)}")
        first = False
        for ev in msg["events"]:
            _apply(engine, ev, me)
        action = msg["action"]
        if msg["state"] != state(engine):  # stop here rather than step on different inputs
            raise LockstepError(f"process {me} diverged from process 0 before its {action} after "
                                f"{steps} steps: (free pages, running, waiting, unfinished, "
                                f"cached pages) "
                                f"{state(engine)} here, {msg['state']} on process 0")
        if action == "warmup":
            engine.warmup(progress)
        elif action == "step":
            engine.step()
            steps += 1
        elif action == "stop":
            return steps
        elif action != "tick":
            raise LockstepError(f"process {me}: unknown action {action!r}; expected one of {ACTIONS}")
        engine.finished_outputs.clear()  # nobody here collects them


def _apply(engine, ev: list, me: int) -> None:
    kind = ev[0]
    try:
        if kind == "add":
            _, rid, ids, params, seed, priority, tenant = ev
            engine.add_request({"prompt_token_ids": ids}, SamplingParams(**params), request_id=rid,
                               drawn_seed=seed, priority=priority, tenant=tenant)
        elif kind == "abort":
            engine.abort_request(ev[1])
        elif kind == "reset_prefix_cache":
            engine.reset_prefix_cache()
        else:
            raise LockstepError(f"unknown event {kind!r}")
    except Exception as e:
        raise LockstepError(f"process {me} could not replay process 0's {kind} of {ev[1]!r}: "
                            f"{type(e).__name__}: {e}") from e
