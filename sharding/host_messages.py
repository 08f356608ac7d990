"""Byte messages from process 0 to every process of a multi-process JAX job, over the job's own
collectives (jax.experimental.multihost_utils.broadcast_one_to_all: gloo on CPU, ICI/DCN on TPU).

A message travels as one or more broadcasts of one fixed-size chunk of CHUNK_BYTES; the first
chunk starts with the message length (4 bytes, little-endian). A fixed shape means the broadcast
compiles once, at the first message, and never again, whatever the message sizes; a typical
engine step's message (a few adds and aborts) fits one chunk.

`exchange` is a collective: every process must call it the same number of times, in the same
order, and between the same device computations (the caller serializes it with its own steps).
"""

from __future__ import annotations

import jax
import numpy as np

CHUNK_BYTES = 16 * 1024  # one broadcast; a multiple of 4 (sent as int32 words)
_LEN_BYTES = 4


def exchange(payload: bytes | None) -> bytes:
    """Process 0 passes its message and gets it back; every other process passes None and gets
    process 0's message."""
    leader = jax.process_index() == 0
    if leader != (payload is not None):
        raise ValueError(f"process {jax.process_index()}: only process 0 sends a payload "
                         f"(got {'one' if payload is not None else 'none'})")
    if jax.process_count() == 1:
        return payload
    if CHUNK_BYTES % 4 or CHUNK_BYTES <= _LEN_BYTES:
        raise ValueError(f"CHUNK_BYTES must be a multiple of 4 above {_LEN_BYTES}, got {CHUNK_BYTES}")
    if leader:
        if len(payload) >= 2**32:
            raise ValueError(f"message of {len(payload)} bytes exceeds the 4 GiB limit")
        data = len(payload).to_bytes(_LEN_BYTES, "little") + payload
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        for c in chunks:
            _broadcast(c)
        return payload
    first = _broadcast(b"")
    n = int.from_bytes(first[:_LEN_BYTES], "little")
    parts = [first[_LEN_BYTES:]]
    got = CHUNK_BYTES - _LEN_BYTES
    while got < n:
        parts.append(_broadcast(b""))
        got += CHUNK_BYTES
    return b"".join(parts)[:n]


def _broadcast(chunk: bytes) -> bytes:
    """One chunk from process 0 (others' input is ignored): int32 words, zero-padded."""
    from jax.experimental import multihost_utils
    buf = np.zeros(CHUNK_BYTES, np.uint8)
    buf[:len(chunk)] = np.frombuffer(chunk, np.uint8)
    out = multihost_utils.broadcast_one_to_all(buf.view(np.int32))
    return np.asarray(out, np.int32).tobytes()
