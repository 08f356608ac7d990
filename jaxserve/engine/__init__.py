"""The engine's public face: what an owner of an engine (the server, scripts) imports.

The server imports only these names, jaxserve.types and the config tree (an import-linter
contract in pyproject.toml); the modules behind them are the engine's own business. The
scheduler's per-request policies the server drives beside the engine (tenant quotas, the
TTFT-SLO admission) are part of this face too.

The names that need jax (Engine, the grammar compiler, lockstep) load on first use, so that a
command can import its config (which names TenantLimits) and refuse bad flags before jax is
imported; the others are plain Python and load with the package.
"""

from jaxserve.engine.faults import EngineBroken, FaultInjectingRunner
from jaxserve.engine.request_check import ValidRequest, output_room
from jaxserve.engine.runner_protocol import Runner, RunnerFactory
from jaxserve.scheduler.handover import NoRoomForHandover
from jaxserve.scheduler.quotas import TenantLimits, TenantQuotas
from jaxserve.scheduler.slo import SloAdmission

_ON_FIRST_USE = {"Engine": "engine", "RequestState": "engine", "GrammarCompiler": "grammar",
                 "HandoverRefused": "handover",
                 "LockstepLeader": "lockstep", "LockstepError": "lockstep", "follow_lockstep": "lockstep"}

__all__ = ["EngineBroken", "FaultInjectingRunner", "NoRoomForHandover", "HandoverRefused", "Runner", "RunnerFactory", "SloAdmission", "TenantLimits",
           "TenantQuotas", "ValidRequest", "output_room", "Engine", "RequestState", "GrammarCompiler",
           "LockstepLeader", "LockstepError", "follow_lockstep"]
assert set(_ON_FIRST_USE) <= set(__all__)  # the lazily loaded names are public too


def __getattr__(name: str):
    # Plain import statements, so import-linter sees these edges as it sees the ones above.
    which = _ON_FIRST_USE.get(name)
    if which == "engine":
        from jaxserve.engine.engine import Engine, RequestState
        found = {"Engine": Engine, "RequestState": RequestState}
    elif which == "grammar":
        from jaxserve.engine.grammar import GrammarCompiler
        found = {"GrammarCompiler": GrammarCompiler}
    elif which == "handover":
        from jaxserve.engine.handover import HandoverRefused
        found = {"HandoverRefused": HandoverRefused}
    elif which == "lockstep":
        from jaxserve.engine.lockstep import Leader, LockstepError, follow
        found = {"LockstepLeader": Leader, "LockstepError": LockstepError, "follow_lockstep": follow}
    else:
        raise AttributeError(f"module 'jaxserve.engine' has no attribute {name!r}")
    globals().update(found)
    return found[name]


def __dir__():
    return sorted(set(globals()) | set(_ON_FIRST_USE))
