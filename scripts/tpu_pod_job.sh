#!/usr/bin/env bash
# Run jaxserve on every host of a TPU pod slice: one JAX process per host, one global mesh.
#
#   scripts/tpu_pod_job.sh TPU_NAME ZONE [PROJECT] -- <jaxserve command and flags>
#
# Examples on a v5e-16 slice (4 hosts x 4 chips):
#   serving, one 16-chip mesh; worker 0 serves gRPC, the others step in lockstep with it:
#     scripts/tpu_pod_job.sh my-v5e-16 us-west4-a -- jaxserve serve --model DIR --tp 16 --host 0.0.0.0
#   offline batch, every host a tp=4 replica over its own chips with its own shard of the input:
#     scripts/tpu_pod_job.sh my-v5e-16 us-west4-a -- python scripts/generate_batch.py in.jsonl out.jsonl --tp 4
#
# On TPU VMs jax.distributed.initialize() finds the coordinator, process count and process id
# by itself, so each host's command is identical: this script sets JAXSERVE_DISTRIBUTED=auto,
# and jaxserve (sharding/mesh.py) then calls it. Elsewhere set JAXSERVE_COORDINATOR,
# JAXSERVE_NUM_PROCESSES and JAXSERVE_PROCESS_ID (or serve's --coordinator flags) instead.
# Every host must run the same code and configuration: a server's processes check it at start.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,16p' "$0"
  exit 2
fi
TPU_NAME=$1; ZONE=$2; shift 2
PROJECT_FLAG=()
if [ "$1" != "--" ]; then PROJECT_FLAG=(--project "$1"); shift; fi
[ "$1" = "--" ] && shift
CMD=$(printf '%q ' "$@")
# The repository is expected at ~/jaxserve on every worker (gcloud ... scp --worker=all puts it there).
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd ~/jaxserve && make setup >/dev/null && . .venv/bin/activate && JAXSERVE_DISTRIBUTED=auto $CMD"
