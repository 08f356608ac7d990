"""The KV pages of a handover moved between processes with `jax.experimental.transfer` (XLA's
transfer server, what JAX's own disaggregated serving uses between TPU slices): the prefill
process offers the arrays under a request's uuid, the decode process pulls them into arrays of
the same shapes, dtypes and shardings (kv_pages.specs), device to device where the platform
can, with no host round trip or relayout in jaxserve.

What it answered here (jax 0.10.2, CPU): it runs on CPU between processes on loopback. A pull
returns at once with arrays that become ready when the bytes have arrived; its `timeout` is not
honoured, and a pull whose offer never comes (a dropped transfer, a dead peer, an expired
offer) never becomes ready and raises nothing. So `Pull.wait` polls readiness against a
deadline of its own and the caller fails the request when it passes; nothing may use the
arrays before they are ready (a step given a pending array would wait on it forever). Offers
carry a deadline, after which the server drops them.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import jax
from jax.experimental import transfer


class TransferTimeout(RuntimeError):
    """The KV data of a handover did not arrive before its deadline."""


@dataclasses.dataclass
class Pull:
    uuid: int
    address: str
    data: tuple
    started: float

    def ready(self) -> bool:
        return all(x.is_ready() for x in jax.tree.leaves(self.data))

    def wait(self, timeout_s: float, poll_s: float = 0.002) -> tuple:
        """The arrays once every one is ready; TransferTimeout after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"KV pages of transfer {self.uuid} from {self.address} did not arrive "
                                      f"within {timeout_s:g} s")
            time.sleep(poll_s)
        return self.data


class KVTransfer:
    """This process's transfer server: it offers arrays to peers and pulls theirs."""

    def __init__(self, host: str = "127.0.0.1", device=None):
        client = (device or jax.devices()[0]).client
        self._server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self._conns: dict[str, object] = {}

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, uuid: int, data: tuple, timeout_s: float = 60.0) -> None:
        """Hold `data` for one pull of `uuid` by a peer, for at most `timeout_s`."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self._server.await_pull(uuid, data, timeout=deadline)

    def pull(self, address: str, uuid: int, specs: tuple) -> Pull:
        """Start pulling `uuid` from the peer at `address` into arrays shaped like `specs`."""
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = self._server.connect(address)
        leaves, tree = jax.tree.flatten(specs)
        return Pull(uuid, address, jax.tree.unflatten(tree, conn.pull(uuid, leaves)) if leaves else specs,
                    time.monotonic())
