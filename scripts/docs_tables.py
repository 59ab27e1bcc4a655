#!/usr/bin/env python3
"""The numbers in README.md, launch/README.md, docs/performance.md and docs/post_training.md, regenerated from the code
that computes them.

    python scripts/docs_tables.py           # rewrite every generated block in place
    python scripts/docs_tables.py --check   # exit 1 and name the blocks that are out of date

A generated block sits between

    <!-- generated: NAME (python scripts/docs_tables.py) -->
    ...
    <!-- end generated: NAME -->

and is replaced whole; everything outside the markers is left alone. The plan tables come
from `k3jax plan ... --json` (run in-process, the same code path as the command), the
parameter counts from `k3jax params --json`, the preset table from configs/meshes/*.yaml
(each preset's own `description`). tests/test_docs.py fails when a block differs.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GIB = 1 << 30
REGEN = "python scripts/docs_tables.py"

# The K3 plan table: (preset, mode, optimizer or expert format). Training batches give each
# device 1024 tokens of 4096-token sequences; inference one 128 k-token sequence per device.
PLAN_ROWS = [
    ("v5p-512", "train", "adamw"), ("v5p-512", "train", "muon"),
    ("v5p-1024", "train", "adamw"), ("v5p-1024", "train", "muon"),
    ("v5p-1024x2", "train", "adamw"), ("v5p-1024x2", "train", "muon"),
    ("h200x64", "train", "muon"), ("h200x128", "train", "muon"), ("h200x256", "train", "muon"),
    ("b300x8", "infer", "mxfp4"), ("b300x8", "infer", "bf16"), ("b300x16", "infer", "mxfp4"),
]
TRAIN_SEQ, TOKENS_PER_DEVICE, INFER_SEQ = 4096, 1024, 131072
TIGHT = 0.9      # "yes (tight)": the plan fills at least this share of HBM


def _json(*argv) -> dict:
    """`k3jax ARGV --json`'s object; plans keep the optimizer state on the device (the tables
    say what fits there; `k3jax plan` itself moves it to the host where nothing else fits)."""
    from k3jax import cli
    if argv[0] == "plan" and not any("optimizer-offload" in a for a in argv):
        argv = (*argv, "--no-optimizer-offload")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(list(argv) + ["--json"])
    if rc != 0:
        raise SystemExit(f"k3jax {' '.join(argv)} --json failed ({rc})")
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def _devices(preset: str) -> int:
    from k3jax.mesh import load_preset
    return _prod(load_preset(preset).shape().values())


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def plan_row(preset: str, mode: str, choice: str) -> dict:
    n = _devices(preset)
    if mode == "train":
        # 1024 tokens a chip where the layout splits that batch, else the fewest it takes
        batch, seq = fewest_sequences(preset, n * TOKENS_PER_DEVICE // TRAIN_SEQ), TRAIN_SEQ
        extra = ["--optimizer", choice]
    else:
        batch, seq = n, INFER_SEQ
        extra = ["--mode", "infer", "--expert-format", choice]
    return _json("plan", "configs/k3.yaml", "--mesh", preset, "--batch", str(batch), "--seq", str(seq), *extra)


def _g(b) -> str:
    return f"{b / GIB:.1f}"


def _layout(preset: str, p: dict) -> str:
    """The preset, and the layout it runs as where train picks another (train_preset, context_preset)."""
    return preset if p["mesh"] == preset else f"{preset} (runs as {p['mesh']})"


def _fits(p: dict) -> str:
    if not p["fits"]:
        return "no"
    return "yes (tight)" if p["bytes_per_device"]["total"] >= TIGHT * p["hbm_bytes"] else "yes"


def plan_table(rows) -> str:
    head = ("| preset | mode | batch × seq | optimizer / experts | params | grads | optimizer / caches | "
            "activations (ep buffers) | total / HBM | fits |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for (preset, mode, choice), p in rows:
        b = p["bytes_per_device"]
        train = mode == "train"
        lines.append(
            f"| {_layout(preset, p)} | {mode} | {p['batch']}×{p['seq']} | {choice} | {_g(b['params'])} | "
            f"{_g(b['grads']) if train else '—'} | {_g(b['optimizer']) if train else 'caches ' + _g(b['caches'])} | "
            f"{_g(b['activations'])} ({_g(p['detail']['activations']['moe_buffer'])}) | "
            f"{_g(b['total'])} / {p['hbm_bytes'] / GIB:.0f} | {_fits(p)} |")
    return head + "\n".join(lines)


def plan_summary(rows) -> str:
    """What the table says, in words that follow the numbers."""
    params = rows[0][1]["params"]
    fits: dict = {}     # (platform, mode, choice) -> [(devices, preset, fits)], in PLAN_ROWS order
    for (preset, mode, choice), p in rows:
        from k3jax.mesh import load_preset
        platform = load_preset(preset).device or re.split(r"[-x]", preset)[0]
        fits.setdefault((platform, mode, choice), []).append((p["devices"], preset, p["fits"]))
    def state_per_param(optimizer):   # the planner's exact state bytes over every device
        p = next(p for (_, mode, choice), p in rows if mode == "train" and choice == optimizer)
        b = p["bytes_per_device"]
        return (b["params"] + b["grads"] + b["optimizer"]) * p["devices"] / params

    adamw, muon = state_per_param("adamw"), state_per_param("muon")
    out = [f"- Training state is {adamw:.1f} bytes per parameter with AdamW (bf16 param, fp32 grad, fp32 m and v) "
           f"and {muon:.1f} with Muon (one fp32 momentum on the matrices): {adamw * params / 1e12:.1f} TB / "
           f"{muon * params / 1e12:.1f} TB for K3 (sharded, before activations)."]
    for (platform, mode, choice), entries in fits.items():
        ok = sorted(e for e in entries if e[2])
        what = f"{'Training' if mode == 'train' else 'Inference'} with {choice} on {platform}"
        if ok:
            out.append(f"- {what}: the smallest preset that fits is `{ok[0][1]}` ({ok[0][0]} devices).")
        else:
            out.append(f"- {what}: none of {', '.join(f'`{e[1]}`' for e in sorted(entries))} fits.")
    return "\n".join(out)


def ep_buffer() -> str:
    drop = _json("plan", "configs/k3.yaml", "--mesh", "v5p-1024")
    cap = _json("plan", "configs/k3.yaml", "--mesh", "v5p-1024", "--ep-capacity", "1.25")
    return (f"On v5p-1024 at one sequence per batch shard ({drop['batch']} × {drop['seq']}) the dropless "
            f"buffer is {_g(drop['detail']['activations']['moe_buffer'])} GiB per device; "
            f"`--ep-capacity 1.25` plans {_g(cap['detail']['activations']['moe_buffer'])} GiB.")


def h200_full() -> str:
    """Full fine-tuning of K3 on `h200x256` (docs/performance.md): the planner's totals."""
    base = ("plan", "configs/k3_sft.yaml", "--mesh", "h200x256", "--optimizer", "muon", "--batch", "256")
    cases = [("4096 tokens", _json(*base, "--seq", "4096")),
             ("4096 tokens with `--ep-capacity 1.25`", _json(*base, "--seq", "4096", "--ep-capacity", "1.25")),
             ("1024 tokens with capacity 1.25", _json(*base, "--seq", "1024", "--ep-capacity", "1.25"))]
    fit = [name for name, p in cases if p["fits"]]
    verdict = f"{' and '.join(fit)} fit{'s' if len(fit) == 1 else ''}" if fit else "none of them fits"
    full = cases[0][1]
    return ("The planner gives, per GPU, "
            + ", ".join(f"{_g(p['bytes_per_device']['total'])} GiB at {name}" for name, p in cases)
            + f" (`... --seq 1024 --ep-capacity 1.25`), against the H200's {full['hbm_bytes'] / GIB:.0f}: "
            f"{verdict}. Of the 4096-token total, {_g(full['detail']['activations']['gathered_layer'])} GiB "
            "is the layer ZeRO-3 gathers.")


