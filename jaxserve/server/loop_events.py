"""What goes into the engine thread (`EngineRequest`) and what comes out of it besides the
engine's own deltas (`Finished`, `Failed`, `HandedOver`, `LoopStatus`), batched to the asyncio
thread by engine_loop.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from jaxserve.types import RequestOutput, SamplingParams


@dataclasses.dataclass
class EngineRequest:
    """A validated, tokenized request on its way to the engine."""

    request_id: str  # the server's own id, unique for the server's life
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float  # time.perf_counter() when the call arrived (the engine's clock too)
    reserved_samples: int  # what it holds in the QueueLimiter until first scheduled
    reserved_tokens: int
    released: bool = False
    tenant: str = ""  # the authenticated caller (tenancy.tenant_of): fair sharing, quotas
    hand_over: bool = False  # prefill role: leave after the first token (HandedOver)
    incoming: Any = None  # decode role: the kv_port's incoming handover to import


@dataclasses.dataclass(frozen=True)
class HandedOver:
    """The request left this prefill engine after its first token(s) (streamed before this
    event); its KV pages wait on the kv_port for a decode engine to pull them (`ticket`)."""

    request_id: str
    ticket: Any


@dataclasses.dataclass(frozen=True)
class Finished:
    """Every sample finished; the deltas before it in the same batch are the request's last."""

    request_id: str
    output: RequestOutput


@dataclasses.dataclass(frozen=True)
class Failed:
    request_id: str
    code: grpc.StatusCode
    message: str
    field: str | None = None


@dataclasses.dataclass(frozen=True)
class LoopStatus:
    kind: str  # "warm" | "degraded" (a step fault, recovered from) | "recovered" | "failed"
    detail: str = ""
