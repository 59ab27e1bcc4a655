"""Quantization-aware fine-tuning (`qat: true`): the params as the export will store them.

`k3jax export` writes routed experts as MXFP4 and every other weight in its release dtype:
bf16, except the tensors the release keeps in fp32 (KDA A_log, dt_bias, conv weights,
o_norm, the router bias) and, from a run, the params the model itself keeps in fp32 (norms,
AttnRes vectors). Under QAT the train step's forward (and `k3jax logits` of a QAT run)
sees exactly that:

- routed experts: mxfp4(W + s·A·B) inside the expert matmuls (k3jax.ops.qat);
- LoRA-merged projections: bf16(W + s·A·B) inside `Dense` (k3jax.layers.common);
- every other weight the export rounds to bf16: rounded here, before the model runs
  (`view`), gradients straight through. With bf16 params this is the identity.

Master weights and optimizer state are untouched: only the forward's view changes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig, expert_role
from k3jax.model import LORA_KEY, param_shapes
from k3jax.ops.qat import round_bf16, straight_through


@functools.lru_cache(maxsize=8)
def rounded_paths(cfg: ModelConfig) -> frozenset:
    """Param paths the export writes as bf16 and the model does not handle itself: leaves
    held in bf16 when the params are bf16 (the others the model keeps in fp32, and the
    export with them), less the routed experts (ops.qat)."""
    tree = param_shapes(cfg.with_runtime(param_dtype="bfloat16", lora=None, qat=False))
    return frozenset(tuple(k.key for k in p) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
                     if leaf.dtype == jnp.bfloat16 and expert_role([k.key for k in p]) is None)


def view(cfg: ModelConfig, params):
    """`params` as a QAT forward sees them (module doc): bf16 leaves where the export writes
    bf16, except the LoRA-adapted kernels (Dense merges and rounds those). The identity
    unless `cfg.runtime.qat`."""
    if not cfg.runtime.qat:
        return params
    paths = rounded_paths(cfg)
    adapted = set()
    if LORA_KEY in params:
        adapted = {tuple(k.key for k in p)[:-1] + ("kernel",)
                   for p, _ in jax.tree_util.tree_leaves_with_path(params[LORA_KEY])}

    def one(p, x):
        key = tuple(k.key for k in p)
        if key in paths and key not in adapted and x.dtype != jnp.bfloat16:
            # rounded on the bits (ops.qat.round_bf16: XLA may drop a cast pair), kept in its
            # own dtype (a bf16 leaf would make layers that infer their compute dtype from
            # it run in bf16), the gradient straight through
            return straight_through(x, round_bf16(x).astype(x.dtype))
        return x

    out = {k: v for k, v in params.items() if k == LORA_KEY}
    rest = {k: v for k, v in params.items() if k != LORA_KEY}
    return {**jax.tree_util.tree_map_with_path(one, rest), **out}
