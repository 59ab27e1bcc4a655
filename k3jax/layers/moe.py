"""Sigmoid router and Stable LatentMoE (SPEC.md §5). Where the routed pairs go is
k3jax.ops.moe_dispatch (`RuntimeOptions.moe_dispatch`: dense, ragged, ep, gather, auto)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from k3jax.config import ConfigError, ModelConfig
from k3jax.layers.common import (HIGHEST, compute_dtype, constrain, dense, logical, lora_a_init, lora_b_init, matrix_init,
                                 param_dtype)
from k3jax.layers.mlp import GatedMLP, glu_activation
from k3jax.layers.norms import RMSNorm
from k3jax.layout import layer_subpath
from k3jax.ops.moe_dispatch import ROLES, dispatch_name, routed_experts, token_axes
from k3jax.ops.mxfp4 import GROUP_SIZE, MXFP4, quantize_mxfp4_jax


def route(x, gate_w, bias, top_k: int, renormalize: bool, scaling: float):
    """Sigmoid scores in fp32; the bias only selects, the weights use unbiased scores.

    Returns (idx [N, k] int32, weights [N, k] fp32, scores [N, E] fp32).
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), gate_w.astype(jnp.float32), precision=HIGHEST)
    scores = jax.nn.sigmoid(logits)
    idx = _top_k_indices(scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * scaling, scores


def _top_k_indices(x, top_k: int):
    """top_k's indices along the last axis, on each device's own tokens under a mesh: XLA's
    partitioner gathers every token's scores onto every device for a TopK (jaxlib 0.10),
    [N, E] per MoE layer, which for K3 is every token of the global batch times 896."""
    mesh = jax.sharding.get_abstract_mesh()
    tok = token_axes()
    if not tok or x.shape[0] % math.prod(dict(mesh.shape)[a] for a in tok):
        return jax.lax.top_k(x, top_k)[1]
    spec = PartitionSpec(tok)
    return jax.shard_map(lambda x: jax.lax.top_k(x, top_k)[1], in_specs=spec, out_specs=spec)(x)


def gradients_together(x, *trees):
    """x and the float leaves of `trees`, unchanged, behind one optimization barrier. Its
    transpose is a barrier on their cotangents, so the gradient flowing back from x leaves
    the layer only with the weights' gradients complete (summed over rounds and reduced
    over the token shards). Left free, XLA:TPU sank K3's expert weight gradients and their
    all-reduces to the end of each scanned group's backward, holding the group's layers'
    receive rows and cotangents alive at once (9.2 GiB a chip at 256 x 4096 on v5p-1024:
    docs/performance.md)."""
    leaves, treedef = jax.tree.flatten(trees)
    floats = [i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.floating)]
    x, tied = jax.lax.optimization_barrier((x, [leaves[i] for i in floats]))
    for i, a in zip(floats, tied):
        leaves[i] = a
    return (x, *jax.tree.unflatten(treedef, leaves))


