"""ptxas's verdict on a GPU program's kernels: registers per thread, shared memory per block,
spills, and the occupancy they allow on the target's SMs (`jaxserve compile --topology cuda:...`).

Where each figure comes from (nothing here runs on a GPU):
  Mosaic GPU kernels (the paged attention): compiled to a cubin inside XLA's compile; with
      MOSAIC_GPU_DUMP_PTXAS / MOSAIC_GPU_DUMP_TO set, Mosaic writes ptxas's own `-v` report
      (<kernel>.ptxas) and its MLIR pass log, whose `gpu.launch` carries the block size and the
      dynamic shared memory the kernel is launched with.
  Triton kernels (the quantized matmuls) and XLA's own kernels: with `xla_dump_to`, XLA writes
      each kernel's PTX and its thunk sequence (every kernel's grid, block and dynamic shared
      memory); `ptxas -v` (the one jax's CUDA wheels ship) is run on each PTX here, for the
      same arch XLA compiled for.
Occupancy: resident blocks per SM = the least of what registers, shared memory, warps and the
block limit allow, from compute capability 9.0's per-SM limits (CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability"; the same for H100 and H200); occupancy =
resident warps / 64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# Compute capability 9.0, per SM (CUDA C++ Programming Guide, compute capability table).
SM90 = dict(registers=65536, max_warps=64, max_blocks=32, smem_bytes=228 * 1024, smem_per_block_max=227 * 1024,
            reserved_smem_per_block=1024, register_unit_per_warp=256)
ARCH = "sm_90a"

# The Pallas kernels' names as they reach PTX: Mosaic GPU names every kernel "<fn>_kernel" of
# an anonymous module; the Triton kernels are named by pallas_call(name=...).
OWN_KERNELS = ("mosaic_gpu", "quantized_matmul")

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_THUNK = re.compile(r"kCustomKernel .*?\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes")
_MOSAIC_CALL = re.compile(r'(custom_call_target="mosaic_gpu[^"]*".*)$', re.M)
_METADATA = re.compile(r"metadata=\{[^}]*\}")  # source lines and op names: not the kernel
_LAUNCH = re.compile(r"gpu\.launch .*?threads\([^)]*\) in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*\)"
                     r" dynamic_shared_memory_size %c(\d+)")


@dataclasses.dataclass
class Kernel:
    name: str
    source: str  # "mosaic_gpu" | "triton" | "xla"
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_smem_bytes: int
    dynamic_smem_bytes: int | None  # None: the launch's figure was not found
    threads: int | None
    blocks_per_sm: int | None = None
    occupancy: float | None = None
    limited_by: str | None = None

    def __post_init__(self):
        if self.threads and self.dynamic_smem_bytes is not None:
            self.blocks_per_sm, self.limited_by = resident_blocks(self.registers, self.threads,
                                                                  self.static_smem_bytes + self.dynamic_smem_bytes)
            self.occupancy = round(self.blocks_per_sm * -(-self.threads // 32) / SM90["max_warps"], 4)


def resident_blocks(registers: int, threads: int, smem: int, sm=SM90) -> tuple[int, str]:
    """(blocks of `threads` resident on one SM, what limits them)."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // sm["register_unit_per_warp"]) * sm["register_unit_per_warp"]
    limits = {"blocks": sm["max_blocks"], "warps": sm["max_warps"] // warps,
              "registers": (sm["registers"] // per_warp) // warps if per_warp else sm["max_blocks"]}
    limits["shared memory"] = (0 if smem > sm["smem_per_block_max"]
                               else sm["smem_bytes"] // (smem + sm["reserved_smem_per_block"]))
    why = min(limits, key=lambda k: limits[k])
    return limits[why], why


def parse_ptxas(text: str) -> dict[str, dict]:
    """ptxas -v's report: {entry: registers, barriers, static smem, stack, spills}."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if (m := _PTXAS_ENTRY.search(line)):
            current = out.setdefault(m.group(1), dict(registers=0, static_smem_bytes=0, stack_bytes=0,
                                                      spill_store_bytes=0, spill_load_bytes=0))
        elif current is not None and (m := _PTXAS_SPILL.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and (m := _PTXAS_USED.search(line)):
            current.update(registers=int(m.group(1)), static_smem_bytes=int(m.group(3) or 0))
    return out


def ptxas_binary() -> Path:
    """The ptxas of jax's CUDA wheels (nvidia-cuda-nvcc-cu12), which XLA itself runs."""
    import nvidia.cuda_nvcc  # the CUDA wheels' namespace package
    for root in nvidia.cuda_nvcc.__path__:
        p = Path(root) / "bin" / "ptxas"
        if p.exists():
            return p
    raise FileNotFoundError("ptxas: not in the nvidia-cuda-nvcc-cu12 wheel; `make gpu-compile` installs it")


class Dumps:
    """Where one `jaxserve compile` run's GPU compiles leave their PTX and ptxas reports.
    Mosaic reads its dump directory from the environment (once per process, so one directory
    serves every program: each program takes the files that appeared during its compile);
    XLA takes a directory per compile through `compiler_options()`."""

    def __init__(self, root: Path):
        self.root = root
        self.mosaic = root / "mosaic"
        self.mosaic.mkdir(parents=True, exist_ok=True)
        self._seen: set[str] = set()
        self._n = 0
        self._by_call: dict[str, list[Kernel]] = {}  # a Mosaic custom call's text -> its kernels

    def compiler_options(self) -> dict:
        self._n += 1
        self._xla = self.root / f"xla{self._n}"
        return {"xla_dump_to": str(self._xla)}

    def kernels(self, hlo_text: str) -> list[Kernel]:
        """The kernels of the program just compiled, `hlo_text` its compiled HLO (its dumps are
        deleted once read: Mosaic's pass log alone is tens of MB a kernel). Mosaic compiles a
        kernel it has compiled before in this process from its cache, dumping nothing: such a
        kernel, recognised by its custom call's text (the serialized kernel and its shapes),
        takes the figures its first compile dumped."""
        fresh = sorted((p for p in self.mosaic.iterdir() if p.name not in self._seen),
                       key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
        self._seen.update(p.name for p in fresh)
        calls = list(dict.fromkeys(_METADATA.sub("", m.group(1)) for m in _MOSAIC_CALL.finditer(hlo_text)))
        new = [c for c in calls if c not in self._by_call]
        dumped = _mosaic_kernels(fresh)
        # Fresh dumps come in compile order, one kernel a call: matched to the new calls in the
        # order the HLO lists them (one Mosaic kernel a program is what the engine compiles).
        for i, c in enumerate(new):
            self._by_call[c] = dumped[i:i + 1] if len(new) > 1 else dumped
        mosaic = [k for c in calls for k in self._by_call[c]] if calls else dumped
        found = mosaic + _xla_kernels(self._xla)
        for p in fresh:
            p.unlink(missing_ok=True)
        shutil.rmtree(self._xla, ignore_errors=True)
        return found


@contextlib.contextmanager
def dumping():
    """A Dumps over a fresh temporary directory, Mosaic's environment set for its lifetime."""
    keys = ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO")
    saved = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="jaxserve-ptx-") as d:
        dumps = Dumps(Path(d))
        os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(dumps.mosaic))
        try:
            yield dumps
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _launch_of(log: Path) -> tuple[int | None, int | None]:
    """(threads per block, dynamic shared memory bytes) of the first gpu.launch in a Mosaic
    pass log (read line by line: the log is large, the launch comes early)."""
    if not log.exists():
        return None, None
    with log.open(errors="replace") as f:
        for line in f:
            if "gpu.launch" in line and (m := _LAUNCH.search(line)):
                x, y, z, smem = map(int, m.groups())
                return x * y * z, smem
    return None, None


def _mosaic_kernels(files: list[Path]) -> list[Kernel]:
    out = []
    for rep in (p for p in files if p.suffix == ".ptxas"):
        threads, smem = _launch_of(rep.with_suffix(".mlir-passes.log"))
        for name, s in parse_ptxas(rep.read_text(errors="replace")).items():
            out.append(Kernel(name=name, source="mosaic_gpu", threads=threads, dynamic_smem_bytes=smem, **s))
    return out


def _xla_kernels(d: Path) -> list[Kernel]:
    if not d.is_dir():
        return []
    launches = {}
    for seq in d.glob("*thunk_sequence.txt"):
        for m in _THUNK.finditer(seq.read_text(errors="replace")):
            threads = 1
            for t in m.group(3).split(","):
                threads *= int(t)
            launches[m.group(1)] = (threads, int(m.group(4)))
    # XLA writes an empty .ptx for a module with no kernel of its own (a program that is one
    # Triton custom call: that kernel's PTX is the module before it); ptxas refuses those.
    with_kernels = [(p, t) for p in sorted(d.glob("*.ptx")) if ".entry" in (t := p.read_text(errors="replace"))]
    ptxas = str(ptxas_binary()) if with_kernels else None
    out = []
    for ptx, text in with_kernels:
        proc = subprocess.run([ptxas, "-v", f"-arch={ARCH}", str(ptx), "-o", os.devnull],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:  # a PTX XLA compiled is one ptxas must take: say so
            raise RuntimeError(f"ptxas refused {ptx.name}: {proc.stderr.strip().splitlines()[:1]}")
        for name, s in parse_ptxas(proc.stderr + proc.stdout).items():
            threads, smem = launches.get(name, (None, None))
            source = "triton" if "global_smem" in text and name.startswith(OWN_KERNELS) else "xla"
            out.append(Kernel(name=name, source=source, threads=threads, dynamic_smem_bytes=smem, **s))
    return out


def summarize(kernels: list[Kernel]) -> dict:
    """The report's entry for one program: the Pallas kernels one by one, XLA's own in sum."""
    own = [dataclasses.asdict(k) for k in kernels if k.source != "xla"]
    xla = [k for k in kernels if k.source == "xla"]
    return dict(kernels=own, xla_kernels=dict(
        count=len(xla), max_registers=max((k.registers for k in xla), default=0),
        spilling=sorted({k.name for k in xla if k.spill_store_bytes or k.spill_load_bytes})))


def format_kernels(programs: list[dict]) -> list[str]:
    """The table `jaxserve compile` prints under the programs for a GPU target."""
    lines = ["", f"{'program':<12} {'kernel':<36} {'regs':>5} {'smem KiB':>9} {'spill B':>8} {'threads':>7} "
                 f"{'blocks/SM':>9} {'occupancy':>9}  limited by"]
    for p in programs:
        for k in p.get("ptxas", {}).get("kernels", []):
            smem = k["static_smem_bytes"] + (k["dynamic_smem_bytes"] or 0)
            occ = f"{k['occupancy']:.3f}" if k["occupancy"] is not None else "?"
            lines.append(f"{p['name']:<12} {k['name'][:36]:<36} {k['registers']:>5} {smem / 1024:>9.1f} "
                         f"{k['spill_store_bytes'] + k['spill_load_bytes']:>8} {k['threads'] or '?':>7} "
                         f"{k['blocks_per_sm'] if k['blocks_per_sm'] is not None else '?':>9} {occ:>9}  "
                         f"{k['limited_by'] or '?'}")
        x = p.get("ptxas", {}).get("xla_kernels")
        if x:
            lines.append(f"{p['name']:<12} {'(XLA: ' + str(x['count']) + ' kernels)':<36} {x['max_registers']:>5} "
                         f"{'':>9} {'spills: ' + (', '.join(x['spilling']) or 'none')}")
    return lines
