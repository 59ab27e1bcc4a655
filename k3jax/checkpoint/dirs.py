"""What k3jax's directories hold, in one place (names only; no jax, no Orbax).

A `k3jax convert` output:

    config.json  params/  [mxfp4_scales/]  [vision/]  k3jax_checkpoint.json (written last)

A training run `{output_dir}/{run_name}` (k3jax.train.loop):

    config.yaml    the model config and the resolved train: section
    checkpoints/N  Orbax CheckpointManager steps; item `default` is the TrainState
                   {step, params, opt_state}
    metrics.jsonl  one JSON object per logged step
    run.lock       while a `k3jax train` runs on it (k3jax.train.rundir.RunLock)
    data_state/N   with data.loader: grain, each process's stream position at step N
"""
from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

MANIFEST = "k3jax_checkpoint.json"
FORMAT = "k3jax-orbax-1"

RUN_CONFIG = "config.yaml"
RUN_CHECKPOINTS = "checkpoints"
RUN_METRICS = "metrics.jsonl"
RUN_LOCK = "run.lock"
RUN_DATA_STATE = "data_state"  # data_state/N/process_P.json: a streamed loader's state at step N
STATE_ITEM = "default"        # the item a single `StandardSave` of the TrainState goes to
PARAMS_KEY = ("params",)      # where the params sit inside that item


def is_url(path) -> bool:
    return "://" in str(path)


def local_path(path, what: str) -> Path:
    """`path` as a local Path. Checkpoint directories are read and written with local file
    APIs (pathlib, tensorstore's file driver): a URL would silently become a local
    `gs:/...` directory, so it is refused with the way round it."""
    from k3jax.errors import K3JaxError
    if is_url(path):
        raise K3JaxError(f"{what} {path}: checkpoint directories must be local paths; mount the bucket "
                         f"(gcsfuse, e.g. /gcs/BUCKET/...) or use a shared filesystem. "
                         f"Training run directories (output_dir=) may be gs:// URLs.")
    return Path(path)


def checkpoint_steps(checkpoints_dir) -> list[int]:
    """The finished steps under a run's `checkpoints/`, oldest first. Orbax writes a step
    into a temporary name and renames it when complete on a local disk; on an object store
    it writes `commit_success.txt` last. Anything else (a write in progress, a write that
    failed) is not a step."""
    from etils import epath
    d = epath.Path(checkpoints_dir)
    if not d.is_dir():
        return []
    steps = []
    for p in d.iterdir():
        if p.name.isdigit() and ((p / "commit_success.txt").exists()
                                 or (not is_url(p) and (p / "_CHECKPOINT_METADATA").exists())):
            steps.append(int(p.name))
    return sorted(steps)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def temp_sibling(out: Path) -> Path:
    """Where a write of `out` is assembled before the rename: hidden, next to it, named with
    this host and pid so that a later run can tell a dead writer's leftovers."""
    return out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def stale_temp_siblings(out: Path) -> list[Path]:
    """Temporary siblings of `out` (`temp_sibling`) whose writer, on this host, is gone."""
    prefix = f".{out.name}.tmp-{socket.gethostname()}-"
    if not out.parent.is_dir():
        return []
    stale = []
    for p in out.parent.iterdir():
        pid = p.name[len(prefix):].split("-")[0] if p.name.startswith(prefix) else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.append(p)
    return sorted(stale)


def remove_stale_temps(out: Path, log=None) -> list[Path]:
    """Remove what a killed convert / export of `out` on this host left (`log` says so)."""
    import shutil
    stale = stale_temp_siblings(out)
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
        if log is not None:
            log(f"removed {p}: the temporary output of an interrupted run (pid gone)")
    return stale
