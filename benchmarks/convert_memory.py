"""Peak host memory and throughput of `k3jax convert` on a synthetic multi-shard checkpoint.

Builds a K3-shaped checkpoint (fixture B's config schema, widths raised so the files are
>= 1 GB, routed experts in MXFP4, bf16/fp32 as released), converts it in a child process
and prints the child's peak RSS as a ratio to the largest decoder layer, and MB/s. The
child's RSS right after its imports (jax, orbax, tensorstore) is printed too, since at
this size it is a large share of the peak. Synthetic files are deleted afterwards.

    python benchmarks/convert_memory.py [--experts 96] [--workdir /tmp]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_B = ROOT.parent / "shared" / "fixtures" / "fixture_b" / "config.json"


def k3_shaped_config(n_experts: int) -> dict:
    cfg = json.loads(FIXTURE_B.read_text())
    t = cfg["text_config"]
    t.update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=9, num_attention_heads=8,
             q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
             num_experts=n_experts, num_experts_per_token=4, moe_intermediate_size=1536,
             routed_expert_hidden_size=512, vocab_size=32768, attn_res_block_size=4,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # layer 0 dense + KDA, then two scanned [KDA, KDA, KDA, MLA] groups (1-based lists)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 6, 7, 8], full_attn_layers=[5, 9], head_dim=128,
                                   num_heads=8)
    return cfg


def synthesise(out: Path, cfg_dict: dict, shard_bytes: int = 200 << 20) -> dict:
    """Write the checkpoint shard by shard (never more than one shard in memory)."""
    import jax

    from k3jax.checkpoint.names import release_dtype, stored_shape, tensor_map
    from k3jax.checkpoint.safetensors_io import DTYPES, INDEX_NAME, write_safetensors
    from k3jax.config import K3Config
    from k3jax.model import param_shapes

    k3 = K3Config.from_hf(cfg_dict)
    cfg = k3.text
    shapes = {tuple(k.key for k in p): x.shape
              for p, x in jax.tree_util.tree_leaves_with_path(param_shapes(cfg))}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg_dict))
    rng = np.random.default_rng(0)
    pending, size, weight_map, total, n_shard = {}, 0, {}, 0, 0
    layer_bytes: dict[str, int] = {}

    def flush():
        nonlocal pending, size, n_shard
        n_shard += 1
        name = f"model-{n_shard:05d}.safetensors"
        write_safetensors(out / name, pending)
        weight_map.update({k: name for k in pending})
        pending, size = {}, 0

    for e in tensor_map(cfg, k3.layout):
        slot = shapes[e.path][len(e.index):]
        shape = stored_shape(e, slot, cfg, k3.layout)
        if e.is_expert:
            o, i = shape
            arrays = {f"{e.hf}.weight_packed": rng.integers(0, 256, (o, i // 2), dtype=np.uint8),
                      f"{e.hf}.weight_scale": rng.integers(118, 128, (o, i // 32), dtype=np.uint8)}
        else:
            dt = DTYPES[release_dtype(e.hf)]
            arrays = {e.hf: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dt)}
        layer = e.hf.split(".layers.")[1].split(".")[0] if ".layers." in e.hf else "top"
        for n, a in arrays.items():
            pending[n] = a
            size += a.nbytes
            total += a.nbytes
            layer_bytes[layer] = layer_bytes.get(layer, 0) + a.nbytes
        if size >= shard_bytes:
            flush()
    if pending:
        flush()
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return {"total": total, "shards": n_shard, "layer_bytes": layer_bytes}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(src: str, dst: str) -> None:
    import threading

    from k3jax.checkpoint.convert import convert

    # ru_maxrss is a high-water mark that the imports already set; sample the current RSS
    # while converting to see what the conversion itself adds.
    base, peak, done = _rss(), [_rss()], threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss())
    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    convert(src, dst)
    dt = time.perf_counter() - t
    done.set()
    hw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": dt, "peak_rss": max(peak[0], _rss()), "import_rss": base, "ru_maxrss": hw}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--child", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="k3jax_convert_bench_", dir=args.workdir))
    try:
        t = time.perf_counter()
        info = synthesise(work / "hf", k3_shaped_config(args.experts))
        print(f"synthesised {info['total'] / 1e9:.2f} GB in {info['shards']} shards "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", str(work / "hf"), str(work / "orbax")],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        layers = {k: v for k, v in info["layer_bytes"].items() if k != "top"}
        big = max(layers, key=layers.get)
        src_layer = layers[big]
        out_bytes = sum(f.stat().st_size for f in (work / "orbax").rglob("*") if f.is_file())
        # bf16 experts are 16/4.25 x their MXFP4 bytes: the same layer as held in the converted tree
        conv_layer = src_layer * out_bytes / info["total"]
        mb_s = info["total"] / 1e6 / r["seconds"]
        print(f"converted {info['total'] / 1e9:.2f} GB -> {out_bytes / 1e9:.2f} GB Orbax in {r['seconds']:.1f} s: "
              f"{mb_s:.0f} MB/s read, {out_bytes / 1e6 / r['seconds']:.0f} MB/s written")
        print(f"largest layer ({big}): {src_layer / 1e6:.0f} MB as stored (MXFP4), "
              f"~{conv_layer / 1e6:.0f} MB converted (bf16)")
        print(f"peak RSS {r['peak_rss'] / 1e6:.0f} MB sampled, ru_maxrss {r['ru_maxrss'] / 1e6:.0f} MB "
              f"(RSS after imports {r['import_rss'] / 1e6:.0f} MB): "
              f"{r['peak_rss'] / src_layer:.2f}x the stored layer, {r['peak_rss'] / conv_layer:.2f}x the converted "
              f"layer; above imports {(r['peak_rss'] - r['import_rss']) / src_layer:.2f}x the stored layer "
              f"(target <= 3x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
