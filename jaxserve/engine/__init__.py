"""The engine's public face: what an owner of an engine (the server, scripts) imports.

The server imports only these names, jaxserve.types and jaxserve.config (an import-linter
contract in pyproject.toml); the modules behind them are the engine's own business. The
scheduler's per-request policies the server drives beside the engine (tenant quotas, the
TTFT-SLO admission) are part of this face too.
"""

from jaxserve.engine.engine import Engine, RequestState
from jaxserve.engine.faults import EngineBroken, FaultInjectingRunner
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.engine.lockstep import Leader as LockstepLeader, LockstepError, follow as follow_lockstep
from jaxserve.engine.request_check import ValidRequest
from jaxserve.engine.runner_protocol import Runner, RunnerFactory
from jaxserve.scheduler.quotas import TenantLimits, TenantQuotas
from jaxserve.scheduler.slo import SloAdmission

__all__ = ["Engine", "EngineBroken", "FaultInjectingRunner", "GrammarCompiler", "LockstepError",
           "LockstepLeader", "RequestState", "Runner", "RunnerFactory", "SloAdmission", "TenantLimits",
           "TenantQuotas", "ValidRequest", "follow_lockstep"]
