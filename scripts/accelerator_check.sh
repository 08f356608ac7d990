#!/usr/bin/env bash
# One-shot accelerator check (issue 22) for one 10-minute call on a GPU / TPU machine:
# environment, bandwidth, attention and quantized-matmul kernels against references and
# baselines, as JSON lines in ${OUT:-.}/accelerator_check.jsonl (written as results come).
# Needs python3 with jax for the device (e.g. jax 0.11 + CUDA 12 on an H200); of this repo
# it imports only jax and numpy. Extra arguments go to the script,
# e.g. --only qmatmul.
# The script's own budget (540 s) leaves a minute of the call for start-up and copying back.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/accelerator_check.jsonl"
: > "$out"
timeout 590 python3 scripts/accelerator_check.py --out "$out" "$@"
rc=$?
echo "accelerator_check exit $rc; $(wc -l < "$out") records in $out"
exit $rc
