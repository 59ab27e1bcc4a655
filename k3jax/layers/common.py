"""Small pieces every layer uses: dtypes, initialisers with logical axes, projections."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from k3jax.config import ModelConfig
from k3jax.layout import layer_subpath
from k3jax.ops.qat import merged_bf16

# Contractions feeding a softmax or a top-k selection (AttnRes scores, router logits) run
# at full fp32 precision: at TPU default precision they lose ~3 significant digits.
HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.runtime.dtype)


def param_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.runtime.param_dtype)


def matrix_init(axes: tuple[str, ...], in_axis: int = -2):
    """Fan-in scaled truncated normal, tagged with logical axis names."""
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis)
    return nn.with_logical_partitioning(init, axes)


def logical(init, axes: tuple[str, ...]):
    return nn.with_logical_partitioning(init, axes)


def lora_a_init(axes: tuple, in_axis: int = -2):
    """LoRA's A: uniform in ±1/√fan_in (PEFT's kaiming-uniform with a = √5), logical axes."""
    return logical(nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=in_axis), axes)


def lora_b_init(axes: tuple):
    """LoRA's B: zeros, so the adapted model starts as the base. Computed from the key (as
    0 · u) so that under `init_params`' vmap over layers B is batched like every other
    leaf: jax's ragged_dot batching rule rejects an unbatched operand."""
    def init(key, shape, dtype):
        return jnp.zeros(shape, dtype) * jax.random.uniform(key, (), dtype)
    return logical(init, axes)


def lora_target(cfg: ModelConfig, module: nn.Module):
    """(LoraSpec, target) when this module's place in its decoder layer is a LoRA target."""
    lora = cfg.runtime.lora
    if lora is None:
        return None, None
    target = layer_subpath(module.path)
    return (lora, target) if target in lora.targets else (None, None)


class Dense(nn.Module):
    """A bias-free projection x @ kernel, kernel [in, out] (the checkpoint stores [out, in]),
    the same arithmetic as nn.Dense. As a LoRA target (`RuntimeOptions.lora`) it adds
    (alpha/r)·(x @ A) @ B, A [in, r] and B [r, out] in the `lora` collection, B zero at
    init so the adapted model starts as the base."""
    cfg: ModelConfig
    features: int
    axes: tuple[str, str]
    precision: object = None

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.cfg, compute_dtype(self.cfg)
        kernel = self.param("kernel", matrix_init(self.axes), (x.shape[-1], self.features), param_dtype(cfg))
        xc, kc = nn.dtypes.promote_dtype(x, kernel, dtype=dt)
        y = jax.lax.dot_general(xc, kc, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        lora, target = lora_target(cfg, self)
        if lora is None:
            return y
        r = lora.rank_of(target)
        a = self.variable("lora", "lora_a", lambda: lora_a_init((self.axes[0], None))(
            self.make_rng("lora"), (x.shape[-1], r), param_dtype(cfg))).value
        b = self.variable("lora", "lora_b", lambda: lora_b_init((None, self.axes[1]))(
            self.make_rng("lora"), (r, self.features), param_dtype(cfg))).value
        if cfg.runtime.qat:
            return self._qat(xc, kernel, a, b, lora.scale_of(target))
        low = jnp.dot(xc, a.astype(dt), precision=self.precision)
        return y + lora.scale_of(target) * jnp.dot(low, b.astype(dt), precision=self.precision)

    def _qat(self, xc, kernel, a, b, scale):
        """x @ bf16(W + scale·A·B), the weight the release stores, merged one rank at a time
        in fp32 as the exporter merges it; A and B get the low-rank path's gradient
        (straight through the rounding) from a term that is zero in value, x the exact one."""
        w = jax.lax.stop_gradient(merged_bf16(kernel, a, b, scale)).astype(xc.dtype)
        y = jax.lax.dot_general(xc, w, (((xc.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        x0 = jax.lax.stop_gradient(xc)
        t = scale * jnp.dot(jnp.dot(x0, a.astype(xc.dtype), precision=self.precision), b.astype(xc.dtype),
                            precision=self.precision)
        return y + (t - jax.lax.stop_gradient(t))


def dense(cfg: ModelConfig, features: int, axes: tuple[str, str], name: str, precision=None) -> Dense:
    """A bias-free projection; see `Dense`."""
    return Dense(cfg, features, axes, precision, name=name)


def merged_kernel(cfg: ModelConfig, module: nn.Module, name: str):
    """The effective kernel W + (alpha/r)·A·B of the child projection `name` (W alone when it
    is not a LoRA target): for paths that use the weight itself (MLA's absorbed decode)."""
    kernel = nn.unbox(module.variables["params"][name]["kernel"])
    lora = cfg.runtime.lora
    target = layer_subpath(module.path + (name,))
    if lora is None or target not in lora.targets:
        return kernel
    ad = module.variables["lora"][name]
    if cfg.runtime.qat:   # the released weight, as the forward's projections see it
        merged = merged_bf16(kernel, nn.unbox(ad["lora_a"]), nn.unbox(ad["lora_b"]), lora.scale_of(target))
        return merged.astype(kernel.dtype)
    a, b = nn.unbox(ad["lora_a"]).astype(jnp.float32), nn.unbox(ad["lora_b"]).astype(jnp.float32)
    return (kernel.astype(jnp.float32) + lora.scale_of(target) * (a @ b)).astype(kernel.dtype)


def constrain(x, axes: tuple[str | None, ...]):
    """Activation sharding hint by logical axes; a no-op outside a mesh with rules."""
    return nn.with_logical_constraint(x, axes)


class TokenEmbed(nn.Embed):
    """nn.Embed whose lookup reads the table gathered whole along `embed`.

    The table is sharded along `embed` (ZeRO-3) while tokens are sharded along `batch`. A
    plain lookup leaves the backward's scatter-add to move the batch-sharded cotangent
    onto the embed-sharded table, which XLA can only do by replicating the whole
    [B, T, D] cotangent on every device. Gathering the (compute-dtype) table first makes
    the backward a local scatter-add whose sum over the batch shards reduces onto the
    table's sharding, like every other weight gradient.
    """

    def __call__(self, inputs):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"token ids must be integers, got {inputs.dtype}")
        (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return jnp.take(constrain(table, ("vocab", None)), inputs, axis=0)
