"""A LoRA GRPO run over fixture B's MXFP4 base, end to end as `k3jax train` subprocesses:
rollouts of the current policy through the engine, a reward imported from a module by
name, the KL to the reference (the base with adapters off), and a run stopped mid-way
that resumes to the same rollouts, rewards and losses as the uninterrupted one.

Opt-in (K3JAX_LONG_TESTS=1): about 4 minutes per `k3jax train` on 2 cores, nearly all of it
compiling fixture B's engine step, the two log-prob forwards and the LoRA step, twice; 10
minutes of the full suite's time. It passed on 2026-12-04 (483 s alone, 614 s in a loaded full suite)."""
import json
import os
import shutil

import pytest

from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE, LONG, fixture_b_cut, train_subprocess

REWARD = '''
def letters(record, reply):
    """Dense enough for a random policy's groups to differ: the reply's text length."""
    return float(len(reply["content"]) + len(reply["reasoning_content"]))
'''



@pytest.mark.slow
@LONG
def test_lora_grpo_on_fixture_b_resumes_exactly(tmp_path):
    b = fixture_b_cut(tmp_path / "fixture_b4")
    (tmp_path / "grpo_test_rewards.py").write_text(REWARD)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": w}], "answer": w}) + "\n"
                               for w in ("river", "stone", "cloud")))
    train = {"objective": "grpo", "steps": 3, "log_every": 1, "ckpt_every": 1, "keep": 10, "sample_tokens": 0,
             "peak_tflops": 1.0, "init_from": str(b),
             "data": {"path": str(prompts), "format": "chat", "seq_len": 96, "batch_size": 4,
                      "chat": {"thinking": False, "thinking_effort": None}},
             "grpo": {"group_size": 4, "max_tokens": 6, "rollout_slots": 4, "kl_beta": 0.1,
                      "rewards": ["grpo_test_rewards:letters", "format"]},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"},
             "runtime": {"expert_format": "mxfp4"},
             "lora": {"rank": 4, "alpha": 8.0, "lr": 0.05}}
    cfg = write_variant(str(tmp_path / "b.yaml"), base=str(b / "config.json"), train=train)
    env = dict(os.environ, K3JAX_COMPILE_CACHE=str(tmp_path / "xla"), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE,
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    ref, out = train_subprocess(cfg, tmp_path, "run", env)
    assert "reference: the base with adapters off" in out
    assert sorted(ref) == [1, 2, 3]
    # the first update's policy is the rollout's and, at B = 0, the reference: ratio 1, KL 0
    assert ref[1]["ratio"] == pytest.approx(1.0, abs=1e-5) and ref[1]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert ref[1]["reward_std"] > 0 and ref[1]["grad_norm"] > 0        # groups that differ: a signal
    assert ref[3]["kl"] > 0                                            # the adapters moved the policy
    # stopped after step 1: the same command resumes there, samples the same rollouts with the
    # restored adapters, and logs the same rewards and losses
    for s in (2, 3):
        shutil.rmtree(tmp_path / "run" / "checkpoints" / str(s))
    again, out = train_subprocess(cfg, tmp_path, "run", env)
    assert "resumed from step 1" in out
    for s in (2, 3):
        for k in ("loss", "grad_norm", "reward_mean", "reward_std", "kl", "ratio", "response_length"):
            assert again[s][k] == pytest.approx(ref[s][k], rel=1e-6, abs=1e-7), (s, k)
