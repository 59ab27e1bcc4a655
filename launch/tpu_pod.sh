#!/usr/bin/env bash
# Run `k3jax train` on every host of a TPU VM pod slice (single- or multi-slice via queued
# resources is xpk's job: see xpk_example.sh).
#
#   launch/tpu_pod.sh TPU_NAME ZONE CONFIG.yaml MESH [key=value ...]
#   e.g. launch/tpu_pod.sh k3-v5p-1024 us-east5-a configs/k3.yaml v5p-1024 \
#          init_from=/gcs/BUCKET/k3-orbax output_dir=gs://BUCKET/runs run_name=k3-ft steps=1000
#
# Every host runs the same command; `k3jax train` calls jax.distributed.initialize(), which
# on TPU VMs finds the coordinator and its process id from the TPU metadata by itself.
# output_dir must be shared by all hosts (gs://: every host writes its own shards);
# init_from is a local path every host reads, e.g. the bucket mounted with gcsfuse.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n 2,13p "$0"; exit 2
fi
TPU_NAME=$1 ZONE=$2 CONFIG=$3 MESH=$4; shift 4
PROJECT=${PROJECT:-$(gcloud config get-value project 2>/dev/null)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
REMOTE_DIR=${REMOTE_DIR:-k3jax}
TPU=(gcloud compute tpus tpu-vm --project "$PROJECT" --zone "$ZONE")

# 1. the working tree as a tarball (no .git, no runs/), unpacked on every worker
tar -C "$REPO" --exclude=.git --exclude=runs --exclude='*.egg-info' -czf /tmp/k3jax-src.tgz .
"${TPU[@]}" scp /tmp/k3jax-src.tgz "$TPU_NAME":/tmp/k3jax-src.tgz --worker=all
"${TPU[@]}" ssh "$TPU_NAME" --worker=all --command "
  set -e; mkdir -p ~/$REMOTE_DIR && tar -C ~/$REMOTE_DIR -xzf /tmp/k3jax-src.tgz
  cd ~/$REMOTE_DIR && python3 -m pip install -q -U 'jax[tpu]' -e '.[gcs]' 2>&1 | tail -2"

# 2. the job, on all workers at once; process 0's log is the one to read
ARGS=$(printf ' %q' "$@")
"${TPU[@]}" ssh "$TPU_NAME" --worker=all --command "
  cd ~/$REMOTE_DIR && export PATH=\$HOME/.local/bin:\$PATH &&
  k3jax train $CONFIG --mesh $MESH --distributed on $ARGS 2>&1 | tee /tmp/k3jax-train.log"
