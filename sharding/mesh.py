"""Device meshes: ("dp", "tp") over the local devices, or over every process's devices after
jax.distributed.initialize (one JAX process per host, one global mesh)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("dp", "tp")


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A dp x tp mesh. tp is innermost, so a tp group is a run of neighbouring devices (on a
    TPU slice: the ones joined by the fastest links)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    if tp * dp > len(devices):
        raise ValueError(f"tp={tp} x dp={dp} needs {tp * dp} devices, only {len(devices)} available")
    return Mesh(np.asarray(devices[: tp * dp]).reshape(dp, tp), AXES)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Join the job's processes into one JAX runtime: from the arguments, else from
    JAXSERVE_COORDINATOR / JAXSERVE_NUM_PROCESSES / JAXSERVE_PROCESS_ID, else, with
    JAXSERVE_DISTRIBUTED=auto (TPU pods, scripts/tpu_pod_job.sh), from jax's own detection.
    Returns True if a multi-process runtime was started. CPU processes use gloo collectives."""
    coordinator = coordinator or os.environ.get("JAXSERVE_COORDINATOR")
    num_processes = num_processes or _int_env("JAXSERVE_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _int_env("JAXSERVE_PROCESS_ID")
    if coordinator is None and num_processes is None and process_id is None:
        if os.environ.get("JAXSERVE_DISTRIBUTED") == "auto":
            jax.distributed.initialize()
            return True
        return False
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    missing = [k for k, v in given.items() if v is None]
    if missing:  # jax would guess or fail obscurely; a half-configured job is a mistake
        raise ValueError(f"{missing[0]}: a multi-process job needs the coordinator address, the "
                         f"process count and this process's id together (flags, or JAXSERVE_"
                         f"COORDINATOR / _NUM_PROCESSES / _PROCESS_ID); missing: {', '.join(missing)}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id: must be in [0, num_processes={num_processes}), got {process_id}")
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}: must be an integer, got {v!r}") from None
