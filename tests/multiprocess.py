"""Launching the processes of one multi-process JAX job on localhost, for tests: a free
coordinator port, and running the processes to completion with their outputs."""

from __future__ import annotations

import random
import socket
import subprocess
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port() -> int:
    """A port free now and outside the kernel's ephemeral range. The coordinator binds it
    seconds later, after importing jax; a port the kernel handed out (bind to port 0) could
    meanwhile go to one of the many loopback connections and port-0 servers of the other test
    worker, and the job would fail "address already in use"."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
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
