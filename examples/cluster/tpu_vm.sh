#!/bin/bash
# examples/cluster/train.py on every worker (host) of a Cloud TPU VM slice, one
# JAX process each. With --auto-detect, train.py calls
# jax.distributed.initialize() without arguments: JAX asks the TPU VM's metadata
# server for the workers, this one's id and the coordinator (worker 0).
# Run from the checkout: TPU_NAME=my-tpu ZONE=us-central2-b RUN_DIR=/mnt/runs/x \
#   examples/cluster/tpu_vm.sh
set -euo pipefail
TPU_NAME=${TPU_NAME:?set TPU_NAME to the TPU VM slice}
ZONE=${ZONE:?set ZONE to its zone}
# One directory every worker sees at the same path (e.g. a Filestore or NFS
# share mounted on each): the checkpoints of a multi-host run, and the resume.
RUN_DIR=${RUN_DIR:?set RUN_DIR to a directory on storage shared by the workers}

# Once: this checkout on every worker, installed with JAX's TPU build.
gcloud compute tpus tpu-vm scp --recurse "$PWD" "$TPU_NAME":pztrain \
  --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all \
  --command='pip install -e "./pztrain[examples]" "jax[tpu]"'

# The same command on all workers at once (--worker=all). After a preemption or
# a lost SSH session, run it again: resume=True goes on from the newest
# checkpoint in RUN_DIR.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all \
  --command="cd pztrain && python examples/cluster/train.py --auto-detect --run-dir $RUN_DIR --steps 20000"
