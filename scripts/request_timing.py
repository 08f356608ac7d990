"""One request's latencies from its client-side timestamps, and the streaming clients that take
them, shared by the load scripts (bench_serving.py, capacity.py): `sent` (arrival), `first` /
`last` (first and last token received), `tokens` (tokens received), all in seconds on one clock
(the caller's `clock`: each script picks its own origin).

    stream_grpc(stub, req, out, metadata, timeout, clock)       jaxserve.v1 Generate
    stream_completion(client, body, out, headers, timeout, clock)  OpenAI POST /v1/completions,
                                                                   stream=true with usage
"""

from __future__ import annotations

import dataclasses
import json

# HTTP statuses that mean what gRPC's codes mean to the load scripts (a 429 is a rejection).
HTTP_CODES = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 400: "INVALID_ARGUMENT"}


@dataclasses.dataclass
class RequestTiming:
    """The timestamps every load script's outcome carries; each script's Outcome subclasses it with
    its own fields (keyword-only here, so the subclass's positional fields need no defaults)."""

    sent: float = dataclasses.field(kw_only=True)
    code: str = dataclasses.field(default="OK", kw_only=True)
    first: float | None = dataclasses.field(default=None, kw_only=True)
    last: float | None = dataclasses.field(default=None, kw_only=True)
    tokens: int = dataclasses.field(default=0, kw_only=True)

    @property
    def ttft(self):
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self):
        if self.first is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    @property
    def e2e(self):
        return None if self.last is None else self.last - self.sent


def _mark(out, clock) -> None:
    now = clock()
    out.first = out.first if out.first is not None else now
    out.last = now


async def stream_grpc(stub, req, out, metadata, timeout, clock) -> None:
    """One streamed Generate call: every message with tokens marks first/last and counts them;
    a gRPC error sets `out.code` to the status name."""
    import grpc
    try:
        async for msg in stub.Generate(req, metadata=metadata, timeout=timeout):
            if msg.token_ids:
                _mark(out, clock)
                out.tokens += len(msg.token_ids)
    except grpc.aio.AioRpcError as e:
        out.code = e.code().name


async def stream_completion(client, body, out, headers, timeout, clock) -> None:
    """One streamed /v1/completions call (an httpx.AsyncClient): a chunk with choices marks
    first/last; the token count comes from the final usage chunk (the body must ask for it with
    stream_options.include_usage). A refusal sets `out.code` as gRPC would name it."""
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                out.code = HTTP_CODES.get(r.status_code, f"HTTP_{r.status_code}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out.code = "STREAM_ERROR"
                    return
                if chunk["choices"]:
                    _mark(out, clock)
                elif chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a dropped connection: counted, not fatal to the run
        out.code = type(e).__name__


def completion_body(model: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """The streamed completions request both scripts send: token-id prompt, exact length."""
    return {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
