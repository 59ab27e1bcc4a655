"""A LoRA DPO run over fixture B's MXFP4 base, end to end as `k3jax train` subprocesses: its
first step is the reference's own (adapters start at B = 0, and the reference is the base
with them off: the loss is log 2), the loss falls, and (opt-in, K3JAX_LONG_TESTS=1) a run
stopped mid-way resumes to the same losses and metrics as the uninterrupted one. (Evaluation
is checked in test_dpo.py: its compiles would double this test's time.)"""
import json
import math
import os
import shutil

import pytest

from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE, FIXTURES, LONG, need, train_subprocess

PAIRS = [({"role": "user", "content": f"{mode}: {w}"}, w.upper() if mode == "Upper" else w,
          w if mode == "Upper" else w.upper()) for w in ("river", "stone") for mode in ("Upper", "Lower")]


def _write_pairs(path, pairs):
    with open(path, "w") as f:
        for prompt, good, bad in pairs:
            f.write(json.dumps({"prompt": [prompt], "chosen": [{"role": "assistant", "content": good}],
                                "rejected": [{"role": "assistant", "content": bad}]}) + "\n")
    return str(path)



def _first_run(tmp_path):
    """(config path, environment, metrics by step) of the first run, its own checks passed."""
    b = need(FIXTURES / "fixture_b")
    train = {"objective": "dpo", "steps": 3, "log_every": 1, "ckpt_every": 1, "keep": 10, "sample_tokens": 0,
             "peak_tflops": 1.0, "init_from": str(b),
             "data": {"path": _write_pairs(tmp_path / "train.jsonl", PAIRS), "format": "chat",
                      "seq_len": 216, "batch_size": 2, "chat": {"thinking": False, "thinking_effort": None}},
             "dpo": {"beta": 0.5},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"},
             "runtime": {"expert_format": "mxfp4"},
             "lora": {"rank": 4, "alpha": 8.0, "lr": 0.02}}
    cfg = write_variant(str(tmp_path / "b.yaml"), base=str(b / "config.json"), train=train)
    env = dict(os.environ, K3JAX_COMPILE_CACHE=str(tmp_path / "xla"), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    ref, out = train_subprocess(cfg, tmp_path, "run", env)
    assert "reference the base with adapters off" in out
    assert sorted(ref) == [1, 2, 3]
    assert ref[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)     # policy = reference at B = 0
    assert ref[1]["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert ref[3]["loss"] < ref[1]["loss"] and ref[3]["reward_margin"] > 0
    return cfg, env, ref


@pytest.mark.slow
def test_lora_dpo_on_fixture_b_starts_at_log2_and_learns(tmp_path):
    _first_run(tmp_path)


@pytest.mark.slow
@LONG
def test_lora_dpo_on_fixture_b_resumes_exactly(tmp_path):
    """Opt-in: a second `k3jax train` doubles the time (~3 min each on 2 cores, mostly
    compiling). Resuming itself is the train loop's, checked on the toy in test_train_loop
    and test_lora_runs; this shows DPO's metrics keep no state outside the checkpoint."""
    cfg, env, ref = _first_run(tmp_path)
    # stopped after step 1: the newer checkpoints and metrics lines are gone; the same
    # command resumes from step 1 and logs the same losses and DPO metrics
    for s in (2, 3):
        shutil.rmtree(tmp_path / "run" / "checkpoints" / str(s))
    again, out = train_subprocess(cfg, tmp_path, "run", env)
    assert "resumed from step 1" in out
    for s in (2, 3):
        for k in ("loss", "grad_norm", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp"):
            assert again[s][k] == pytest.approx(ref[s][k], rel=1e-6, abs=1e-7), (s, k)
