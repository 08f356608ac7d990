"""capacity.py's targets: what a trial's requests are sent to. Each `run(requests, arrivals)`
returns (outcomes, duration, extras) with the clock starting at the first arrival's origin.

    SimTarget   the real Engine (fake runner) in virtual time: exact, what the tests search
    GrpcTarget  a server over loopback gRPC (jaxserve.v1 Generate)
    HttpTarget  a server over loopback HTTP (the OpenAI API, streamed /v1/completions)

The two loopback targets send the same requests (token-id prompts, max_tokens, ignore_eos,
each tenant its own bearer token) through request_timing.py's stream clients, so their figures
compare; with the in-process server they also read its engine and metrics (preemptions,
compilations, peak KV usage)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import time
from collections.abc import Callable

from capacity_workload import Request
from request_timing import RequestTiming, completion_body, stream_completion, stream_grpc


@dataclasses.dataclass
class Outcome(RequestTiming):
    tenant: str
    output_tokens: int
    # Seconds between consecutive token deliveries (inter-token latency), kept by the
    # simulations only: a prefill chunk's stall shows here before it moves a request's TPOT.
    gaps: list = dataclasses.field(default_factory=list)


def record_deltas(by_id: dict, deltas, now: float) -> None:
    """Each delta's tokens into its request's Outcome at virtual time `now` (first, last, gaps, count)."""
    for d in deltas:
        o = by_id[d.request_id]
        if d.token_ids:
            if o.last is not None:
                o.gaps.append(now - o.last)
            o.first = o.first if o.first is not None else now
            o.last = now
            o.tokens += len(d.token_ids)


class SimTarget:
    """The real Engine (scheduler, engine loop; a fake runner) in virtual time: a step costs
    `step_cost(tokens)` seconds. Deterministic: the same inputs give the same curve.
    `make_slo`, if given, makes a scheduler.slo.SloAdmission per run that acts as the server's
    does (engine_loop.py): it refuses a predicted TTFT miss on arrival, sizes every step for the
    TPOT target, and learns each step's (virtual) cost."""

    def __init__(self, make_engine: Callable[[], object], step_cost: Callable[[int], float],
                 make_slo: Callable[[], object] | None = None,
                 kv_step_cost: Callable[[int, int], float] | None = None):
        self.make_engine = make_engine
        self.step_cost = step_cost
        self.make_slo = make_slo
        # (step tokens, KV tokens the running sequences hold) -> seconds: attention's reads
        # counted too (the costs of a `jaxserve compile` report, jaxserve/aot/predict.py).
        self.kv_step_cost = kv_step_cost

    def run(self, requests: list[Request], arrivals: list[float]):
        from jaxserve.types import InvalidRequestError, SamplingParams
        eng = self.make_engine()
        sched = eng.scheduler
        slo = self.make_slo() if self.make_slo is not None else None
        now, i, outcomes, by_id, peak = 0.0, 0, [], {}, 0.0
        while i < len(requests) or eng.has_unfinished():
            if not eng.has_unfinished() and arrivals[i] > now:
                now = arrivals[i]  # idle: jump to the next arrival
            while i < len(requests) and arrivals[i] <= now:
                r = requests[i]
                o = Outcome(r.tenant, r.max_tokens, sent=arrivals[i])
                outcomes.append(o)
                i += 1
                if slo is not None and slo.refusal(sched, len(r.prompt_ids), now - o.sent) is not None:
                    o.code = "RESOURCE_EXHAUSTED"
                    continue
                try:
                    rid = eng.add_request({"prompt_token_ids": r.prompt_ids},
                                          SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
                                          request_id=f"r{i - 1}", tenant=r.tenant)
                    by_id[rid] = o
                except InvalidRequestError:
                    o.code = "INVALID_ARGUMENT"
            if not eng.has_unfinished():
                continue  # everything that arrived was refused: nothing to step
            if slo is not None:
                slo.size_steps(sched)
            before = eng.stats["computed_tokens"]
            deltas = eng.step()
            tokens = eng.stats["computed_tokens"] - before
            if self.kv_step_cost is not None:
                held, _ = sched.kv_pages()
                cost = self.kv_step_cost(tokens, held * sched.config.page_size)
            else:
                cost = self.step_cost(tokens)
            now += cost
            if slo is not None:
                slo.observe_step(tokens, cost)
            held, usable = sched.kv_pages()  # the fuller KV group's, as the server reports it
            peak = max(peak, held / usable)
            record_deltas(by_id, deltas, now)
            for d in deltas:
                if d.finished:
                    eng.pop_finished(d.request_id)
        return outcomes, now, {"preemptions": eng.stats["preemptions"], "peak_kv_usage": peak,
                               "prefix_cache_hit_tokens": eng.prefix_cache_stats()["hits"]}


