"""The model flags every entry point takes (`jaxserve generate`, `serve`, `convert`,
scripts/generate_batch.py, bench_generate.py, bench_offline.py), defined once.

Standard library only: building a parser must stay instant (no jax import).
"""

from __future__ import annotations

import argparse

from jaxserve.config import DTYPES, QUANTIZE_GROUP_SIZES, QUANTIZE_MODES

QUANT_IMPL_HELP = ("quantized matmul implementation: auto (TPU pallas_tpu, GPU pallas_gpu, CPU xla), "
                   "xla, ref, pallas_tpu, pallas_gpu, pallas_tpu_interpret, pallas_gpu_interpret")


def add_quantize_args(p) -> None:
    """--quantize and --quantize-group-size."""
    p.add_argument("--quantize", default="none", choices=QUANTIZE_MODES,
                   help="weight format: none = float in --dtype (a GGUF is dequantized; the default); "
                        "int8 / int4 = round to nearest at load; as-shipped = a GGUF's own Q8_0/Q4_0/Q4_1 "
                        "blocks, repacked with no float round trip (GGUF only)")
    p.add_argument("--quantize-group-size", type=int, default=None, metavar="G",
                   help=f"inputs per scale for int8/int4: one of {list(QUANTIZE_GROUP_SIZES)}, or 0 for int8 "
                        f"per channel (default: int4 32, int8 the largest dividing every input width)")


def add_model_args(p, dtypes: tuple[str, ...] = DTYPES) -> None:
    """--model, --dtype, --quantize, --quantize-group-size, --quant-impl."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint folder, .gguf file or Orbax folder from `jaxserve convert --to orbax` "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=dtypes, help="activations and float weights dtype")
    add_quantize_args(p)
    p.add_argument("--quant-impl", default="auto", metavar="IMPL", help=QUANT_IMPL_HELP)


def load_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of jaxserve.loading.load (and jaxserve.LLM) these flags set."""
    return dict(quantize=args.quantize, quantize_group_size=args.quantize_group_size,
                quant_impl=args.quant_impl)
