"""Model FLOPs per token and this machine's peak, the numerator and denominator of the
train log's MFU (also `k3jax compile`'s and benchmarks/train_step.py's definition)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from k3jax.config import expert_role


def measured_peak_flops(n: int = 1024, repeats: int = 3) -> float:
    """This machine's dense fp32 matmul FLOP/s (the MFU denominator when none is configured)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        f(a).block_until_ready()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t)


def flops_per_token(params, k_over_e: float, groups=None, top_k: int = 1) -> float:
    """Model FLOPs per token for forward+backward: 2 per weight value forward, 2 more for
    the input gradient and, for trained weights, 2 for their own gradient (6 for a fully
    trained model; 4 for a frozen base under LoRA). Every weight except the embedding
    lookup counts, routed experts (and their per-expert adapters) at k/E, a shared expert A
    ('shared_a') k times; MXFP4 experts by
    their values (two per packed byte, scales not counted). Attention-score FLOPs are left
    out, so MFU here is a slight under-estimate."""
    from k3jax.layout import is_scanned
    from k3jax.train.muon import TRAINED, path_str
    group_of = {} if groups is None else {path_str(p): g for p, g in jax.tree_util.tree_leaves_with_path(groups)}
    total = 0.0
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", k)) for k in p]
        if keys[0] == "embed_tokens" or keys[-1] == "weight_scale":
            continue
        values = x.size * (2 if keys[-1] == "weight_packed" else 1)
        expert = expert_role(keys) is not None
        # a shared A ('shared_a') has no expert axis: each of a token's k pairs goes through it
        shared_a = expert and keys[-1] == "lora_a" and x.ndim == 2 + is_scanned(keys[1:])
        trained = groups is None or group_of.get(path_str(p)) in TRAINED
        scale = top_k if shared_a else k_over_e if expert else 1.0
        total += values * scale * (6.0 if trained else 4.0)
    return total
