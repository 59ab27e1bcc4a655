#!/usr/bin/env bash
# `k3jax train` on a Cloud TPU VM pod slice, from a laptop: every step runs on all workers.
#
#   launch/tpu_pod.sh [--dry-run] COMMAND TPU_NAME ZONE [ARGS]
#     create  TPU ZONE [ACCELERATOR [RUNTIME]]  queue the slice (queued resources; default
#                                               v5p-1024, v2-alpha-tpuv5; SPOT=1 or RESERVED=1)
#     status  TPU ZONE                          the queued resource's state (ACTIVE = ready)
#     setup   TPU ZONE                          ship this commit (git archive, with uncommitted
#                                               edits of tracked files), a Python 3.11 venv (uv)
#                                               and `pip install 'jax[tpu]' -e .` on every worker
#     mount   TPU ZONE BUCKET                   gcsfuse: gs://BUCKET at /gcs/BUCKET on every worker
#     train   TPU ZONE CONFIG MESH [key=value]  start the job detached on every worker (it
#                                               survives closing the laptop); log ~/k3jax-train.log
#     logs    TPU ZONE [WORKER|all]             follow worker 0's log (or WORKER's; all: last lines)
#     stop    TPU ZONE                          SIGTERM: the workers save the step they agree on
#                                               and exit 42; `train` again resumes from it
#     clean   TPU ZONE                          kill what is left and free the TPU (stale holders
#                                               of /dev/accel* and /dev/vfio/*, libtpu's lockfile)
#     delete  TPU ZONE                          delete the queued resource and its slice
#   --dry-run prints every command (and each remote script) instead of running it.
#
# Environment: PROJECT (default: gcloud's configured project; must be non-empty), PYTHON
# (3.11), VENV (~/k3jax-venv on the workers), GRACE (seconds `stop` waits, default 900),
# DISTRIBUTED (default on: a worker that cannot find its pod fails instead of training alone).
# Checkpoints and the run directory go to gs:// directly (output_dir=gs://BUCKET/runs: Orbax
# writes through tensorstore, the small files through etils/gcsfs); init_from is a local path,
# so the converted checkpoint is read through the gcsfuse mount (init_from=/gcs/BUCKET/k3-orbax).
set -eo pipefail

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
usage() { sed -n '2,26p' "$0" >&2; exit 2; }
[ $# -ge 3 ] || usage
CMD=$1 TPU_NAME=$2 ZONE=$3
shift 3

if [ -z "${PROJECT:-}" ]; then
  PROJECT=$(gcloud config get-value project 2>/dev/null || true)
fi
if [ -z "$PROJECT" ] || [ "$PROJECT" = "(unset)" ]; then
  echo "no Google Cloud project: set PROJECT=... or run 'gcloud config set project ...'" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-3.11}
GRACE=${GRACE:-900}
if [ -n "${VENV:-}" ]; then VENV=$(printf '%q' "$VENV"); else VENV="\$HOME/k3jax-venv"; fi
GC=(gcloud compute tpus --project "$PROJECT" --zone "$ZONE")

run() {   # a local command
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

remote() {   # remote WORKERS SCRIPT: the script under bash -eo pipefail on those workers
  # the workers' paths: the code, the venv, the job's script, log and pid
  local script="set -eo pipefail
export SRC=\$HOME/k3jax VENV=$VENV JOB=\$HOME/k3jax-job.sh LOG=\$HOME/k3jax-train.log PIDFILE=\$HOME/k3jax-train.pid
export SUDO=sudo; if [ \"\$(id -u)\" = 0 ]; then SUDO=; fi   # root (a container) has no sudo
$2"
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "${GC[@]}" tpu-vm ssh "$TPU_NAME" --worker="$1" --command; echo "<<'REMOTE'"
    printf '%s\n' "$script" "REMOTE"
  else
    "${GC[@]}" tpu-vm ssh "$TPU_NAME" --worker="$1" --command "bash -c $(printf '%q' "$script")"
  fi
}

case "$CMD" in
create)
  flags=()
  if [ "${SPOT:-0}" = 1 ]; then flags+=(--spot); fi
  if [ "${RESERVED:-0}" = 1 ]; then flags+=(--reserved); fi
  run "${GC[@]}" queued-resources create "$TPU_NAME" --node-id "$TPU_NAME" \
    --accelerator-type "${1:-v5p-1024}" --runtime-version "${2:-v2-alpha-tpuv5}" "${flags[@]}"
  echo "queued; 'launch/tpu_pod.sh status $TPU_NAME $ZONE' says ACTIVE when the slice is up" ;;
status)
  run "${GC[@]}" queued-resources describe "$TPU_NAME" --format='value(state.state)' ;;
setup)
  # tracked files as they are now (uncommitted edits included); untracked ones stay behind
  ref=$(git -C "$REPO" stash create 2>/dev/null || true)
  ref=${ref:-HEAD}
  tgz=/tmp/k3jax-src-$(git -C "$REPO" rev-parse --short HEAD).tgz
  run git -C "$REPO" archive --format=tar.gz -o "$tgz" "$ref"
  run "${GC[@]}" tpu-vm scp "$tgz" "$TPU_NAME":/tmp/k3jax-src.tgz --worker=all
  remote all "
