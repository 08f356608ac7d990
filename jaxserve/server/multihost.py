"""`jaxserve serve` in a multi-process job: process 0 serves gRPC, every other process follows.

Every process loads the same model onto one global mesh and builds the same engine. Process 0
runs the usual server (app.py) on a `lockstep.Leader` around its engine, so each step first
sends the requests added and aborted since the last one to the others
(jaxserve/engine/lockstep.py explains why events rather than plans). The other processes run
no server: they replay those events and step in lockstep until process 0 says "stop", which it
does whenever its server ends (drained after SIGTERM, a failed warm-up, a port it could not
bind). Clients talk to process 0 only.

A follower ignores its first SIGTERM / SIGINT (a pod-wide Ctrl-C also reaches process 0, which
drains and then stops everyone; leaving mid-step would stall the others' collectives); a second
one exits at once.
"""

from __future__ import annotations

import contextlib
import signal

from jaxserve.engine import LockstepLeader, follow_lockstep
from jaxserve.server.app import announce_line, serve
from jaxserve.server.config import ServerConfig


def serve_job(engine, config: ServerConfig, description=None, announce=announce_line, **server_kw) -> int:
    """`serve` on one process; on many, serve on process 0 and follow on the rest."""
    import jax
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return serve(engine, config, description, announce, **server_kw)
    if server_kw:
        raise ValueError("a disaggregated role runs in one process (cli.py refuses more)")
    if me == 0:
        leader = LockstepLeader(engine)
        try:
            code = serve(leader, config, description, announce)
        finally:
            leader.close()
        announce(f"jaxserve: told {n - 1} other process(es) to stop after {leader.steps} steps "
                 f"({engine.compiles_after_warmup} compilations after warm-up)")
        return code
    announce(f"jaxserve: process {me} of {n}: stepping in lockstep with process 0, which serves gRPC")
    with _patient_signals(me, announce):
        steps = follow_lockstep(engine, progress=False)
    announce(f"jaxserve: process {me} stopped after {steps} steps "
             f"({engine.compiles_after_warmup} compilations after warm-up)")
    return 0


@contextlib.contextmanager
def _patient_signals(me: int, announce):
    seen = []

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        if seen:
            raise KeyboardInterrupt
        seen.append(name)
        announce(f"jaxserve: process {me}: {name}: waiting for process 0 to stop the job "
                 f"(send it again to exit now)")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
