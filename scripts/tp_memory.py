"""Per-device parameter and KV-cache memory under tensor parallelism, computed from a config.

    python scripts/tp_memory.py [--model PATH] [--dtype bfloat16]

Prints a table for tp = 1, 2, 3, 4, 8 for the given model (default: the embedded SmolLM2) and for
Llama-3-8B (its published config), using the same rules the engine shards with
(sharding/rules.py), KV-head replication included. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.model.llama import param_axes, param_shapes  # noqa: E402
from sharding import rules  # noqa: E402

LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        max_position_embeddings=8192, rope_theta=500000.0)


@dataclasses.dataclass
class _Mesh:  # what rules.spec_for reads of a mesh
    shape: dict


def per_device(cfg: ModelConfig, tp: int, itemsize: int) -> dict:
    try:
        copies = rules.kv_replication(cfg.num_heads, cfg.num_kv_heads, tp)
        tcfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * copies)
        mesh = _Mesh({"tp": tp, "dp": 1})
        axes, shapes = param_axes(tcfg), param_shapes(tcfg)
        total = 0
        for k, shape in shapes.items():
            spec = rules.spec_for(axes[k], shape, mesh, k)
            split = math.prod(tp for p in spec if p == "tp")
            total += math.prod(shape) // split
    except ValueError as e:
        return {"tp": tp, "error": str(e)}
    kv_heads_per_device = tcfg.num_kv_heads // tp
    kv_per_token = 2 * cfg.num_layers * kv_heads_per_device * cfg.head_dim * itemsize
    return {"tp": tp, "param_bytes": total * itemsize, "kv_bytes_per_token": kv_per_token,
            "kv_head_copies": copies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    import checkpoints
    itemsize = 4 if args.dtype == "float32" else 2
    models = {checkpoints.resolve_model_path(args.model).name: checkpoints.load_params(args.model).config
              if args.model else _default_config(), "Llama-3-8B": LLAMA3_8B}
    result = {}
    for name, cfg in models.items():
        print(f"{name} ({args.dtype}): {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads")
        print(f"  {'tp':>3} {'params/device':>14} {'KV/token/device':>16}  KV copies")
        rows = [per_device(cfg, tp, itemsize) for tp in (1, 2, 3, 4, 8)]
        for r in rows:
            if "error" in r:
                print(f"  {r['tp']:>3}  not possible: {r['error']}")
            else:
                print(f"  {r['tp']:>3} {r['param_bytes'] / 2**20:>11.1f} MiB {r['kv_bytes_per_token'] / 1024:>12.2f} KiB  {r['kv_head_copies']}")
        result[name] = rows
    print("RESULT " + json.dumps(result))


def _default_config() -> ModelConfig:
    from checkpoints.gguf_loader import GGUFCheckpoint
    import checkpoints
    return GGUFCheckpoint(checkpoints.default_model_path()).config


if __name__ == "__main__":
    main()
