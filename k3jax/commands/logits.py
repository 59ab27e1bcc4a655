"""`k3jax logits DIR --tokens IDS.npy --out LOGITS.npy`: fp32 logits of one forward pass.

With images (`--image FILE...`, or pre-patchified `--pixels P.npy --grids G.npy` in the
reference layout), the tokens hold one `<|media_pad|>` per image, expanded here into the
image's feature rows (or already expanded); the logits are those of the expanded tokens.
"""
from __future__ import annotations

from k3jax.commands import add_expert_format
from k3jax.config import KDA_IMPLS


def register(sub):
    p = sub.add_parser("logits", help="fp32 logits of a forward pass from an HF or Orbax checkpoint")
    p.add_argument("dir", help="HF safetensors directory, `k3jax convert` output, training run directory "
                               "or its checkpoints/N")
    p.add_argument("--tokens", required=True, help=".npy of integer token ids [batch, length] (or [length])")
    p.add_argument("--out", required=True, help="where to write the float32 logits .npy [batch, length, vocab]")
    p.add_argument("--image", nargs="+", metavar="FILE",
                   help="image files, one per <|media_pad|> in the tokens (row-major over the batch)")
    p.add_argument("--pixels", help="instead of --image: float .npy [num_patches, 3, P, P], reference layout")
    p.add_argument("--grids", help="with --pixels: int .npy [num_images, 3] (t, h, w) in patches")
    p.add_argument("--kda-impl", default="auto", choices=KDA_IMPLS)
    add_expert_format(p, "held")
    p.add_argument("--mesh", default=None,
                   help="mesh preset (configs/meshes/*.yaml) or YAML path: params and tokens are sharded "
                        "over it, with 'ep' expert dispatch where its expert axis is > 1")
    p.set_defaults(fn=run)


def run(args) -> int:
    import numpy as np

    from k3jax.checkpoint.load import load_config, load_model_dir
    from k3jax.commands import atomic_write, output_path
    from k3jax.errors import InputError, check_token_ids
    from k3jax.model import forward, multimodal as mm
    from k3jax.vision import inputs

    out_path = output_path(args.out, ".npy")          # before anything is loaded
    tokens = inputs.load_npy(args.tokens, "--tokens")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise InputError(f"{args.tokens}: token ids must be [batch, length] (or [length]), got shape {tokens.shape}")
    # fp32 params and activations: this command is the parity reference path
    runtime = {"param_dtype": "float32", "dtype": "float32", "kda_impl": args.kda_impl,
               "expert_format": args.expert_format}
    declared = load_config(args.dir)
    tokens = check_token_ids(tokens, declared.text.vocab_size, args.tokens)   # before the int32 cast
    images = inputs.images_from_args(args, declared.vision, args.dir)
    pixels = grids = None
    if images is not None:
        pixels, grids = images
        img = mm.prepare_images(declared.vision, pixels, grids)  # bad images fail before the weights load
        tokens = inputs.expand_tokens(tokens, img.rows, inputs.media_pad_id(declared))

    def run_forward(cfg, k3, params, tokens):
        from k3jax.train import qat
        params = qat.view(cfg, params)   # a QAT run's weights as its forward saw them
        if images is None:
            return forward(cfg, params, tokens)
        return mm.forward_with_images(cfg, k3.vision, params, tokens, pixels, grids, pad_id=inputs.media_pad_id(k3))

    if args.mesh is None:
        k3, params = load_model_dir(args.dir, runtime, vision=images is not None)
        logits = np.asarray(run_forward(k3.text, k3, params, tokens), np.float32)
    else:
        import jax

        from k3jax.mesh import batch_sharding, fit_spec, load_mesh, use_mesh
        from k3jax.model import param_shardings
        mesh, rules = load_mesh(args.mesh)
        # restored straight onto the mesh: no host ever holds the whole tree (Orbax input)
        k3, params = load_model_dir(args.dir, runtime, lambda c: param_shardings(c, mesh, rules),
                                    vision=images is not None)
        cfg = k3.text
        with use_mesh(mesh, rules):
            # a batch smaller than the batch axes stays replicated along the axes it cannot fill
            spec = fit_spec(tokens.shape, batch_sharding(mesh, rules).spec, dict(mesh.shape))
            tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, spec))
            logits = np.asarray(run_forward(cfg, k3, params, tokens), np.float32)
    atomic_write(out_path, lambda f: np.save(f, logits))
    print(f"wrote {out_path}: logits {tuple(logits.shape)} float32")
    return 0
