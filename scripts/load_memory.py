"""Peak host memory of loading a model: the whole-host load against sharded loading.

    python scripts/load_memory.py HF_DIR [--tp 3] [--dtype float32] [--gguf FILE]

Every case runs in fresh processes on CPU, so no case's memory counts in another's:
  full-host            jaxserve.loading.load(HF_DIR) on one device: every tensor read whole
  full-host GGUF       the same for a GGUF file (with --gguf): dequantized whole, then placed
  sharded tp=N         HF_DIR onto an N-device mesh in one process (N fake CPU devices)
  sharded tp=N, N processes   one device per process, joined by jax.distributed: each process
                       reads only its own slices (checkpoints/sharded.py); figures per process
Columns (jaxserve/host_memory.py): the peak resident memory of the process during the load, the
part the load added, and the parameter bytes the process's devices hold. On CPU device memory
is host memory, so that last part is inside the peak; what is left is the loader's overhead.
On TPU or GPU hosts the device part moves off the host. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(model: str, dtype: str, tp: int) -> None:
    """One process of one case: load, print LOAD {json}."""
    from sharding.mesh import initialize_distributed, make_mesh
    initialize_distributed()  # from JAXSERVE_* when the case has several processes
    import jax

    from jaxserve import loading
    from jaxserve.model.llama import flat_params
    mesh = make_mesh(tp=tp) if tp > 1 else None
    lm = loading.load(model, dtype, mesh)
    held = sum(s.data.nbytes for a in jax.tree.leaves(flat_params(lm.model, unpack=False))
               for s in a.addressable_shards)
    m = lm.load_memory
    print("LOAD " + json.dumps({"process": jax.process_index(), "peak_mib": round(m.peak_bytes / 2**20),
                                "added_mib": round(m.added_bytes / 2**20), "devices_hold_mib": round(held / 2**20),
                                "exact": m.exact, "load_s": round(lm.load_s, 1)}), flush=True)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def run_case(model: str, dtype: str, tp: int, processes: int) -> list[dict]:
    devices_per_process = tp // processes
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    for k in ("JAXSERVE_COORDINATOR", "JAXSERVE_NUM_PROCESSES", "JAXSERVE_PROCESS_ID", "JAXSERVE_DISTRIBUTED"):
        env.pop(k, None)
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env.update(JAXSERVE_COORDINATOR=f"127.0.0.1:{s.getsockname()[1]}", JAXSERVE_NUM_PROCESSES=str(processes))
    cmd = [sys.executable, __file__, "--worker", model, "--dtype", dtype, "--tp", str(tp)]
    procs = [subprocess.Popen(cmd, env=dict(env, JAXSERVE_PROCESS_ID=str(i)) if processes > 1 else env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    rows = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith("LOAD ")]
            if p.returncode != 0 or not lines:
                raise SystemExit(f"load_memory: case tp={tp} x {processes} processes failed:\n{err[-3000:]}")
            rows.append(json.loads(lines[-1][5:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="HF checkpoint folder (safetensors)")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gguf", default=None, help="also load this GGUF file whole ('default': the embedded model)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.model, args.dtype, args.tp)
    cases = [("full-host", args.model, 1, 1)]
    if args.gguf:
        import checkpoints
        gguf = str(checkpoints.resolve_model_path(None if args.gguf == "default" else args.gguf))
        cases.append(("full-host GGUF", gguf, 1, 1))
    cases += [(f"sharded tp={args.tp}", args.model, args.tp, 1),
              (f"sharded tp={args.tp}, {args.tp} processes", args.model, args.tp, args.tp)]
    result = []
    print(f"{'case':<28} {'process':>7} {'peak MiB':>9} {'added MiB':>10} {'devices hold MiB':>17}")
    for name, model, tp, processes in cases:
        for r in run_case(model, args.dtype, tp, processes):
            print(f"{name:<28} {r['process']:>7} {r['peak_mib']:>9} {r['added_mib']:>10} {r['devices_hold_mib']:>17}"
                  + ("" if r["exact"] else "  (upper bound)"), flush=True)
            result.append({"case": name, **r})
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
