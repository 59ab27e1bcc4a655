"""`k3jax vision-features DIR (--pixels P.npy --grids G.npy | --image FILE...) --out F.npy`.

Projector output rows (float32 [Σ rows, text_hidden_size], image after image) of the vision
tower + merger + projector whose weights live in DIR: an HF safetensors directory or a
`k3jax convert` output with a vision/ tree (training runs hold the text model only).
`--pixels` takes pre-patchified pixels in the reference's layout ([num_patches, 3, P, P],
see shared/fixtures/fixture_v/README.md) with their grid_thws [num_images, 3]; `--image`
decodes, resizes, normalises and patchifies image files as the K3 processor does.
"""
from __future__ import annotations

import json
import os


def register(sub):
    p = sub.add_parser("vision-features", help="image features (vision tower + projector) from an HF checkpoint")
    p.add_argument("dir", help="HF checkpoint (config.json with vision_config + safetensors) or a "
                               "`k3jax convert` output with vision/")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pixels", help="float .npy [num_patches, 3, P, P], normalised, reference layout")
    src.add_argument("--image", nargs="+", metavar="FILE", help="image files to preprocess")
    p.add_argument("--grids", help="int .npy [num_images, 3] (t, h, w) in patches; required with --pixels")
    p.add_argument("--out", required=True, help="output .npy, float32 [rows, text_hidden_size]")
    p.add_argument("--grids-out", help="with --image: also save the computed grid_thws here")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.set_defaults(fn=run)


def _vision_params(src, vcfg):
    """The fp32 vision tree of an HF directory or a convert output's vision/ item."""
    import jax
    import numpy as np
    if src.kind == "hf":
        from k3jax.checkpoint.vision_names import load_vision_params
        return load_vision_params(vcfg, src.path, np.float32)
    from k3jax.checkpoint.orbax_io import restore_tree
    from k3jax.layers.vision import vision_param_shapes
    return jax.tree.map(np.asarray, restore_tree(src.vision_dir, vision_param_shapes(vcfg, np.float32)))


def run(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from k3jax.checkpoint.load import resolve
    from k3jax.commands import atomic_write, output_path
    from k3jax.config import ConfigError
    from k3jax.layers.vision import check_grids, rows_per_image, vision_features
    from k3jax.errors import InputError
    from k3jax.vision.inputs import images_from_files, load_npy

    out = output_path(args.out, ".npy")             # checked before anything is loaded
    grids_out = output_path(args.grids_out, ".npy") if args.grids_out else None
    cfg_path = os.path.join(args.dir, "config.json")
    if os.path.isfile(cfg_path):   # before the text config is parsed: the vision tower is what matters here
        with open(cfg_path) as f:
            if not json.load(f).get("vision_config"):
                raise ConfigError(f"{cfg_path}: no vision_config (not a K3 checkpoint with a vision tower)")
    src = resolve(args.dir)
    if src.k3.vision is None:
        raise ConfigError(f"{src.describe()}: no vision_config (not a K3 checkpoint with a vision tower)")
    if src.kind == "run" or (src.kind == "orbax" and src.vision_dir is None):
        raise ConfigError(f"{src.describe()}: holds no vision weights (training runs and text-only "
                          "conversions keep the text model only); use the HF checkpoint")
    vcfg = src.k3.vision

    if args.pixels:
        if not args.grids:
            raise InputError("--pixels needs --grids GRID_THWS.npy")
        pixels, grids = load_npy(args.pixels, "--pixels"), load_npy(args.grids, "--grids")
    else:
        if args.grids:
            raise InputError("--grids goes with --pixels; --image computes the grids itself")
        pixels, grids = images_from_files(args.dir, vcfg, args.image)
        if grids_out:
            atomic_write(grids_out, lambda f: np.save(f, grids))

    g = check_grids(vcfg, grids)
    params = _vision_params(src, vcfg)
    feats = np.asarray(vision_features(vcfg, params, pixels, g, dtype=jnp.dtype(args.dtype)), np.float32)
    atomic_write(out, lambda f: np.save(f, feats))
    rows = rows_per_image(vcfg, g)
    print(f"{len(g)} image(s), grids {[list(x) for x in g]} -> rows {rows}; features {feats.shape} -> {out}")
    return 0
