"""`k3jax export CKPT_DIR HF_DIR [--experts-bf16] [--adapter | --merge-lora]`: back to the released layout.

CKPT_DIR is a `k3jax convert` output, a training run directory (its newest checkpoint) or
one of its `checkpoints/N`. Every tensor is written in the release's dtype (bf16, fp32 where
the release stores fp32; a run's fp32 norms stay fp32); the last lines say which tensors
changed dtype on the way."""
from __future__ import annotations

from k3jax.commands import number, writing


def register(sub):
    p = sub.add_parser("export", help="k3jax checkpoint or training run -> HF safetensors (released layout)")
    p.add_argument("ckpt_dir", help="a `k3jax convert` output, a training run directory or its checkpoints/N")
    p.add_argument("hf_dir", help="output directory (must not exist)")
    p.add_argument("--experts-bf16", action="store_true", help="write routed experts as bf16, not MXFP4")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--adapter", action="store_true",
                     help="a LoRA run's adapters as a PEFT directory (adapter_config.json, adapter_model.safetensors)")
    how.add_argument("--merge-lora", action="store_true",
                     help="a LoRA run folded into its base (W + (alpha/r)·B·A), experts re-quantized to MXFP4")
    p.add_argument("--max-shard-gb", type=number(float, 0, low_open=True), default=5.0, help="shard size limit (default 5 GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=run)


def run(args) -> int:
    from k3jax.checkpoint.export import export, export_adapter

    if args.adapter:
        with writing(args.hf_dir):
            r = export_adapter(args.ckpt_dir, args.hf_dir, log=print)
        print(f"wrote {args.hf_dir} from {r['source']}: PEFT LoRA adapter, rank {r['rank']}, "
              f"{r['tensors']:,d} tensors ({r['bytes'] / 2**20:,.1f} MiB) on {len(r['targets'])} module kinds "
              f"({', '.join(r['targets'])}); routed experts per expert (experts.E.w1/w2/w3)")
        if r["router_biases"]:
            print(f"  + the router biases of {r['router_biases']} layers (Quantile Balancing updated them) as "
                  f"modules_to_save 'block_sparse_moe.gate': PEFT applies them; a server that rejects "
                  f"modules_to_save needs a run with the router frozen, or --merge-lora")
        return 0
    with writing(args.hf_dir):
        r = export(args.ckpt_dir, args.hf_dir, experts_bf16=args.experts_bf16,
                   max_shard_bytes=int(args.max_shard_gb * 1e9), progress=not args.no_progress, log=print,
                   merge_lora=args.merge_lora)
    print(f"wrote {args.hf_dir} from {r['source']}: {r['tensors']:,d} tensors in {r['shards']} shards, "
          f"{r['total_size'] / 2**20:,.1f} MiB; routed experts {'bf16' if args.experts_bf16 else 'MXFP4'}")
    if r["kept_fp32"]:
        print(f"kept fp32: {r['kept_fp32']:,d} tensor(s) the model keeps in fp32 (norms, AttnRes; the release "
              "rounds them to bf16, which would change this run's logits)")
    if "requant" in r:
        q = r["requant"]
        worst = ", ".join(f"{w['tensor']} {w['relative_error']:.2e}" for w in q["worst"])
        print(f"merge re-quantization: {q['experts_requantized']:,d} merged experts back to MXFP4, RMS error "
              f"{q['relative_error']:.3e} of their values and {q['error_over_update']:.3f} of the adapters' update "
              f"(worst: {worst})")
        if q["error_over_update"] > 1:
            print("note: MXFP4's step is larger than the adapters' change to the experts: serve the adapter "
                  "(--adapter) or export the experts in bf16 (--experts-bf16) to keep it")
    if "lost" in r:
        import sys

        from k3jax.checkpoint.update_loss import describe
        lines = describe(r["lost"])
        print(lines[0])
        for line in lines[1:]:
            print(line, file=sys.stderr)
    if r["casts"]:
        print("cast to the release's dtypes: " + ", ".join(f"{n:,d} tensor(s) {k}" for k, n in sorted(r["casts"].items())))
    else:
        print("no dtype casts: every tensor was stored in the release's dtype")
    return 0