def check_loopback(address: str) -> None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"capacity: --server must be a loopback address (localhost, 127.0.0.1, [::1]), "
                         f"got {address!r}: this is a load generator")


class _LoopbackTarget:
    """Open-loop sending over a loopback connection; the in-process Server too when there is
    one (its engine for preemptions and compilations, its metrics for the peak KV usage, which
    the engine thread records after every step: sampling it from here as messages arrive misses
    requests that finish between two samples). Subclasses open/close a connection and send one
    request."""

    def __init__(self, address: str, server=None, timeout: float = 3600.0):
        check_loopback(address)
        self.address = address
        self.engine = None if server is None else server.engine
        self.metrics = None if server is None else server.metrics
        self.timeout = timeout

    def run(self, requests: list[Request], arrivals: list[float]):
        pre = self.engine.stats["preemptions"] if self.engine is not None else None
        hits = self.engine.prefix_cache_stats()["hits"] if self.engine is not None else None
        if self.metrics is not None:
            self.metrics.reset_kv_peak()  # this trial's peak
        outcomes, duration = asyncio.run(self._run(requests, arrivals))
        extras = {"preemptions": None if pre is None else self.engine.stats["preemptions"] - pre,
                  "peak_kv_usage": None if self.metrics is None else self.metrics.kv_peak,
                  "compilations_after_warmup": getattr(self.engine, "compiles_after_warmup", None),
                  "prefix_cache_hit_tokens": None if hits is None else self.engine.prefix_cache_stats()["hits"] - hits}
        return outcomes, duration, extras

    async def _run(self, requests, arrivals):
        await self._open()
        t0 = time.perf_counter()

        def clock():
            return time.perf_counter() - t0

        tasks, outcomes = [], []
        try:
            for req, at in zip(requests, arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                o = Outcome(req.tenant, req.max_tokens, sent=clock())
                outcomes.append(o)
                tasks.append(asyncio.create_task(self._send(req, o, clock)))
            await asyncio.gather(*tasks)
        finally:
            await self._close()
        return outcomes, clock()

    @staticmethod
    def _bearer(req: Request) -> str | None:
        return f"Bearer tenant-{req.tenant}" if req.tenant else None


class GrpcTarget(_LoopbackTarget):
    async def _open(self):
        import grpc

        from jaxserve.server.proto import generation_grpc
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = generation_grpc.GenerationStub(self._channel)

    async def _close(self):
        await self._channel.close()

    def _send(self, req: Request, o: Outcome, clock):
        from jaxserve.server.proto import generation_pb2 as pb
        bearer = self._bearer(req)
        md = (("authorization", bearer),) if bearer else ()
        msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=req.prompt_ids),
                                 max_tokens=req.max_tokens, ignore_eos=True)
        return stream_grpc(self._stub, msg, o, md, self.timeout, clock)


class HttpTarget(_LoopbackTarget):
    """`address`: the server's HTTP host:port. The model id is asked of GET /v1/models once."""

    async def _open(self):
        import httpx
        self._client = httpx.AsyncClient(base_url=f"http://{self.address}",
                                         limits=httpx.Limits(max_connections=1024,
                                                             max_keepalive_connections=1024))
        r = await self._client.get("/v1/models", timeout=30)
        r.raise_for_status()
        self._model = r.json()["data"][0]["id"]

    async def _close(self):
        await self._client.aclose()

    def _send(self, req: Request, o: Outcome, clock):
        bearer = self._bearer(req)
        headers = {"authorization": bearer} if bearer else {}
        return stream_completion(self._client, completion_body(self._model, req.prompt_ids, req.max_tokens),
                                 o, headers, self.timeout, clock)
