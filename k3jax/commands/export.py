"""`k3jax export CKPT_DIR HF_DIR [--experts-bf16]`: back to the released safetensors layout."""
from __future__ import annotations


def register(sub):
    p = sub.add_parser("export", help="k3jax Orbax checkpoint -> HF safetensors (released layout)")
    p.add_argument("ckpt_dir", help="a `k3jax convert` output")
    p.add_argument("hf_dir", help="output directory (must not exist)")
    p.add_argument("--experts-bf16", action="store_true", help="write routed experts as bf16, not MXFP4")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="shard size limit (default 5 GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=run)


def run(args) -> int:
    from k3jax.checkpoint.export import export

    r = export(args.ckpt_dir, args.hf_dir, experts_bf16=args.experts_bf16,
               max_shard_bytes=int(args.max_shard_gb * 1e9), progress=not args.no_progress)
    print(f"wrote {args.hf_dir}: {r['tensors']:,d} tensors in {r['shards']} shards, "
          f"{r['total_size'] / 2**20:,.1f} MiB")
    return 0
