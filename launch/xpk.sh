#!/usr/bin/env bash
# `k3jax train` as a GKE workload through xpk (single- or multi-slice TPU; queueing,
# restarts and preemption handled by the cluster).
#
#   launch/xpk.sh [--dry-run] COMMAND [ARGS]
#     image                         build launch/Dockerfile from this commit (git archive) and push IMAGE
#     storage                       attach gs://BUCKET to CLUSTER as gcsfuse storage, mounted at /gcs/BUCKET
#     create CONFIG MESH [key=value ...]
#                                   xpk workload create: SLICES x TPU_TYPE, the storage, restarts, grace period
#     status                        xpk workload list for WORKLOAD
#     delete                        xpk workload delete
#   --dry-run prints the commands instead of running them.
#
# Environment: CLUSTER, PROJECT, ZONE, IMAGE (e.g. us-docker.pkg.dev/PROJECT/k3jax/k3jax:TAG),
# BUCKET (name, no gs://), TPU_TYPE (v5p-1024), SLICES (1; 2 with the v5p-1024x2 mesh),
# WORKLOAD (k3-sft), STORAGE (k3jax-gcs), MAX_RESTARTS (50), GRACE (600), PRIORITY (medium).
#
# Restarts: xpk's JobSet fails the workload on any exit code except 42 and 127-255, which
# restart it (up to --max-restarts, default 0 in xpk, so it is set here). k3jax exits 42
# after a preemption save, and a killed container 137; both come back and resume from the
# newest checkpoint. 0 (done), 2 (bad input) and 3 (non-finite loss) end it.
# Grace period: on preemption or eviction Kubernetes sends SIGTERM and kills after
# --termination-grace-period-seconds (xpk default 30). A K3 save on v5p-1024 writes ~122 GiB
# per host (512 chips x 30.5 GiB of bf16 params + fp32 Muon state / 128 hosts); at ~1 GB/s
# per host to GCS that is ~2 min, plus the step in flight and the agreement (< 5 s): 600 s
# leaves a margin of 4.
set -eo pipefail

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
usage() { sed -n '2,13p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
CMD=$1
shift

need() { for v in "$@"; do if [ -z "${!v:-}" ]; then echo "set $v (see launch/xpk.sh)" >&2; exit 2; fi; done; }
run() { if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
TPU_TYPE=${TPU_TYPE:-v5p-1024}
SLICES=${SLICES:-1}
WORKLOAD=${WORKLOAD:-k3-sft}
STORAGE=${STORAGE:-k3jax-gcs}
WHERE=()
if [ "$CMD" != image ]; then
  need CLUSTER PROJECT ZONE
  WHERE=(--cluster "$CLUSTER" --project "$PROJECT" --zone "$ZONE")
fi

case "$CMD" in
image)
  need IMAGE
  # exactly the committed tree (no runs/, no .git), the build context read from stdin
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' git -C "$REPO" archive --format=tar HEAD; printf '| '
    printf '%q ' docker build -f launch/Dockerfile -t "$IMAGE" -; echo
  else
    git -C "$REPO" archive --format=tar HEAD | docker build -f launch/Dockerfile -t "$IMAGE" -
  fi
  run docker push "$IMAGE" ;;
storage)
  need BUCKET
  run xpk storage attach "$STORAGE" --type=gcsfuse "${WHERE[@]}" --bucket="$BUCKET" \
    --mount-point="/gcs/$BUCKET" --readonly=false --auto-mount=false ;;
create)
  need IMAGE
  [ $# -ge 2 ] || usage
  config=$1 mesh=$2
  shift 2
  train=$(printf ' %q' "$config" --mesh "$mesh" --distributed on "$@")
  run xpk workload create "${WHERE[@]}" --workload "$WORKLOAD" \
    --tpu-type "$TPU_TYPE" --num-slices "$SLICES" --docker-image "$IMAGE" \
    --storage "$STORAGE" --max-restarts "${MAX_RESTARTS:-50}" \
    --termination-grace-period-seconds "${GRACE:-600}" --priority "${PRIORITY:-medium}" \
    --command "cd /app && k3jax train$train" ;;
status)
  run xpk workload list "${WHERE[@]}" --filter-by-job "$WORKLOAD" ;;
delete)
  run xpk workload delete "${WHERE[@]}" --workload "$WORKLOAD" ;;
*)
  usage ;;
esac
