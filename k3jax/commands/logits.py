"""`k3jax logits DIR --tokens IDS.npy --out LOGITS.npy`: fp32 logits of one forward pass."""
from __future__ import annotations


def register(sub):
    p = sub.add_parser("logits", help="fp32 logits of a forward pass from an HF or Orbax checkpoint")
    p.add_argument("dir", help="HF safetensors directory or `k3jax convert` output")
    p.add_argument("--tokens", required=True, help=".npy of integer token ids [batch, length] (or [length])")
    p.add_argument("--out", required=True, help="where to write the float32 logits .npy [batch, length, vocab]")
    p.add_argument("--kda-impl", default="chunk", choices=["recurrent", "chunk"])
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
    k3, params = load_model_dir(args.dir, {"param_dtype": "float32", "dtype": "float32",
                                           "kda_impl": args.kda_impl})
    logits = np.asarray(forward(k3.text, params, tokens.astype(np.int32)), np.float32)
    np.save(args.out, logits)
    print(f"wrote {args.out}: logits {tuple(logits.shape)} float32")
    return 0
