"""`k3jax convert HF_DIR OUT_DIR [--dry-run]`: HF safetensors → Orbax, streamed layer by layer."""
from __future__ import annotations

import sys
import time

from k3jax.commands import add_expert_format, writing


def register(sub):
    p = sub.add_parser("convert", help="HF safetensors checkpoint -> k3jax Orbax checkpoint (streamed)")
    p.add_argument("hf_dir", help="directory with config.json and model.safetensors[.index.json[.gz]]")
    p.add_argument("out_dir", nargs="?", help="output directory (must not exist); not needed with --dry-run")
    p.add_argument("--dry-run", action="store_true",
                   help="read only config.json and the index; list every missing / unexpected name")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_expert_format(p, "stored")
    p.set_defaults(fn=run)


def run(args) -> int:
    from k3jax.checkpoint.convert import convert, dry_run

    if args.dry_run:
        r = dry_run(args.hf_dir)
        for name in r["missing"]:
            print(f"missing     {name}")
        for name in r["unexpected"]:
            print(f"unexpected  {name}")
        text = r["matched"]
        print(f"{r['index']}: {r['total']:,d} names; {text:,d} text tensors matched "
              f"({r['experts_mxfp4']:,d} MXFP4 expert weights), {len(r['vision']):,d} vision/projector; "
              f"{len(r['missing']):,d} missing, {len(r['unexpected']):,d} unexpected "
              f"(layout {r['layout']}, dense MLP as '{r['dense_mlp_name']}')")
        ok = not r["missing"] and not r["unexpected"] and text + len(r["vision"]) == r["total"]
        print("complete mapping" if ok else "INCOMPLETE mapping")
        return 0 if ok else 1
    if args.out_dir is None:
        print("k3jax convert: error: OUT_DIR is required unless --dry-run", file=sys.stderr)
        return 2
    t = time.perf_counter()
    with writing(args.out_dir):
        m = convert(args.hf_dir, args.out_dir, progress=not args.no_progress, log=print,
                    expert_format=args.expert_format)
    dt = time.perf_counter() - t
    print(f"wrote {args.out_dir}: {m['tensors']:,d} tensors, {m['source_bytes'] / 2**20:,.1f} MiB read "
          f"in {dt:.1f} s ({m['source_bytes'] / 2**20 / max(dt, 1e-9):,.1f} MiB/s); experts {m['experts']} "
          f"(held as {m['expert_format']})")
    return 0
