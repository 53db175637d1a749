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

# Once: this checkout on every worker. Only its files, as git lists them (the
# tracked ones and new ones, local edits included): not .git, nor what
# .gitignore leaves out (the .venv of the installation page, runs/).
ARCHIVE=$(mktemp --suffix=.tar.gz)
trap 'rm -f "$ARCHIVE"' EXIT
git ls-files -z --cached --others --exclude-standard | tar -czf "$ARCHIVE" --null -T -
gcloud compute tpus tpu-vm scp "$ARCHIVE" "$TPU_NAME":pztrain.tar.gz \
  --zone="$ZONE" --worker=all
# Each worker: the checkout in ~/pztrain, an environment in ~/pztrain-venv with
# JAX's TPU build (the tpu extra).
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all \
  --command='rm -rf pztrain && mkdir pztrain && tar -xzf pztrain.tar.gz -C pztrain &&
    python3 -m venv pztrain-venv &&
    pztrain-venv/bin/pip install -e "./pztrain[examples,tpu]"'

# The same command on all workers at once (--worker=all), in that environment.
# After a preemption or a lost SSH session, run this command again (the lines
# above need not run twice): resume=True goes on from the newest checkpoint in
# RUN_DIR.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all \
  --command="cd pztrain && source ../pztrain-venv/bin/activate &&
    python examples/cluster/train.py --auto-detect --platform tpu --run-dir $RUN_DIR --steps 20000"
