"""The engine loop's KV port for the disaggregated roles (jaxserve/server/engine_loop.py's module
doc): a prefill server offers each handover's KV pages on this process's transfer server
(kv_transfer.py) and answers a `KVHandover` ticket; a decode server reads a ticket back
(wire.py's checks, on the event loop) and pulls the pages on its engine thread, polled until
they have arrived or the port's timeout has passed.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time

from jaxserve.disagg import wire
from jaxserve.disagg.kv_transfer import KVTransfer, Pull
from jaxserve.server.proto import generation_pb2 as pb


@dataclasses.dataclass
class Incoming:
    """A decode server's handover to import: its state (renamed to this server's id on
    admission) and where its KV waits."""

    handover: object  # engine/handover.Handover
    address: str
    uuid: int
    kv_bytes: int


@dataclasses.dataclass
class PendingPull:
    pull: Pull
    timeout_s: float
    nbytes: int

    def ready(self) -> bool:
        return self.pull.ready()

    @property
    def data(self) -> tuple:
        return self.pull.data

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.pull.started

    def expired(self) -> bool:
        return self.seconds > self.timeout_s

    def timeout_message(self) -> str:
        p = self.pull
        return (f"the KV pages of this request (transfer {p.uuid} from {p.address}) did not arrive within "
                f"{self.timeout_s:g} s (kv_transfer_timeout_s): the prefill engine is gone or dropped them")


class TransferPort:
    """One per prefill or decode server process."""

    def __init__(self, timeout_s: float = 30.0, host: str = "127.0.0.1"):
        self.timeout_s = timeout_s
        self.transfer = KVTransfer(host)
        # Random start: a decode engine pulls by (address, uuid), and a restarted prefill process
        # may come back on the same address.
        self._uuids = itertools.count(secrets.randbits(62))

    # ---- prefill role (engine thread) ------------------------------------------------------

    def offer(self, handover, data: tuple) -> pb.KVHandover:
        uuid = next(self._uuids)
        # Held a little longer than a decode engine waits, so a slow pull still finds it.
        self.transfer.offer(uuid, data, timeout_s=2 * self.timeout_s)
        return pb.KVHandover(handover=wire.to_json(handover), address=self.transfer.address, uuid=uuid,
                             kv_bytes=handover.kv_bytes)

    # ---- decode role -----------------------------------------------------------------------

    @staticmethod
    def incoming(ticket: pb.KVHandover) -> Incoming:
        """On the event loop: the ticket read and checked (InvalidRequestError names the field)."""
        from jaxserve.types import InvalidRequestError
        if not ticket.address:
            raise InvalidRequestError("handover.address", "the prefill engine's transfer address is required")
        return Incoming(wire.from_json(ticket.handover), ticket.address, ticket.uuid, ticket.kv_bytes)

    def pull(self, engine, inc: Incoming) -> PendingPull:
        """On the engine thread: start pulling into arrays shaped as this engine stores KV."""
        h = inc.handover
        specs = engine.runner.page_specs(h.full_pages, h.sliding_pages)
        return PendingPull(self.transfer.pull(inc.address, inc.uuid, specs), self.timeout_s, inc.kv_bytes)
