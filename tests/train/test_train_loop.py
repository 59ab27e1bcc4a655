"""`k3jax train` end to end on a 2-layer K3 variant, as subprocesses: kill -9 then resume
gives the uninterrupted losses; SIGTERM saves and exits 42 (PREEMPTED); a non-finite loss stops with the
last good checkpoint. One XLA compilation cache is shared so only the first run compiles."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from k3jax.train.preemption import PREEMPTED
from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = {"steps": 6, "log_every": 1, "ckpt_every": 2, "keep": 10, "sample_tokens": 0, "peak_tflops": 1.0,
         "data": {"path": os.path.join(ROOT, "data", "corpus.txt"), "seq_len": 32, "batch_size": 2},
         "optimizer": {"warmup_steps": 2}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    cfg = write_variant(str(d / "tiny.yaml"), layers=("kda", "mla"), train=TRAIN)
    env = dict(os.environ, K3JAX_COMPILE_CACHE=str(d / "xla"), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    return d, cfg, env


def cmd(cfg, out, name, *extra):
    return [sys.executable, "-m", "k3jax.cli", "train", cfg, f"output_dir={out}", f"run_name={name}", *extra]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def wait_for_step(run_dir, step, proc, timeout=600):
    path = os.path.join(run_dir, "metrics.jsonl")
    t = time.time()
    while time.time() - t < timeout:
        if os.path.exists(path) and any(json.loads(x)["step"] >= step for x in open(path) if x.strip()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


@pytest.mark.slow
def test_kill9_resume_matches_uninterrupted(setup):
    d, cfg, env = setup
    full = subprocess.run(cmd(cfg, d, "full"), env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stdout + full.stderr
    ref = losses(d / "full")
    assert sorted(ref) == list(range(1, 7))
    assert os.path.exists(d / "full" / "config.yaml")

    p = subprocess.Popen(cmd(cfg, d, "killed"), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for_step(d / "killed", 5, p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    again = subprocess.run(cmd(cfg, d, "killed"), env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step" in again.stdout
    assert losses(d / "killed") == ref          # bit-identical curve, no duplicate steps


@pytest.mark.slow
def test_sigterm_saves_and_exits_for_a_restart(setup):
    d, cfg, env = setup
    p = subprocess.Popen(cmd(cfg, d, "term", "steps=1000", "ckpt_every=1000"), env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(d / "term", 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == PREEMPTED == 42, out      # the code xpk restarts on and the sbatch requeues on
    assert "SIGTERM: saved step" in out
    saved = [int(x) for x in os.listdir(d / "term" / "checkpoints") if x.isdigit()]
    assert saved and max(saved) >= 2 and max(saved) < 1000


@pytest.mark.slow
def test_nonfinite_loss_stops_with_last_good_checkpoint(setup):
    d, cfg, env = setup
    r = subprocess.run(cmd(cfg, d, "nan", "optimizer.lr=1e30", "optimizer.adam_lr=1e30", "ckpt_every=1",
                           "optimizer.warmup_steps=0", "optimizer.grad_clip=0"),
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "non-finite" in r.stdout
    recs = [json.loads(x) for x in open(d / "nan" / "metrics.jsonl")]
    bad = next(x["step"] for x in recs if x.get("nonfinite"))
    saved = sorted(int(x) for x in os.listdir(d / "nan" / "checkpoints") if x.isdigit())
    assert saved and saved[-1] == bad - 1       # the non-finite step was never checkpointed


def _raw_tensor(path, name):
    """One F32 tensor of a safetensors file, read with nothing but struct/json/numpy."""
    import struct

    import numpy as np

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start, end = header[name]["data_offsets"]
        f.seek(8 + n + start)
        return np.frombuffer(f.read(end - start), np.float32).reshape(header[name]["shape"])


def test_init_from_starts_at_the_converted_weights(tmp_path):
    """`init_from` (an HF directory here; a converted Orbax one goes through the same
    loader) gives the run the checkpoint's weights, and refuses a checkpoint of another model."""
    import numpy as np

    from helpers import SHARED, need
    from k3jax.config import ModelConfig
    from k3jax.train import config as tconf
    from k3jax.train.loop import _initial_params

    src = need(SHARED / "fixtures" / "fixture_a")
    cfg = ModelConfig.from_hf(src / "config.json")
    tc = tconf.resolve({}, {"init_from": str(src)})
    cfg = cfg.with_runtime(**tc["runtime"])
    params = _initial_params(cfg, tc, key=None)
    want = _raw_tensor(src / "model.safetensors", "language_model.model.embed_tokens.weight")
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]["embedding"]), want)
    want = _raw_tensor(src / "model.safetensors", "language_model.lm_head.weight")
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]).T, want)

    other = cfg.replace(hidden_size=cfg.hidden_size * 2)
    with pytest.raises(ValueError, match="differs from the run's config"):
        _initial_params(other, tc, key=None)