# stock TPU VM images ship Python 3.10; k3jax needs >= 3.11: a uv-managed interpreter
if ! command -v uv > /dev/null && [ ! -x \"\$HOME/.local/bin/uv\" ]; then
  curl -LsSf https://astral.sh/uv/install.sh | sh > /dev/null
fi
UV=\$(command -v uv || echo \"\$HOME/.local/bin/uv\")
rm -rf \"\$SRC.new\" && mkdir \"\$SRC.new\" && tar -xzf /tmp/k3jax-src.tgz -C \"\$SRC.new\"
rm -rf \"\$SRC\" && mv \"\$SRC.new\" \"\$SRC\"
[ -x \"\$VENV/bin/python\" ] || \"\$UV\" venv --python $PYTHON \"\$VENV\"
\"\$VENV/bin/python\" -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
cd \"\$SRC\"
if ! \"\$UV\" pip install --python \"\$VENV/bin/python\" 'jax[tpu]' -e '.[gcs,tokenizer]' > \"\$HOME/k3jax-setup.log\" 2>&1; then
  tail -n 40 \"\$HOME/k3jax-setup.log\"; echo \"\$(hostname): install failed (\$HOME/k3jax-setup.log)\" >&2; exit 1
fi
echo \"\$(hostname): \$(\"\$VENV/bin/python\" -c 'import jax, k3jax; print(\"jax\", jax.__version__)')\"" ;;
mount)
  [ $# -ge 1 ] || usage
  bucket=${1#gs://}
  remote all "
if ! command -v gcsfuse > /dev/null; then
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | \$SUDO tee /usr/share/keyrings/cloud.google.asc > /dev/null
  echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\" \\
    | \$SUDO tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null
  \$SUDO apt-get update -q > /dev/null && \$SUDO apt-get install -y -q gcsfuse > /dev/null
fi
\$SUDO mkdir -p /gcs/$bucket && \$SUDO chown \"\$USER\" /gcs/$bucket
mountpoint -q /gcs/$bucket || gcsfuse --implicit-dirs $bucket /gcs/$bucket
echo \"\$(hostname): gs://$bucket at /gcs/$bucket\"" ;;
train)
  [ $# -ge 2 ] || usage
  config=$1 mesh=$2
  shift 2
  args=$(printf ' %q' "$config" --mesh "$mesh" --distributed "${DISTRIBUTED:-on}" "$@")
  remote all "
if [ -f \"\$PIDFILE\" ] && kill -0 \"\$(cat \"\$PIDFILE\")\" 2> /dev/null; then
  echo \"\$(hostname): a job is running (pid \$(cat \"\$PIDFILE\")): 'stop' or 'clean' it first\" >&2; exit 1
fi
# the job as a file, run detached from this ssh session (it survives a closed laptop);
# it records the trainer's pid for stop / clean and its exit code in the log
cat > \"\$JOB\" << 'END_OF_JOB'
cd \"\$SRC\"
\"\$VENV/bin/k3jax\" train$args &
echo \$! > \"\$PIDFILE\"
wait \$!
echo \"k3jax train exited \$?\"
END_OF_JOB
nohup setsid bash \"\$JOB\" > \"\$LOG\" 2>&1 < /dev/null &
sleep 1; echo \"\$(hostname): started (log \$LOG)\"" ;;
logs)
  worker=${1:-0}
  if [ "$worker" = all ]; then
    remote all "echo \"== \$(hostname)\"; tail -n 5 \"\$LOG\""
  else
    remote "$worker" "tail -n 200 -F \"\$LOG\""
  fi ;;
stop)
  remote all "
pid=\$(cat \"\$PIDFILE\" 2> /dev/null || true)
if [ -z \"\$pid\" ] || ! kill -0 \"\$pid\" 2> /dev/null; then echo \"\$(hostname): no job running\"; exit 0; fi
kill -TERM \"\$pid\"
for _ in \$(seq $GRACE); do kill -0 \"\$pid\" 2> /dev/null || break; sleep 1; done
tail -n 2 \"\$LOG\"" ;;
clean)
  remote all "
pid=\$(cat \"\$PIDFILE\" 2> /dev/null || true)
if [ -n \"\$pid\" ] && kill -0 \"\$pid\" 2> /dev/null; then
  kill -TERM \"\$pid\"; sleep 10; kill -KILL \"\$pid\" 2> /dev/null || true
fi
rm -f \"\$PIDFILE\"
shopt -s nullglob
# processes holding a TPU device file (a crashed run's python keeps the chips); never call
# lsof / fuser without device arguments: that would list every process on the machine
devices=(/dev/accel[0-9]* /dev/vfio/[0-9]*)
if [ \${#devices[@]} -gt 0 ]; then
  mapfile -t holders < <(\$SUDO fuser \"\${devices[@]}\" 2> /dev/null | tr -s ' ' '\\n' | grep -E '^[0-9]+\$' | grep -vx \"\$\$\" | sort -u || true)
  if [ \${#holders[@]} -gt 0 ]; then
    echo \"\$(hostname): killing TPU holders:\"; ps -o pid,args -p \"\$(IFS=,; echo \"\${holders[*]}\")\" || true
    \$SUDO kill -9 \"\${holders[@]}\" || true
  fi
fi
\$SUDO rm -f /tmp/libtpu_lockfile
echo \"\$(hostname): clean\"" ;;
delete)
  run "${GC[@]}" queued-resources delete "$TPU_NAME" --force --quiet ;;
*)
  usage ;;
esac