def preset_table() -> str:
    import yaml

    from k3jax.mesh import MESH_DIR, load_preset
    lines = ["| preset | devices | axes | HBM / device | description |", "|---|---|---|---|---|"]
    for f in sorted(os.listdir(MESH_DIR)):
        if not f.endswith(".yaml"):
            continue
        name = f[:-5]
        with open(os.path.join(MESH_DIR, f)) as fh:
            desc = (yaml.safe_load(fh) or {}).get("description")
        if not desc:
            raise SystemExit(f"configs/meshes/{f}: add a description: line (it goes into launch/README.md)")
        p = load_preset(name)
        free = any(s == -1 for s in p.ici.values())
        axes = " × ".join(f"{a} {'all' if s == -1 else s}" for a, s in p.ici.items())
        if p.dcn:
            axes = " × ".join(f"{a} {s} (DCN)" for a, s in p.dcn.items()) + " × " + axes
        devices = "all" if free else str(_prod(p.shape().values()))
        hbm = f"{p.hbm_gib:g} GiB" if p.hbm_gib else "—"
        lines.append(f"| `{name}` | {devices} | {axes} | {hbm} | {desc} |")
    return "\n".join(lines)


def param_table() -> str:
    lines = ["| config | total | activated |", "|---|---|---|"]
    for name, label in (("k3", "`k3` (and the released `config.json`)"), ("kimi_linear_48b", "`kimi_linear_48b`")):
        c = _json("params", name)
        lines.append(f"| {label} | {c['total']:,d} | {c['active']:,d} |")
    return "\n".join(lines)


# README "LoRA on the MXFP4 release": (mesh, label, extra planner flags)
LORA_ROWS = [
    ("b300x8", "b300x8", "8 × B300", ()),
    ("h200x16_train", "h200x16_train", "16 × H200", ("--lora-expert-rank", "4")),
    ("h200x16_train", "h200x16_train", "16 × H200", ("--lora-expert-mode", "shared_a")),
    ("h200x16_train", "h200x16_train", "16 × H200", ()),
    ("v5p-512", "v5p-512", "256", ()),
    ("v5p-1024", "v5p-1024", "512", ()),
]
LORA_FLAGS = ("--mode", "train", "--expert-format", "mxfp4", "--lora-rank", "16", "--seq", "4096",
              "--ep-buffer-mib", "256")
