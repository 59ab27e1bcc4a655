"""Two local processes × 4 CPU devices run `k3jax train` the way a pod's hosts do.

Each process is started like one host of a pod: the same command line with `--distributed
on`, and only the coordinator address, process count and process id in its environment;
CPU collectives go over gloo. Their 8 devices form the same mesh preset as a single-process
8-device run of the same command, started alongside, and the logged losses and the
checkpointed params must agree.

All three runs compile the train step once each, concurrently; the XLA flags below trade
generated-code speed for compile time (the same for all three, so the comparison holds), and
the model is the toy cut to one KDA and one MLA layer, both MoE (what crosses processes is
the same: 'ep' all-to-alls and ZeRO-3 gathers; the compile is 5x shorter than the toy's 13).
"""
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from k3jax.config import CONFIG_DIR
from k3jax.mesh import MESH_DIR
from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE

REPO = os.path.dirname(CONFIG_DIR)
PRESET = "expert8"   # the expert axis spans both processes: "ep" all-to-alls and ZeRO-3 gathers cross them
# 2 short steps
OVERRIDES = ["steps=2", "log_every=1", "ckpt_every=2", "data.seq_len=16", "sample_tokens=0",
             "peak_tflops=1", "runtime.kda_impl=recurrent"]
TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def restore_params(run_dir, step: int):
    """The checkpointed params onto one device, whichever devices and processes wrote them."""
    path = os.path.join(run_dir, "checkpoints", str(step), "default")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckpt:
        tree = dict(ckpt.metadata(path).item_metadata)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
        return jax.tree.map(np.asarray, ckpt.restore(path, target)["params"])


def preset_with_runtime(tmp_path) -> str:
    """expert8 carrying a runtime setting, as b300x8_train carries its exchange buffer:
    every process's run takes it (and writes it into the run's config.yaml)."""
    path = tmp_path / "expert8_buffered.yaml"
    path.write_text((pathlib.Path(MESH_DIR) / f"{PRESET}.yaml").read_text() + "runtime: {ep_buffer_mib: 64}\n")
    return str(path)


def launch(tmp_path, cfg: str, name: str, local_devices: int, extra_env: dict, distributed: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices} "
               + FAST_COMPILE, **extra_env)
    cmd = [sys.executable, "-m", "k3jax.cli", "train", cfg, "--mesh", preset_with_runtime(tmp_path),
           "--distributed", distributed, "--no-compile-cache", *OVERRIDES,
           f"output_dir={tmp_path}", f"run_name={name.split('.')[0]}"]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    cfg = write_variant(str(tmp_path / "two_layers.yaml"), layers=("kda", "mla"), first_k_dense_replace=0)
    port = free_port()
    pod = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    runs = [launch(tmp_path, cfg, f"two.{i}", 4, {**pod, "JAX_PROCESS_ID": str(i)}, "on") for i in range(2)]
    runs.append(launch(tmp_path, cfg, "one", 8, {"JAX_LOG_COMPILES": "1"}, "off"))
    try:
        rcs = [p.wait(timeout=900) for p, _ in runs]
    finally:
        for p, log in runs:
            if p.poll() is None:
                p.kill()
            log.close()
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("two.0", "two.1", "one")}
    out = "\n".join(f"--- {n}\n{text[-3000:]}" for n, text in logs.items())
    assert rcs == [0, 0, 0], out
    assert "over 2 process(es)" in logs["two.0"] and "over 1 process(es)" in logs["one"], out
    assert all("runtime from mesh expert8_buffered: ep_buffer_mib=64" in logs[n] for n in ("two.0", "one")), out
    for run in ("one", "two"):
        assert yaml.safe_load((tmp_path / run / "config.yaml").read_text())["train"]["runtime"]["ep_buffer_mib"] == 64
    # the step's state shardings are pinned: one compile serves both steps
    assert logs["one"].count("Compiling jit(sharded_train_step)") == 1, out

    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    # one line per logged step: the second process wrote none
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2], out
    for a, b in zip(two, one):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), (a["loss"], b["loss"])

    # each process wrote its own shards of the step-2 checkpoint: together they hold the
    # same params. One vector, as for the gradients in test_sharding: per leaf, Adam's
    # m/sqrt(v) on near-cancelling gradients (AttnRes vectors two steps from zero) is itself
    # fp32 noise at 1.5e-5, while a lost or misplaced shard moves this by orders more.
    p1, p2 = restore_params(tmp_path / "one", 2), restore_params(tmp_path / "two", 2)
    assert jax.tree.structure(p1) == jax.tree.structure(p2)
    flat = lambda t: np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(t)])  # noqa: E731
    a, b = flat(p2), flat(p1)
    assert np.linalg.norm(a - b) <= TOL * np.linalg.norm(b), np.linalg.norm(a - b) / np.linalg.norm(b)
