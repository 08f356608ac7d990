"""Weight-quantized matmul (int8, packed int4 with group scales): the pure-jnp reference and
the CPU path (reference.py), the TPU kernel (tpu.py), the GPU kernel (gpu.py), block sizes as
data (block_sizes.py). Layouts are described once, in reference.py."""

from pallas_kernels.quantized_matmul.reference import (  # noqa: F401
    BITS, INT4_GROUP_SIZES, dequantize, ref_quantized_matmul, unpack_int4, validate,
    xla_quantized_matmul)
