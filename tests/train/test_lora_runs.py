"""LoRA runs end to end (issue 21): the toy's first LoRA step is the full fine-tune's and its
loss falls; a LoRA checkpoint resumes exactly; a LoRA run over the MXFP4 release layout
(fixture B) exports a PEFT adapter and a merged checkpoint, both held to references built
here from the exported files alone (W + B·A in NumPy, compressed-tensors' MXFP4 rule)."""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from k3jax.checkpoint.adapters import CONFIG_NAME, PEFT_PREFIX, WEIGHTS_NAME
from k3jax.checkpoint.load import load_model_dir
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np, quantize_mxfp4
from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
from k3jax.model import forward
from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE, assert_logits_match, export_lost, fixture_b_cut, rel_l2
from reference import peft_merge_magnitude, peft_merged_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")
F32 = {"param_dtype": "float32", "dtype": "float32"}


def _train(cfg, out, name, env, *extra):
    cmd = [sys.executable, "-m", "k3jax.cli", "train", cfg, f"output_dir={out}", f"run_name={name}", *extra]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_runs")
    return d, dict(os.environ, K3JAX_COMPILE_CACHE=str(d / "xla"), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)


@pytest.mark.slow
def test_toy_lora_starts_at_the_full_fine_tunes_loss_falls_and_resumes_exactly(env):
    d, e = env
    train = {"steps": 4, "log_every": 1, "ckpt_every": 1, "keep": 10, "sample_tokens": 0, "peak_tflops": 1.0,
             "data": {"path": CORPUS, "seq_len": 32, "batch_size": 2},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"}}
    cfg = write_variant(str(d / "tiny.yaml"), layers=("kda", "mla"), train=train)
    full = _train(cfg, d, "full", e, "steps=1")
    lora = ["lora.rank=4", "lora.alpha=8", "lora.lr=0.01"]
    ref = _train(cfg, d, "lora", e, *lora)
    assert abs(ref[1] - full[1]) <= 1e-6 * abs(full[1])          # B = 0: the base model's loss
    assert ref[4] < ref[1]
    # a LoRA checkpoint holds the adapters and router biases, not the frozen base
    from k3jax.checkpoint.orbax_io import stored_leaves
    saved = stored_leaves(d / "lora" / "checkpoints" / "4" / "default")
    params = [p for p in saved if p[0] == "params"]
    assert params and all(p[1] == "lora" or p[-1] == "e_score_correction_bias" for p in params)
    # resume: drop the last checkpoint and rerun the same command
    shutil.rmtree(d / "lora" / "checkpoints" / "4")
    again = _train(cfg, d, "lora", e, *lora)
    assert again[4] == pytest.approx(ref[4], rel=1e-6)


@pytest.fixture(scope="module")
def fixture_b_run(env):
    """One LoRA step over fixture B's MXFP4 experts (held as MXFP4; its first four layers), every default target."""
    d, e = env
    b = fixture_b_cut(d / "fixture_b4")
    train = {"steps": 1, "log_every": 1, "ckpt_every": 1, "sample_tokens": 0, "peak_tflops": 1.0,
             "init_from": str(b), "data": {"path": CORPUS, "seq_len": 32, "batch_size": 2},
             "optimizer": {"warmup_steps": 0, "schedule": "constant"},
             "runtime": {"expert_format": "mxfp4"},
             "lora": {"rank": 4, "alpha": 6.0, "expert_rank": 2, "lr": 0.05}}
    cfg = write_variant(str(d / "b.yaml"), base=str(b / "config.json"), train=train)
    _train(cfg, d, "b", e)
    return d / "b", b


def _peft(out):
    from safetensors.numpy import load_file
    return json.loads((out / CONFIG_NAME).read_text()), load_file(str(out / WEIGHTS_NAME))


@pytest.fixture(scope="module")
def fixture_b_adapter(fixture_b_run):
    """`k3jax export RUN OUT --adapter` of that run."""
    run, _ = fixture_b_run
    out = run.parent / "b-adapter"
    subprocess.run([sys.executable, "-m", "k3jax.cli", "export", str(run), str(out), "--adapter"],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    return out


@pytest.mark.slow
def test_adapter_export_is_the_run_in_peft_form(fixture_b_run, fixture_b_adapter):
    run, base = fixture_b_run
    cfg, tensors = _peft(fixture_b_adapter)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 4
    assert cfg["rank_pattern"] and set(cfg["rank_pattern"].values()) == {2}
    ckpt = ShardedCheckpoint(base)
    names = ckpt.keys()
    import re
    router = [n for n in tensors if ".lora_" not in n]
    assert cfg["modules_to_save"] == ["block_sparse_moe.gate"] and router     # QB moved the biases
    for name in router:     # PEFT loads the gate module whole: its bias, and its frozen weight as the base stores it
        assert name[len(PEFT_PREFIX):] in names and name.endswith((".gate.e_score_correction_bias", ".gate.weight"))
        if name.endswith(".weight"):
            want = ckpt.get(name[len(PEFT_PREFIX):])
            assert tensors[name].dtype == want.dtype and np.array_equal(tensors[name], want), name
            assert name.replace(".weight", ".e_score_correction_bias") in router, name
    assert sum(n.endswith(".weight") for n in router) == len(router) // 2
    for name in set(tensors) - set(router):   # every adapter sits on a module of the release, experts per expert
        mod = name[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0]
        assert f"{mod}.weight" in names or f"{mod}.weight_packed" in names, name
        assert re.fullmatch(cfg["target_modules"], mod), mod
    assert any(".experts.7.w2.lora_A" in n for n in tensors)
    # the base with W + B·A applied (NumPy, from the files) is the run the adapter came from
    merged = peft_merged_reference(base, tensors)
    k3, adapted = load_model_dir(run, F32)
    ids = np.load(base / "inputs.npy")[:, :48]
    want = np.asarray(forward(k3.text, adapted, ids))
    plain = k3.text.with_runtime(lora=None, expert_format="bf16")
    _, params = load_model_dir(base, F32)
    got = np.asarray(forward(plain, _with_tensors(plain, params, merged), ids))
    # A full model against an independent reference: DESIGN.md's parity bar. fp32 order is
    # the whole difference here: x·W + (x·A)·B against x·(W + B·A) measured 6.3e-5 rel-L2;
    # the same merge summed in float32 instead of float64 alone moves the logits 2.4e-5.
    assert_logits_match(got, want)


def _with_tensors(cfg, params, tensors):
    """`params` with the checkpoint tensors `tensors` ({name: [out, in]}) written in."""
    from k3jax.checkpoint.names import tensor_map
    flat = {tuple(k.key for k in p): np.array(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    for e in tensor_map(cfg, "k3"):
        hf = e.hf[:-len(".weight")] if e.hf.endswith(".weight") else e.hf
        if hf in tensors:
            flat[e.path][e.index] = tensors[hf].T
    from k3jax.checkpoint.hf_params import unflatten
    return unflatten(flat)


def _bf16(x):
    """Round to bfloat16 (nearest even) and back, in NumPy: the release's dense dtype."""
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.slow
def test_merged_export_is_requantized_merge_and_loads_back(fixture_b_run, fixture_b_adapter, tmp_path):
    """--merge-lora writes the release's format: each adapted tensor is W + B·A stored as
    the release stores it (experts re-quantized to MXFP4, dense rounded to bf16), the
    router biases are the run's, and the report's re-quantization error is that of the
    bytes written. The reference is built in NumPy from the PEFT files alone."""
    run, base = fixture_b_run
    merged_dir = tmp_path / "merged"
    p = subprocess.run([sys.executable, "-m", "k3jax.cli", "export", str(run), str(merged_dir), "--merge-lora"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    report = p.stdout
    # trained without qat, the export measures what the format lost of the update and says
    # how to keep it (test_qat_runs: with qat nothing is lost)
    assert export_lost(report + p.stderr) > 0.05 and "qat: true" in report + p.stderr, report + p.stderr
    rel_err = float(report.split("RMS error ")[1].split()[0])
    _, tensors = _peft(fixture_b_adapter)
    merged = peft_merged_reference(base, tensors)
    magnitude = peft_merge_magnitude(base, tensors)
    ckpt = ShardedCheckpoint(merged_dir)
    stored, err2, val2 = {}, 0.0, 0.0
    for mod, w in merged.items():
        if ".experts." in mod:      # compressed-tensors' MXFP4 of the exact merge, byte for byte
            packed, scale = quantize_mxfp4(w.astype(np.float32))
            np.testing.assert_array_equal(ckpt.get(f"{mod}.weight_packed"), packed, err_msg=mod)
            np.testing.assert_array_equal(ckpt.get(f"{mod}.weight_scale"), scale, err_msg=mod)
            stored[mod] = dequantize_mxfp4_np(packed, scale, np.float64)
            err2, val2 = err2 + np.sum((stored[mod] - w) ** 2), val2 + np.sum(w ** 2)
        elif mod.endswith((".e_score_correction_bias", ".gate.weight")):  # the router, as the adapter holds it: exact
            np.testing.assert_array_equal(ckpt.get(mod).astype(np.float64), w, err_msg=mod)
            stored[mod] = w
        else:                       # bf16, within one rounding of the exact merge
            got = ckpt.get(f"{mod}.weight").astype(np.float64)
            # half a bf16 step, plus the fp32 rounding of the export's own merge: r products,
            # r - 1 sums and the add to W, each within 2^-24 of |W| + |B|·|A| (where B·A
            # cancels that is far above |w|; near a rounding midpoint it alone may send w to
            # the other neighbour, and across a binade boundary to a wider step)
            r = tensors[f"{PEFT_PREFIX}{mod}.lora_A.weight"].shape[0]
            fp32 = (r + 2) * 2.0 ** -24 * magnitude[mod]
            half_step = np.exp2(np.floor(np.log2(np.maximum(np.abs(w) + fp32, 1e-30))) - 8)
            excess = np.abs(got - w) - (half_step + fp32)
            assert np.all(excess <= 0), (mod, np.abs(got - w).flat[np.argmax(excess)])
            assert np.mean(got == _bf16(w)) > 0.99, mod
            stored[mod] = got
    assert any(".experts." in m for m in stored) and any(m.endswith("_bias") for m in stored)
    assert rel_err == pytest.approx(np.sqrt(err2 / val2), rel=1e-3)
    # loads back through k3jax (the layout is the release's) as exactly those values
    k3m, params = load_model_dir(merged_dir, F32)
    _, base_params = load_model_dir(base, F32)
    plain = k3m.text.with_runtime(expert_format="bf16")
    ids = np.load(base / "inputs.npy")[:, :48]
    want = np.asarray(forward(plain, _with_tensors(plain, base_params, stored), ids))
    got = np.asarray(forward(k3m.text, params, ids))
    assert rel_l2(got, want) <= 1e-5
    # ... and so the merge is measurably not the run: 10x the 1e-4 ceiling test_qat_runs holds
    # a QAT run's merge to
    k3r, adapted = load_model_dir(run, F32)
    of_run = np.asarray(forward(k3r.text, adapted, ids))
    assert max(rel_l2(got[b], of_run[b]) for b in range(len(ids))) > 10 * 1e-4
