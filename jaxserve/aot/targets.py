"""The machines `jaxserve compile` compiles for: a topology name -> compile-only devices and the
chip's published figures.

A TPU topology ("v5e:2x4", "v6e:2x2", "v5p:2x2x1", any name libtpu accepts) comes from
`jax.experimental.topologies.get_topology_desc(topology_name=..., platform="tpu")`, which needs
libtpu installed (`pip install "jax[tpu]==<the jax version>"`, kept out of the CPU venv:
`make tpu-compile`) and no TPU: its devices compile, they never run. Per chip generation the
table below holds what the compiler does not say: HBM capacity (what the KV pool is sized
from), peak dense bf16 and int8 throughput, and HBM bandwidth (the performance model,
jaxserve/aot/predict.py). Figures are the Cloud TPU documentation's per-chip numbers
(cloud.google.com/tpu/docs/v5e, /v6e, /v5p, /v4, "System architecture" tables, as of 2026):

  gen  HBM      bf16 TFLOP/s  int8 TOP/s  HBM GB/s
  v4   32 GiB   275           275         1228
  v5e  16 GiB   197           394          819
  v5p  95 GiB   459           918         2765
  v6e  32 GiB   918           1836        1640

A CUDA topology ("cuda:h100x8", "cuda:h200x1") comes from `get_topology_desc("", platform=
"cuda", topology="1x1xN", target_config=<the chip's GpuTargetConfigProto text>)`, which needs
jax's CUDA plugin (`jax[cuda12]`, `make gpu-compile`) and JAX_PLATFORMS=cpu (the plugin's start-up
check would fail on the missing driver) but no GPU. The target configs ship in gpu_specs/ (XLA's
own device figures for the chip, see each file). NVIDIA's datasheet figures (H100 SXM, H200 SXM,
dense, without sparsity):

  chip   HBM                      bf16 TFLOP/s  int8 TOP/s  HBM TB/s
  h100   80 GB (79.1 GiB usable)  989           1979        3.35
  h200   141 GB (140.4 GiB)       989           1979        4.8
"""

from __future__ import annotations

import dataclasses
import re

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # "v5e"
    platform: str  # "tpu" | "gpu"
    hbm_bytes: int  # per chip
    bf16_flops: float  # peak dense bf16 FLOP/s per chip
    int8_ops: float  # peak int8 OP/s per chip
    hbm_Bps: float  # HBM bandwidth per chip, bytes/s
    source: str


_TPU_DOCS = "Cloud TPU documentation, system architecture of {}"
CHIPS = {c.name: c for c in (
    Chip("v4", "tpu", 32 * GiB, 275e12, 275e12, 1228e9, _TPU_DOCS.format("TPU v4")),
    Chip("v5e", "tpu", 16 * GiB, 197e12, 394e12, 819e9, _TPU_DOCS.format("TPU v5e")),
    Chip("v5p", "tpu", 95 * GiB, 459e12, 918e12, 2765e9, _TPU_DOCS.format("TPU v5p")),
    Chip("v6e", "tpu", 32 * GiB, 918e12, 1836e12, 1640e9, _TPU_DOCS.format("TPU v6e (Trillium)")),
    Chip("h100", "gpu", 84978434048, 989e12, 1979e12, 3.35e12, "NVIDIA H100 SXM datasheet; memory: "
         "XLA's device figures (gpu_specs/h100_sxm.txtpb)"),
    Chip("h200", "gpu", 150754820096, 989e12, 1979e12, 4.8e12, "NVIDIA H200 SXM datasheet; memory: "
         "gpu_specs/h200_sxm.txtpb"),
)}
GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}

# jax's device_kind of each generation's compile-only devices.
_TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
              "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


class TargetError(ValueError):
    """A topology that cannot be compiled for here, said in one line."""


@dataclasses.dataclass(frozen=True)
class Target:
    topology: str  # as given
    chip: Chip
    devices: tuple  # compile-only devices, one per chip
    num_hosts: int  # processes the job would run (one per host)

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def num_devices(self) -> int:
        return len(self.devices)


def resolve_target(topology: str) -> Target:
    """The compile-only devices and chip figures of `topology`; a TargetError in one line when
    it cannot be had (no libtpu in this environment, a name libtpu refuses)."""
    if topology.startswith("cuda:"):
        return _cuda_target(topology)
    if not re.fullmatch(r"v\d+[a-z]*(:\d+(x\d+)*)?", topology):
        raise TargetError(f"topology: {topology!r} is not a TPU topology name such as v5e:2x4, v6e:2x2 or "
                          f"v5p:2x2x1 (generations {sorted(CHIPS)})")
    gen = topology.split(":")[0]
    if gen not in CHIPS:
        raise TargetError(f"topology: generation {gen!r} has no chip figures here; known: {sorted(CHIPS)}")
    try:
        from jax.experimental import topologies
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # libtpu missing, or the name refused: jax says which in its first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"topology: {topology!r} cannot be compiled for here ({first}); the TPU compiler "
                          f"comes with libtpu: `make tpu-compile` builds a venv with it") from None
    devices = tuple(desc.devices)
    kind = _TPU_KINDS.get(devices[0].device_kind)
    if kind != gen:
        raise TargetError(f"topology: {topology!r} gave devices of kind {devices[0].device_kind!r}, "
                          f"expected generation {gen}")
    hosts = len({d.process_index for d in devices})
    return Target(topology, CHIPS[gen], devices, hosts)


def _cuda_target(topology: str) -> Target:
    m = re.fullmatch(r"cuda:(h100|h200)x(\d+)", topology)
    if not m:
        raise TargetError(f"topology: {topology!r} is not a CUDA topology such as cuda:h100x8 or cuda:h200x1 "
                          f"(chips {sorted(GPU_SPECS)})")
    chip, count = m.group(1), int(m.group(2))
    if not 1 <= count <= 8:
        raise TargetError(f"topology: {topology!r}: 1 to 8 GPUs of one host")
    from pathlib import Path
    spec = (Path(__file__).parent / "gpu_specs" / GPU_SPECS[chip]).read_text()
    try:
        from jax.experimental import topologies
        desc = topologies.get_topology_desc("", platform="cuda", topology=f"1x1x{count}", target_config=spec)
    except Exception as e:  # no CUDA plugin here, or it refused the config: its first line says which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"topology: {topology!r} cannot be compiled for here ({first}); the CUDA compiler "
                          f"comes with jax[cuda12]: `make gpu-compile` builds a venv with it") from None
    return Target(topology, CHIPS[chip], tuple(desc.devices), 1)
