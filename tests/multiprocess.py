"""Launching the processes of one multi-process JAX job on localhost, for tests: a free
coordinator port, and running the processes to completion with their outputs."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
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
