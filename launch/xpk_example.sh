#!/usr/bin/env bash
# The same `k3jax train` through xpk (GKE): multi-slice, restarts and queueing handled by the
# cluster. Build an image with the repo installed (`pip install 'jax[tpu]' -e '.[gcs]'`), push it,
# then create the workload. With --num-slices 2 use a mesh preset whose `dcn:` joins the
# slices (configs/meshes/v5p-1024x2.yaml): load_mesh puts that axis outermost.
#
# The converted checkpoint is read through a gcsfuse mount of the bucket (CKPT, a local path
# in the container); the run directory is written to gs:// directly.
#
#   CLUSTER=my-cluster IMAGE=gcr.io/PROJECT/k3jax:latest BUCKET=gs://BUCKET \
#     CKPT=/gcs/BUCKET/k3-orbax launch/xpk_example.sh
set -euo pipefail
CLUSTER=${CLUSTER:?set CLUSTER}
IMAGE=${IMAGE:?set IMAGE (a container with k3jax installed)}
BUCKET=${BUCKET:?set BUCKET (gs:// URL for the run directory)}
CKPT=${CKPT:?set CKPT (the converted checkpoint at a mounted path, e.g. /gcs/BUCKET/k3-orbax)}
python3 -m xpk workload create \
  --cluster "$CLUSTER" \
  --workload "k3-ft-$(date +%m%d-%H%M)" \
  --tpu-type v5p-1024 \
  --num-slices 2 \
  --docker-image "$IMAGE" \
  --command "k3jax train configs/k3.yaml --mesh v5p-1024x2 --distributed on \
init_from=$CKPT output_dir=$BUCKET/runs run_name=k3-ft steps=1000"
