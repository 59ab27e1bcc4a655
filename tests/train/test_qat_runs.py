"""Quantization-aware fine-tuning end to end (issue 33): a QAT run exported to the release's
MXFP4 layout gives the run's own logits (`k3jax logits` of the run and of the export), and
the export reports that the format lost nothing (without QAT it reports the loss and warns,
naming `qat: true`: test_lora_runs)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from k3jax import cli
from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE, export_lost, fixture_b_cut, rel_l2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")


def _train(cfg, out, name, env, *extra):
    cmd = [sys.executable, "-m", "k3jax.cli", "train", cfg, f"output_dir={out}", f"run_name={name}", *extra]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out / name


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("qat_runs")
    return d, dict(os.environ, K3JAX_COMPILE_CACHE=str(d / "xla"), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)


def _logits(model_dir, tokens_path, out):
    assert cli.main(["logits", str(model_dir), "--tokens", str(tokens_path), "--out", str(out)]) == 0
    return np.load(out)


def _export_and_compare(run, tmp, tokens, capsys, *flags):
    """(rel-L2 of the export's logits to the run's, the export's stdout + stderr)."""
    np.save(tmp / "ids.npy", tokens)
    assert cli.main(["export", str(run), str(tmp / "hf"), "--no-progress", *flags]) == 0
    io = capsys.readouterr()
    want = _logits(run, tmp / "ids.npy", tmp / "run.npy")
    got = _logits(tmp / "hf", tmp / "ids.npy", tmp / "hf.npy")
    return max(rel_l2(got[b], want[b]) for b in range(len(tokens))), io.out + io.err


@pytest.fixture(scope="module")
def fixture_b_lora(env):
    """LoRA on attention and every routed expert over fixture B's MXFP4 experts (held as
    MXFP4: with qat the forward re-quantizes each merged block): (config, tokens)."""
    d, _ = env
    b = fixture_b_cut(d / "fixture_b4")
    train = {"steps": 2, "log_every": 1, "ckpt_every": 2, "sample_tokens": 0, "peak_tflops": 1.0,
             "init_from": str(b), "data": {"path": CORPUS, "seq_len": 32, "batch_size": 2},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"},
             "runtime": {"expert_format": "mxfp4"},
             "lora": {"rank": 4, "alpha": 8.0, "expert_rank": 2, "lr": 0.05,
                      "targets": ["*/self_attn/*_proj", "*/block_sparse_moe/w[123]"]}}
    return write_variant(str(d / "b.yaml"), base=str(b / "config.json"), train=train), np.load(b / "inputs.npy")[:, :40]


# Its counterpart without qat (the merge measurably not the run, the report saying so) is
# test_lora_runs' merged-export test, on that module's plain LoRA run over fixture B.
@pytest.mark.slow
def test_qat_lora_over_mxfp4_experts_exports_the_runs_logits(env, fixture_b_lora, tmp_path, capsys):
    """Merged into the release layout, the QAT run's export is the run, and nothing was lost."""
    d, e = env
    cfg, tokens = fixture_b_lora
    run = _train(cfg, d, "b_qat", e, "qat=true")
    err, report = _export_and_compare(run, tmp_path, tokens, capsys, "--merge-lora")
    assert err <= 1e-4, err
    assert export_lost(report) == 0.0 and "warning" not in report, report


@pytest.mark.slow
def test_qat_full_fine_tune_exports_mxfp4_experts_with_the_runs_logits(env, tmp_path, capsys):
    """A full fine-tune of the toy (fp32 master weights, widened experts) with qat: its export
    (experts MXFP4, the rest bf16) is the run's forward, and nothing of its update is lost."""
    d, e = env
    with open(os.path.join(ROOT, "configs", "k3.yaml")) as f:
        quant = yaml.safe_load(f)["text_config"]["quantization_config"]
    train = {"steps": 3, "log_every": 1, "ckpt_every": 3, "sample_tokens": 0, "peak_tflops": 1.0,
             "data": {"path": CORPUS, "seq_len": 32, "batch_size": 2},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"}}
    cfg = write_variant(str(d / "toy.yaml"), layers=("kda", "kda", "kda", "mla"), train=train,
                        quantization_config=quant)
    run = _train(cfg, d, "toy_qat", e, "qat=true")
    tokens = np.array([[256, *b"The river runs to the sea and back again."]], np.int32)
    err, report = _export_and_compare(run, tmp_path, tokens, capsys)
    assert err <= 1e-4, err
    assert export_lost(report) == 0.0, report
