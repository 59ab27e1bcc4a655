"""What k3jax's directories hold, in one place (names only; no jax, no Orbax).

A `k3jax convert` output:

    config.json  params/  [mxfp4_scales/]  [vision/]  k3jax_checkpoint.json (written last)

A training run `{output_dir}/{run_name}` (k3jax.train.loop):

    config.yaml    the model config and the resolved train: section
    checkpoints/N  Orbax CheckpointManager steps; item `default` is the TrainState
                   {step, params, opt_state}
    metrics.jsonl  one JSON object per logged step
    run.lock       while a `k3jax train` runs on it (k3jax.train.rundir.RunLock)
"""
from __future__ import annotations

from pathlib import Path

MANIFEST = "k3jax_checkpoint.json"
FORMAT = "k3jax-orbax-1"

RUN_CONFIG = "config.yaml"
RUN_CHECKPOINTS = "checkpoints"
RUN_METRICS = "metrics.jsonl"
RUN_LOCK = "run.lock"
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
