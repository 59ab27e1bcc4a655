"""Shared test utilities: where the golden fixtures live, and error metrics."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("K3JAX_SHARED", ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures"
REFERENCE_CONFIG = SHARED / "reference" / "kimi-k3" / "config.json"
# XLA:CPU's LLVM at optimisation level 1, for the tests and the runs they start: the suite's
# time is mostly compiling small programs that then run once (about 20% less wall time on its
# slowest tests). Level 0 was faster still but stops fusing multiply-adds, which moved
# sharded-vs-single-device comparisons by an ulp (init bitwise, 1.02e-5 on a 1e-5 bar).
FAST_COMPILE = "--xla_backend_optimization_level=1"
# Every layer kind of the toy in 5 layers: dense layer 0 (KDA), then a [KDA-MoE, MLA-MoE] group
# that nn.scan repeats twice. Its step traces 3 layers where the 13-layer toy's traces 9
# (5 unrolled around the scanned 4): about half the compile, for tests whose property needs
# every kind and a repeated scan but not the toy's depth.
SMALL_LAYERS = ("kda", "kda", "mla", "kda", "mla")


def small_toy(text: dict | None = None, **runtime):
    """The text config of the toy cut to SMALL_LAYERS, with text_config (`text`) and
    RuntimeOptions overrides."""
    from k3jax.config import K3Config
    from k3jax.testing.variants import variant_dict
    d = variant_dict(layers=SMALL_LAYERS, **(text or {}))
    d.pop("train", None)
    cfg = K3Config.from_hf(d).text
    return cfg.with_runtime(**runtime) if runtime else cfg


# Tests of minutes each that repeat what faster ones check; run them with K3JAX_LONG_TESTS=1
LONG = pytest.mark.skipif(not os.environ.get("K3JAX_LONG_TESTS"), reason="long: set K3JAX_LONG_TESTS=1")


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found (set K3JAX_SHARED to the shared/ folder)")
    return path


def export_lost(report: str) -> float:
    """The fraction of the fine-tune's update that `k3jax export` reports the storage format lost."""
    return float(report.split("update lost to the storage format: ")[1].split("%")[0]) / 100


def rel_l2(a, b) -> float:
    """‖a − b‖₂ / ‖b‖₂ in float64 (= the relative RMS error); 0 when both are zero."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return _ratio(np.linalg.norm(a - b), np.linalg.norm(b))


def rel_max(a, b) -> float:
    """max|a − b| / max|b| in float64; 0 when both are zero."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return _ratio(np.max(np.abs(a - b), initial=0.0), np.max(np.abs(b), initial=0.0))


def _ratio(num, den) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def assert_logits_match(logits, ref, rel: float = 1e-4, max_abs: float = 2e-3, margin: float = 1e-2):
    """DESIGN.md's full-model parity bar, per sequence: relative L2, max |diff|, and the same
    argmax wherever the reference's top-2 margin is clear."""
    logits, ref = np.asarray(logits), np.asarray(ref)
    assert logits.shape == ref.shape, (logits.shape, ref.shape)
    for b in range(ref.shape[0]):
        assert rel_l2(logits[b], ref[b]) <= rel, (b, rel_l2(logits[b], ref[b]))
        assert np.abs(logits[b] - ref[b]).max() <= max_abs, (b, np.abs(logits[b] - ref[b]).max())
        top2 = np.sort(ref[b], axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > margin
        np.testing.assert_array_equal(logits[b].argmax(-1)[clear], ref[b].argmax(-1)[clear])


def randomise_kimi_linear(model, seed=0):
    """Every parameter drawn so each sublayer contributes O(1) (HF's 0.02 init makes the
    logits nearly input-independent, which would hide wiring bugs). `model`: transformers'
    KimiLinear, in place."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            leaf = name.rsplit(".", 2)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 - 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif p.ndim == 1 or "norm" in leaf[-2]:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def greedy_full_forward(cfg, params, ids: list[int], n_new: int, pad_id: int) -> list[int]:
    """Greedy continuation by full forwards of one fixed-length buffer (no cache): the
    reference the cached decoder is held to (causal, so the padding after the cursor never
    affects the logits read)."""
    import jax
    import jax.numpy as jnp

    from k3jax.model import K3Model, variables_of
    T = len(ids) + n_new
    buf = np.full((1, T), pad_id, np.int32)
    buf[0, :len(ids)] = ids
    fwd = jax.jit(lambda p, t: jnp.argmax(K3Model(cfg).apply(variables_of(p), t), -1))
    for pos in range(len(ids), T):
        buf[0, pos] = np.asarray(fwd(params, jnp.asarray(buf)))[0, pos - 1]
    return buf[0, len(ids):].tolist()


def fixture_b_cut(dest: Path, layers: int = 4) -> Path:
    """Fixture B's release folder cut to its first `layers` layers at `dest` (config.json,
    model.safetensors with MXFP4 experts, inputs.npy; no golden outputs: they are the full
    depth's). Four keep every kind it has (dense KDA, KDA-MoE, MLA-MoE) and an AttnRes block
    boundary, and a QAT LoRA `k3jax train` over them takes 45 s where the ten take 99 s: for
    runs whose property is not fixture B's logits. Skips when the fixture is absent."""
    import shutil

    from k3jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
    b = need(FIXTURES / "fixture_b")
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((b / "config.json").read_text())
    text = cfg["text_config"]
    assert layers <= text["num_hidden_layers"], layers
    text["num_hidden_layers"] = layers
    linear = text["linear_attn_config"]          # 1-based layer numbers, as the release writes them
    for key in ("kda_layers", "full_attn_layers"):
        linear[key] = [i for i in linear[key] if i <= layers]
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    with SafetensorsFile(b / "model.safetensors") as f:
        keep = {n: np.array(f.get(n)) for n in f.keys()
                if not (m := re.search(r"\.layers\.(\d+)\.", n)) or int(m.group(1)) < layers}
        write_safetensors(dest / "model.safetensors", keep, f.metadata)
    shutil.copyfile(b / "inputs.npy", dest / "inputs.npy")
    return dest


def two_shard_multimodal_checkpoint(dest: Path) -> tuple[Path, Path, Path]:
    """A release-layout folder at `dest`: fixture B's text tensors (MXFP4 experts) and
    fixture V's vision tensors as two shards behind an index, one config.json with both.
    Returns (dest, fixture B, fixture V); skips when the fixtures are absent."""
    import json
    import shutil

    from k3jax.checkpoint.safetensors_io import INDEX_NAME, SafetensorsFile
    b, v = need(FIXTURES / "fixture_b"), need(FIXTURES / "fixture_v")
    dest.mkdir()
    shutil.copyfile(b / "model.safetensors", dest / "text.safetensors")
    shutil.copyfile(v / "model.safetensors", dest / "vision.safetensors")
    cfg = json.loads((b / "config.json").read_text())
    cfg["vision_config"] = json.loads((v / "config.json").read_text())["vision_config"]
    (dest / "config.json").write_text(json.dumps(cfg))
    wm = {n: f for f in ("text.safetensors", "vision.safetensors") for n in SafetensorsFile(dest / f).keys()}
    (dest / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return dest, b, v



def train_subprocess(cfg, out, name, env, *extra):
    """`k3jax train CFG output_dir=OUT run_name=NAME ...` in a subprocess (it must succeed):
    ({step: metrics line}, its stdout)."""
    cmd = [sys.executable, "-m", "k3jax.cli", "train", str(cfg), f"output_dir={out}", f"run_name={name}", *extra]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}, p.stdout
