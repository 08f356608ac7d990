"""One process of the two-process tensor-parallel test (tests/test_tensor_parallel.py).

Joins the job with jax.distributed (gloo collectives on CPU), builds a tp=4 engine over the
global 4-device mesh (2 devices here, 2 in the other process), generates greedily and prints
the tokens as one JSON line. Every process runs the same scheduler on the same requests, so
their step inputs agree without any broadcast.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(coordinator: str, num_processes: int, process_id: int) -> None:
    from sharding.mesh import initialize_distributed, make_mesh
    initialize_distributed(coordinator, num_processes, process_id)
    import jax

    from tp_cases import run_tiny_tp
    assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
    tokens = run_tiny_tp(tp=4, mesh=make_mesh(tp=4))
    print("TOKENS " + json.dumps(tokens), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
