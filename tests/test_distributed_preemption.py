"""Preemption of a two-process job: SIGTERM to one process, both save the step they agree on
and exit with PREEMPTED; the same two commands again resume and finish with the losses of an
uninterrupted run.

The two processes are started like two hosts of a pod (the explicit env-var launch, CPU
collectives over gloo, one device each, the `fsdp` mesh over both, so every checkpoint holds
shards written by both). The reference is one process driving two devices with the same
mesh and command, started alongside (test_distributed.py holds the two layouts to the same
losses). A 1-layer variant and XLA's fast-compile flags keep the compiles short; the
persistent compilation cache lets the rerun skip most of them.

jax's SIGTERM handler is polled once a second, a hundred steps of this model on a fast
machine; so that the agreed step falls mid-run on any machine, the peer is stopped
(SIGSTOP) while the notice travels, which holds both processes at their next collective.
"""
import pytest
import os
import re
import signal
import subprocess
import sys
import time

from k3jax.config import CONFIG_DIR
from k3jax.train.preemption import PREEMPTED
from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE
from test_distributed import TOL, free_port, metrics

REPO = os.path.dirname(CONFIG_DIR)
STEPS = 12
TRAIN = {"steps": STEPS, "log_every": 1, "ckpt_every": 1000, "keep": 3, "sample_tokens": 0, "peak_tflops": 1.0,
         "data": {"path": os.path.join(REPO, "data", "corpus.txt"), "seq_len": 16, "batch_size": 2},
         "optimizer": {"warmup_steps": 2}, "runtime": {"kda_impl": "recurrent"}}


def start(tmp_path, cfg, name, log_name, devices, extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", K3JAX_COMPILE_CACHE=str(tmp_path / "xla"),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}", **extra_env)
    cmd = [sys.executable, "-m", "k3jax.cli", "train", cfg, "--mesh", "fsdp",
           f"output_dir={tmp_path}", f"run_name={name}"]
    log = open(tmp_path / log_name, "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log


def wait_all(procs, timeout):
    t = time.time()
    try:
        return [p.wait(timeout=max(1.0, timeout - (time.time() - t))) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


def logged_step(run_dir) -> int:
    try:
        return max((m["step"] for m in metrics(run_dir)), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_sigterm_to_one_process_saves_one_agreed_step_and_resumes(tmp_path):
    cfg = write_variant(str(tmp_path / "tiny.yaml"), layers=("kda",), train=TRAIN)
    pod = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    two = lambda tag: [start(tmp_path, cfg, "two", f"two.{i}.{tag}.log", 1,  # noqa: E731
                             {**pod, "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731

    ref = [start(tmp_path, cfg, "one", "one.log", 2, {})]
    procs = two("a")
    try:
        t = time.time()
        while logged_step(tmp_path / "two") < 2:
            assert all(p.poll() is None for p, _ in procs), [read(f"two.{i}.a.log")[-3000:] for i in range(2)]
            assert time.time() - t < 600, "the two processes did not reach step 2"
            time.sleep(0.05)
        procs[0][0].send_signal(signal.SIGSTOP)
        procs[1][0].send_signal(signal.SIGTERM)      # the process that does not log
        t_term = time.time()
        time.sleep(2.0)
        procs[0][0].send_signal(signal.SIGCONT)
        rcs = wait_all(procs, timeout=120)
        waited = time.time() - t_term
    finally:
        wait_all(procs, timeout=1)
    logs = [read(f"two.{i}.a.log") for i in range(2)]
    out = "\n".join(f"--- process {i}\n{text[-3000:]}" for i, text in enumerate(logs))
    assert rcs == [PREEMPTED, PREEMPTED], out
    assert waited < 60, (waited, out)
    saved = [re.findall(r"SIGTERM: saved step (\d+)", text) for text in logs]
    assert saved[0] and saved[0] == saved[1], out           # both saved, the same step
    step = int(saved[0][0])
    assert 2 <= step < STEPS, out
    ckpts = sorted(int(d) for d in os.listdir(tmp_path / "two" / "checkpoints") if d.isdigit())
    assert ckpts == [step], (ckpts, out)                    # one checkpoint: the agreed step

    rcs = wait_all(two("b"), timeout=600)                   # the same two commands again
    logs = [read(f"two.{i}.b.log") for i in range(2)]
    out = "\n".join(f"--- process {i}\n{text[-3000:]}" for i, text in enumerate(logs))
    assert rcs == [0, 0], out
    assert f"resumed from step {step}" in logs[0], out

    assert wait_all(ref, timeout=600) == [0], read("one.log")[-3000:]
    got, want = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
