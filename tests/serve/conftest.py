"""A tiny toy K3 written as a model directory (HF safetensors): layer 0 KDA with the dense
MLP, layer 1 MLA with the MoE, so every cache kind (KDA state + conv tails, MLA latents)
is served. Random numpy weights: nothing to compile to make them."""
import json

import numpy as np
import pytest

from k3jax import config as C

LAYERS = ("kda", "mla")


def write_tiny_model(d, seed=3):
    import jax

    from k3jax import model as M
    from k3jax.checkpoint.hf_params import from_tree_layout
    from k3jax.checkpoint.names import stored_shape, tensor_map
    from k3jax.checkpoint.safetensors_io import write_safetensors
    from k3jax.testing.variants import variant_dict
    hf = variant_dict(layers=LAYERS, attn_res_block_size=2)
    hf.pop("train")
    cfg = C.K3Config.from_hf(hf).text
    rng = np.random.default_rng(seed)
    # scales that give the toy peaked next-token distributions (greedy far from ties)
    params = jax.tree_util.tree_map_with_path(
        lambda p, s: np.ones(s.shape, np.float32) if p[-1].key in ("weight", "norm") else
        (rng.normal(size=s.shape) / np.sqrt(s.shape[-2] if len(s.shape) > 1 else 1)).astype(np.float32),
        M.param_shapes(cfg))
    out = {}
    for e in tensor_map(cfg, "k3", "mlp"):
        leaf = params
        for k in e.path:
            leaf = leaf[k]
        slot = np.asarray(leaf, np.float32)[e.index]
        if e.is_expert:
            out[f"{e.hf}.weight"] = np.ascontiguousarray(slot.T)
        else:
            out[e.hf] = from_tree_layout(e, slot, stored_shape(e, slot.shape, cfg, "k3"))
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(d / "model.safetensors", out)
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve_model") / "tiny")
