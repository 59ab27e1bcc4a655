"""Quantization-aware fine-tuning, the evidence: what a fine-tune keeps through the MXFP4
release format with and without `qat: true`, and what QAT costs per step.

    python benchmarks/qat.py [--pretrain 150] [--steps 60] [--out DIR]

A small toy K3 (layers KDA, KDA, KDA, MLA; experts declared MXFP4 like the release) is
first trained from scratch on the first half of data/corpus.txt and exported to the
release layout: the MXFP4 base every fine-tune below starts from. From it, four runs on the
next 30 %: LoRA (rank 8 on every projection and routed expert, the experts held as MXFP4)
and a full fine-tune, each plain and with `qat: true`. Each is exported (`--merge-lora` for
LoRA) and both the run's own forward and its export are scored on the held-out last 20 %.
Printed: held-out loss of the base, of each run and of its export, the gap (export − run,
what the storage format took back), the fraction of the update the export reports lost,
and the median step time (training steps after the second, compile excluded) with QAT's
ratio to the plain run of the same kind.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]


def held_out_loss(model_dir, text: bytes, seq: int = 128) -> float:
    """Mean next-byte cross-entropy of the model (a run: as its forward sees its weights) over
    `text` in windows of `seq` tokens, each starting with bos (the byte tokenizer's ids)."""
    import jax
    import jax.numpy as jnp

    from k3jax.checkpoint.load import load_model_dir
    from k3jax.model import forward
    from k3jax.train import qat
    k3, params = load_model_dir(model_dir, {"param_dtype": "float32", "dtype": "float32"})
    cfg = k3.text
    params = qat.view(cfg, params)
    ids = np.frombuffer(text, np.uint8).astype(np.int32)
    n = (len(ids) - 1) // (seq - 1)
    rows = np.stack([np.concatenate([[cfg.bos_token_id], ids[i * (seq - 1): (i + 1) * (seq - 1) + 1]])
                     for i in range(n)])
    logits = jnp.asarray(forward(cfg, params, rows[:, :-1]), jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.asarray(rows[:, 1:, None]), axis=-1)[..., 0]
    return float(jnp.mean(lse - picked))


def step_ms(run_dir: Path, tokens_per_step: int) -> float:
    """Median step time over steps 3.. (logged every step; the first holds the compile)."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s") and r["step"] >= 3]
    return 1e3 * tokens_per_step / float(np.median(tps))


def train(cfg: str, out: Path, name: str, *overrides) -> Path:
    env = dict(os.environ, JAX_PLATFORMS="cpu", K3JAX_COMPILE_CACHE=str(out / "xla"))
    cmd = [sys.executable, "-m", "k3jax.cli", "train", cfg, f"output_dir={out}", f"run_name={name}", *overrides]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{name}: train failed\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return out / name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pretrain", type=int, default=150, help="steps of the base's training from scratch")
    ap.add_argument("--steps", type=int, default=60, help="steps of each fine-tune")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args(argv)
    from k3jax.checkpoint.export import export
    from k3jax.testing.variants import write_variant

    out = Path(args.out or tempfile.mkdtemp(prefix="qat_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "data" / "corpus.txt").read_bytes()
    half, cut = int(len(text) * 0.5), int(len(text) * 0.8)
    (out / "base.txt").write_bytes(text[:half])            # the base's own training text
    (out / "tune.txt").write_bytes(text[half:cut])         # the fine-tunes'
    held = text[cut:]
    quant = yaml.safe_load((ROOT / "configs" / "k3.yaml").read_text())["text_config"]["quantization_config"]
    seq, batch = 64, 8
    base_train = {"steps": args.pretrain, "log_every": 1, "ckpt_every": args.pretrain, "keep": 1,
                  "sample_tokens": 0, "peak_tflops": 1.0,
                  "data": {"path": str(out / "base.txt"), "tokenizer": "byte", "seq_len": seq, "batch_size": batch},
                  "optimizer": {"lr": 0.02, "warmup_steps": 10}}
    cfg = write_variant(str(out / "toy.yaml"), layers=("kda", "kda", "kda", "mla"), train=base_train,
                        quantization_config=quant)
    base_run = train(cfg, out, "base")
    export(base_run, out / "release")                 # the MXFP4 base the fine-tunes start from
    base_loss = held_out_loss(out / "release", held)

    common = [f"steps={args.steps}", f"ckpt_every={args.steps}", f"init_from={out / 'release'}",
              f"data.path={out / 'tune.txt'}", "optimizer.warmup_steps=0", "optimizer.schedule=constant"]
    kinds = {"LoRA": ["lora.rank=8", "lora.alpha=16", "lora.lr=0.003", "runtime.expert_format=mxfp4"],
             "full": ["optimizer.lr=0.003", "optimizer.adam_lr=0.0005"]}
    rows = []
    for kind, extra in kinds.items():
        for q in (False, True):
            name = f"{kind.lower()}_{'qat' if q else 'plain'}"
            run = train(cfg, out, name, *common, *extra, f"qat={str(q).lower()}")
            r = export(run, out / f"{name}_hf", merge_lora=kind == "LoRA")
            rows.append({"kind": kind, "qat": q, "run": held_out_loss(run, held),
                         "export": held_out_loss(out / f"{name}_hf", held),
                         "lost": r["lost"]["fraction"], "ms": step_ms(run, seq * batch)})

    print(f"held-out loss (nats/byte, last 20 % of data/corpus.txt): MXFP4 base {base_loss:.4f}; "
          f"{args.steps} fine-tuning steps of {batch}x{seq} bytes")
    print(f"{'run':<11}{'held-out: run':>14}{'export':>9}{'gap':>9}{'lost':>8}{'step ms':>9}{'QAT/plain':>11}")
    for r in rows:
        plain = next(p for p in rows if p["kind"] == r["kind"] and not p["qat"])
        ratio = f"{r['ms'] / plain['ms']:.2f}x" if r["qat"] else ""
        name = f"{r['kind']}{' qat' if r['qat'] else ''}"
        print(f"{name:<11}{r['run']:>14.4f}{r['export']:>9.4f}{r['export'] - r['run']:>+9.4f}"
              f"{r['lost']:>8.1%}{r['ms']:>9.1f}{ratio:>11}")
    print(f"(work directory: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
