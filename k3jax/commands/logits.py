"""`k3jax logits DIR --tokens IDS.npy --out LOGITS.npy`: fp32 logits of one forward pass."""
from __future__ import annotations


def register(sub):
    p = sub.add_parser("logits", help="fp32 logits of a forward pass from an HF or Orbax checkpoint")
    p.add_argument("dir", help="HF safetensors directory or `k3jax convert` output")
    p.add_argument("--tokens", required=True, help=".npy of integer token ids [batch, length] (or [length])")
    p.add_argument("--out", required=True, help="where to write the float32 logits .npy [batch, length, vocab]")
    p.add_argument("--kda-impl", default="chunk", choices=["recurrent", "chunk", "assoc", "pallas"])
    p.add_argument("--mesh", default=None,
                   help="mesh preset (configs/meshes/*.yaml) or YAML path: params and tokens are sharded "
                        "over it, with 'ep' expert dispatch where its expert axis is > 1")
    p.set_defaults(fn=run)


def run(args) -> int:
    import numpy as np

    from k3jax.checkpoint.load import load_model_dir
    from k3jax.model import forward

    tokens = np.load(args.tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{args.tokens}: token ids must be integers, got {tokens.dtype}")
    # fp32 params and activations: this command is the parity reference path
    runtime = {"param_dtype": "float32", "dtype": "float32", "kda_impl": args.kda_impl}
    tokens = tokens.astype(np.int32)
    if args.mesh is None:
        k3, params = load_model_dir(args.dir, runtime)
        logits = np.asarray(forward(k3.text, params, tokens), np.float32)
    else:
        import jax

        from k3jax import sharding
        mesh, rules = sharding.load_mesh(args.mesh)
        # restored straight onto the mesh: no host ever holds the whole tree (Orbax input)
        k3, params = load_model_dir(args.dir, runtime, lambda c: sharding.param_shardings(c, mesh, rules))
        cfg = k3.text.with_runtime(moe_dispatch="ep") if dict(mesh.shape).get("expert", 1) > 1 else k3.text
        with sharding.use_mesh(mesh, rules):
            # a batch smaller than the batch axes stays replicated along the axes it cannot fill
            spec = sharding.fit_spec(tokens.shape, sharding.batch_sharding(mesh, rules).spec, dict(mesh.shape))
            tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, spec))
            logits = np.asarray(forward(cfg, params, tokens), np.float32)
    np.save(args.out, logits)
    print(f"wrote {args.out}: logits {tuple(logits.shape)} float32")
    return 0
