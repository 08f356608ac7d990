"""jaxserve.v1.Admin: operator calls (generation.proto), served beside Generation.

ResetPrefixCache runs on the engine thread between steps (EngineLoop.reset_prefix_cache), the
only thread that touches the engine; in a multi-process job the lockstep leader replays it on
every process, so all schedulers keep making the same prefix hits.
"""

from __future__ import annotations

import asyncio

from jaxserve.server.calls import unary
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.proto import generation_pb2 as pb


class AdminService:
    def __init__(self, engine_loop: EngineLoop, metrics):
        self.engine_loop = engine_loop
        self.metrics = metrics  # calls.unary counts refusals here

    @unary
    async def ResetPrefixCache(self, request, context):
        freed = await asyncio.wrap_future(self.engine_loop.reset_prefix_cache())
        return pb.ResetPrefixCacheResponse(freed_pages=freed)
