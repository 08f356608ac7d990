"""Launching the processes of one multi-process JAX job on localhost, for tests: a free
coordinator port, and running the processes to completion with their outputs."""

from __future__ import annotations

import random
import socket
import subprocess
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now and outside the kernel's ephemeral range. The server it is for (a
    jax.distributed coordinator, a Ray head) binds it seconds later; a port the kernel handed out (bind to port 0) could
    meanwhile go to one of the many loopback connections and port-0 servers of the other test
    worker, and the job would fail "address already in use"."""
    low, high = _ephemeral_range()
    # Below the range, else above it (a range tuned to "1024 65535" leaves neither: the
    # kernel's choice below, as before).
    outside = range(max(1024, low - 12000), low) if low > 1024 + 1000 else range(high + 1, 65536)
    if len(outside) > 100:
        for port in random.sample(outside, min(200, len(outside))):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # every one tried was taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator_address() -> str:
    return f"127.0.0.1:{free_port()}"


def run_job(cmds: list[list[str]], envs: list[dict], timeout: float = 240) -> list[str]:
    """Start every process at once (they meet at the coordinator), wait for all; each must exit
    0 (else the assertion shows its stderr). Returns their stdouts in order. A process still
    running after `timeout` seconds, or left behind by a failure, is killed."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(cmds, envs)]
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{err[-3000:]}"
    return [out for out, _ in results]