class StableLatentMoE(nn.Module):
    """Router → latent down-projection → routed experts → RMSNorm → up-projection, plus
    the shared experts on the unprojected input. Without a latent (Kimi-Linear) the
    experts run at model width and there is no down/up/norm."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        E, k, D, F = cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size, cfg.moe_intermediate_size
        H = cfg.moe_hidden_size
        shape = x.shape
        xf = x.reshape(-1, D)
        gate_w = self.param("gate", logical(nn.initializers.normal(0.02), ("embed", "router")), (D, E), param_dtype(cfg))
        bias = self.param("e_score_correction_bias", logical(nn.initializers.zeros, ("expert",)), (E,), jnp.float32)
        with jax.named_scope("moe_router"):
            idx, w, scores = route(xf, gate_w, bias, k, cfg.moe_renormalize, cfg.routed_scaling_factor)
        self.sow("intermediates", "router_scores", scores)
        self.sow("intermediates", "router_idx", idx)

        z = dense(cfg, H, ("embed", "low_rank"), "routed_expert_down_proj")(xf) if cfg.use_latent_moe else xf
        # 'gather' (decode) takes the few tokens' latents whole on every device: left to
        # itself XLA gathered the down- and up-projections' weights split along low_rank
        # (51 MB a chip a layer for K3 on v5p-256-serve) instead of the [tokens, latent] rows
        dispatch = dispatch_name(cfg, idx.size)
        gather = cfg.use_latent_moe and dispatch == "gather"
        if gather:
            z = constrain(z, (None, "low_rank"))
        cdt = compute_dtype(cfg)
        shapes = {"w1": ((E, H, F), ("expert", "latent", "expert_mlp")),
                  "w2": ((E, F, H), ("expert", "expert_mlp", "latent")),
                  "w3": ((E, H, F), ("expert", "latent", "expert_mlp"))}
        weights = {r: self._expert_weight(r, *shapes[r]) for r in ROLES}
        adapters = {r: ad for r in ROLES if (ad := self._expert_adapter(r, *shapes[r])) is not None}
        if dispatch == "ep":
            z, weights, adapters = gradients_together(z, weights, adapters)
        y, dropped = routed_experts(cfg, functools.partial(glu_activation, cfg), z.astype(cdt), idx, w,
                                    weights, adapters)
        if dropped is not None:
            self.sow("intermediates", "ep_dropped", dropped)   # pairs the capacity dropped
        y = y.astype(cdt)
        if gather:
            y = constrain(y, (None, "low_rank"))
        if cfg.use_latent_moe:
            if cfg.latent_moe_use_norm:
                y = RMSNorm(cfg.rms_norm_eps, "latent", name="routed_expert_norm")(y)
            y = dense(cfg, D, ("low_rank", "embed"), "routed_expert_up_proj")(y)
        if cfg.num_shared_experts:
            y = y + GatedMLP(cfg, cfg.shared_intermediate_size, name="shared_experts")(xf)
        return y.reshape(shape)

    def _expert_weight(self, role: str, shape: tuple[int, int, int], axes: tuple[str, str, str]):
        """[E, in, out] in the compute dtype, or the MXFP4 pair ({'weight_packed',
        'weight_scale'} params, [E, out, in/2] and [E, out, in/32] uint8)."""
        cfg = self.cfg
        init = matrix_init(axes)
        if cfg.runtime.expert_format == "bf16":
            w = self.param(role, init, shape, param_dtype(cfg))
            # QAT quantizes the stored (master) values, as the export does, not a cast of them
            return w if cfg.runtime.qat else w.astype(compute_dtype(cfg))
        E, n_in, n_out = shape
        if n_in % GROUP_SIZE:
            raise ConfigError(f"expert_format 'mxfp4': {role}'s input width {n_in} is not a multiple of "
                             f"{GROUP_SIZE}")
        stored_axes = (axes[0], axes[2], axes[1])                 # [E, out, in/…]

        def mxfp4_init(key):
            # the widened format's draw, quantized: the same seed gives the same experts
            # plain unwrap: nn.unbox would constrain to the logical names under a context mesh
            w = init(key, shape, param_dtype(cfg))
            w = w.value if isinstance(w, nn.meta.AxisMetadata) else w
            packed, scale = quantize_mxfp4_jax(jnp.swapaxes(w, -1, -2))
            return {"weight_packed": nn.LogicallyPartitioned(packed, stored_axes),
                    "weight_scale": nn.LogicallyPartitioned(scale, stored_axes)}

        p = self.param(role, mxfp4_init)
        return MXFP4(p["weight_packed"], p["weight_scale"])

    def _expert_adapter(self, role: str, shape: tuple[int, int, int], axes: tuple[str, str, str]):
        """(A, B) of a routed-expert LoRA target ('lora' collection, B zero at init), or None."""
        cfg = self.cfg
        lora = cfg.runtime.lora
        target = f"{layer_subpath(self.path)}/{role}"
        if lora is None or target not in lora.targets:
            return None
        E, n_in, n_out = shape
        r, pdt = lora.rank_of(target), param_dtype(cfg)

        def init():
            if lora.expert_mode == "shared_a":
                a = lora_a_init((axes[1], None))(self.make_rng("lora"), (n_in, r), pdt)
            else:
                a = lora_a_init((axes[0], axes[1], None))(self.make_rng("lora"), (E, n_in, r), pdt)
            b = lora_b_init((axes[0], None, axes[2]))(self.make_rng("lora"), (E, r, n_out), pdt)
            return {"lora_a": a, "lora_b": b}

        ad = self.variable("lora", role, init).value
        return ad["lora_a"], ad["lora_b"]