LORA_BATCH = 8


def fewest_sequences(preset: str, batch: int) -> int:
    """`batch` rounded up to what the preset's train layout splits (whole sequences per batch
    shard; a context preset, where the preset names one, puts a sequence over several chips)."""
    from k3jax.mesh import batch_shards, preset_for
    n = _devices(preset)
    shards = batch_shards(preset_for(preset, "train", batch, n), n)
    return -(-batch // shards) * shards


def lora_table() -> str:
    lines = ["| mesh | devices | batch × seq | extra flags | params | grads | optimizer | activations | total | HBM | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mesh, label, devices, extra in LORA_ROWS:
        batch = fewest_sequences(mesh, LORA_BATCH)
        p = _json("plan", "configs/k3.yaml", "--mesh", mesh, *LORA_FLAGS, "--batch", str(batch), *extra)
        b = p["bytes_per_device"]
        flags = f"`{' '.join(extra)}`" if extra else ""
        lines.append(f"| {_layout(label, p)} | {devices} | {p['batch']}×{p['seq']} | {flags} | {_g(b['params'])} | {_g(b['grads'])} | {_g(b['optimizer'])} | "
                     f"{_g(b['activations'])} | {_g(b['total'])} GiB | {p['hbm_bytes'] / GIB:.0f} | {_fits(p)} |")
    return "\n".join(lines)


GRPO_FLAGS = ("--mesh", "v5p-1024", "--objective", "grpo", "--batch", "128", "--seq", "4096")
GRPO_ROWS = [((), "full fine-tuning, no KL"), (("--kl-beta", "0.05"), ""),
             (("--expert-format", "mxfp4", "--lora-rank", "16", "--kl-beta", "0.05"), "")]


def grpo_table() -> str:
    """K3 GRPO on v5p-1024: the update's plan and the rollout's, per device."""
    lines = ["| flags | update | rollout (caches) | fits |", "|---|---|---|---|"]
    for extra, label in GRPO_ROWS:
        p = _json("plan", "configs/k3.yaml", *GRPO_FLAGS, *extra)
        b, o = p["bytes_per_device"], p["detail"]["objective"]
        update = sum(v for k, v in b.items() if k != "total")
        ref = f" (reference copy {_g(b['reference'])})" if b["reference"] else ""
        if p["ep_buffer_mib"] != 1024:     # the planner's choice: the default did not fit with margin
            ref += f", `--ep-buffer-mib {p['ep_buffer_mib']:g}` chosen"
        lines.append(f"| {label or '`' + ' '.join(extra) + '`'} | {_g(update)} GiB{ref} | "
                     f"{_g(o['rollout_total'])} GiB ({_g(o['rollout_caches'])}) | {_fits(p)} |")
    return "\n".join(lines)


def blocks() -> dict[str, dict[str, str]]:
    """{file: {block name: text}} for every generated block."""
    rows = [(r, plan_row(*r)) for r in PLAN_ROWS]
    return {"README.md": {"params": param_table(), "plan-summary": plan_summary(rows), "lora-plan": lora_table()},
            "launch/README.md": {"presets": preset_table(), "ep-buffer": ep_buffer(),
                                 "plan-summary": plan_summary(rows)},
            "docs/performance.md": {"plan-k3": plan_table(rows), "h200-full": h200_full()},
            "docs/post_training.md": {"grpo-plan": grpo_table()}}


def _pattern(name: str):
    return re.compile(rf"(<!-- generated: {re.escape(name)} \(.*?\) -->\n)(.*?)(\n<!-- end generated: "
                      rf"{re.escape(name)} -->)", re.S)


def render(text: str, new: dict[str, str], path: str) -> str:
    for name, body in new.items():
        pat = _pattern(name)
        if not pat.search(text):
            raise SystemExit(f"{path}: no generated block {name!r} (markers: <!-- generated: {name} ({REGEN}) -->)")
        text = pat.sub(lambda m: m.group(1) + body + m.group(3), text)
    return text


def stale() -> list[tuple[str, str]]:
    """(file, block) pairs whose text differs from what the code computes now."""
    out = []
    for path, new in blocks().items():
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for name, body in new.items():
            m = _pattern(name).search(text)
            if m is None or m.group(2) != body:
                out.append((path, name))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report the blocks that are out of date")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    if args.check:
        bad = stale()
        for path, name in bad:
            print(f"{path}: block {name!r} is out of date; run `{REGEN}`")
        return 1 if bad else 0
    for path, new in blocks().items():
        with open(path) as f:
            text = f.read()
        out = render(text, new, path)
        if out != text:
            with open(path, "w") as f:
                f.write(out)
            print(f"updated {path}: {', '.join(new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
