#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA H200 (issue 4): the GPU kernel tests compiled
# for the device (not interpreted), then the decode-attention benchmark in three settings.
# Needs a CUDA build of the same JAX (jax[cuda12]) in the active environment. About 5 minutes;
# results go to stdout and, as JSON lines, to ${OUT:-.}/bench_attention.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/bench_attention.jsonl"

python -c 'import jax; d = jax.devices()[0]; print(d.device_kind, getattr(d, "compute_capability", "?")); assert jax.default_backend() == "gpu"'

# Kernel against the XLA reference, compiled with Mosaic GPU for sm_90a.
JAXSERVE_NATIVE_KERNELS=1 timeout 300 python -m pytest -q -p no:cacheprovider tests/test_pallas_attention.py \
    -k "gpu_kernel_matches" || echo "GPU KERNEL TESTS FAILED"

# Decode attention: batch 64, context 2048, GQA 8:1, head dim 128, bf16 (the issue's target),
# then larger pages, then the int8 cache (pages of >= 64 tokens for the kernel's scale copies).
for flags in "" "--page-size 64" "--page-size 64 --kv-cache-dtype int8"; do
    timeout 120 python scripts/bench_attention.py $flags --json | tee -a "$out" || echo "BENCH FAILED: $flags"
done
