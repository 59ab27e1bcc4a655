"""Sigmoid router and Stable LatentMoE (SPEC.md §5), with interchangeable dispatches.

`dense` runs every expert on every token (an einsum; small and obviously right, the CPU
oracle); `ragged` sorts the (token, expert) pairs by expert and runs one grouped matmul
per weight (`k3jax.ops.grouped_matmul`: `ragged_dot` on TPU/GPU, row tiles on CPU) —
dropless, no capacity factor; `ep` sends each pair to
the device that owns its expert and runs the grouped matmuls there. All combine in fp32.
"""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from k3jax.config import ModelConfig
from k3jax.layers.common import HIGHEST, compute_dtype, dense, logical, matrix_init, param_dtype
from k3jax.layers.mlp import GatedMLP, glu_activation
from k3jax.layers.norms import RMSNorm
from k3jax.ops.grouped_matmul import grouped_matmul


def route(x, gate_w, bias, top_k: int, renormalize: bool, scaling: float):
    """Sigmoid scores in fp32; the bias only selects, the weights use unbiased scores.

    Returns (idx [N, k] int32, weights [N, k] fp32, scores [N, E] fp32).
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), gate_w.astype(jnp.float32), precision=HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * scaling, scores


def experts_dense(cfg: ModelConfig, z, idx, w, w1, w2, w3):
    """Every expert on every token, combined with a [N, E] weight matrix (zero off top-k)."""
    comb = jnp.sum(jax.nn.one_hot(idx, w1.shape[0], dtype=jnp.float32) * w[..., None], axis=1)
    g = jnp.einsum("nd,edf->nef", z, w1)
    u = jnp.einsum("nd,edf->nef", z, w3)
    out = jnp.einsum("nef,efd->ned", glu_activation(cfg, g, u), w2)
    return jnp.einsum("ne,ned->nd", comb, out.astype(jnp.float32), precision=HIGHEST)


def experts_ragged(cfg: ModelConfig, z, idx, w, w1, w2, w3):
    """Sort (token, slot) pairs by expert, grouped matmuls, unsort, fp32 combine."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = z[order // k]
    sizes = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
    g = grouped_matmul(rows, w1, sizes)
    u = grouped_matmul(rows, w3, sizes)
    out = grouped_matmul(glu_activation(cfg, g, u), w2, sizes)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return jnp.einsum("nkd,nk->nd", unsorted.reshape(n, k, -1).astype(jnp.float32), w, precision=HIGHEST)


# ---------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------
# Dropless means the buffers are sized for the worst case: every (token, slot) pair of a
# device may route to one peer, and one device may receive every peer's pairs. The padded
# exchange moves P × worst case rows; ragged_all_to_all moves only the real rows (same
# receive layout). 'auto' picks ragged where XLA implements it (TPU, GPU), padded on CPU;
# K3JAX_EP_A2A=padded|ragged|emulated overrides ('emulated' = the ragged bookkeeping run
# through a padded all_to_all, so CPU tests can check it).
EP_A2A = os.environ.get("K3JAX_EP_A2A", "auto")


def _a2a_mode() -> str:
    if EP_A2A != "auto":
        return EP_A2A
    return "ragged" if jax.default_backend() in ("tpu", "gpu") else "padded"


def _emulated_ragged_a2a(operand, output, in_off, send, out_off, recv, axis: str):
    """`lax.ragged_all_to_all`'s documented semantics with a padded all_to_all."""
    n = operand.shape[0]
    P = in_off.shape[0]
    rows = jnp.arange(n)
    blocks = jnp.stack([jnp.take(operand, jnp.clip(in_off[p] + rows, 0, n - 1), axis=0) for p in range(P)])
    blocks = jax.lax.all_to_all(blocks, axis, 0, 0)                       # [P(source), n, ...]
    where = jax.lax.all_to_all(out_off, axis, 0, 0, tiled=True)           # sender's offset for me
    for p in range(P):
        tgt = jnp.where(rows < recv[p], where[p] + rows, output.shape[0])  # out of range → dropped
        output = output.at[tgt].set(blocks[p], mode="drop")
    return output


def _ragged_a2a(mode: str):
    return jax.lax.ragged_all_to_all if mode == "ragged" else _emulated_ragged_a2a


def _ep_local(cfg: ModelConfig, mode: str, tensor: str | None, z, idx, w, w1, w2, w3):
    """One device's part: its tokens `z` [n, H], its experts w* [E/P, ...]."""
    n, k = idx.shape
    m, H = n * k, z.shape[-1]
    P = jax.lax.axis_size("expert")
    El = w1.shape[0]                                    # experts on this device
    me = jax.lax.axis_index("expert")

    # 1. the pairs sorted by expert, hence by destination device (expert e lives on e // El)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    e_sorted = flat[order]
    rows = z[order // k]
    dest = e_sorted // El
    counts = jnp.bincount(dest, length=P).astype(jnp.int32)
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    local_e = (e_sorted % El).astype(jnp.int32)

    # 2. exchange: afterwards block p of the [P*m] receive buffer holds, from row 0, the
    #    rows device p sent here; unused rows carry local expert id El (no expert)
    if mode == "padded":
        pos = jnp.arange(m) - starts[dest]
        send = jnp.zeros((P, m, H), z.dtype).at[dest, pos].set(rows)
        send_e = jnp.full((P, m), El, jnp.int32).at[dest, pos].set(local_e)
        recv = jax.lax.all_to_all(send, "expert", 0, 0).reshape(P * m, H)
        recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0).reshape(P * m)
    else:
        a2a = _ragged_a2a(mode)
        recv_counts = jax.lax.all_to_all(counts, "expert", 0, 0, tiled=True)
        out_off = jnp.full((P,), me * m, jnp.int32)       # my block on every receiver
        recv = a2a(rows, jnp.zeros((P * m, H), z.dtype), starts, counts, out_off, recv_counts, "expert")
        recv_e = a2a(local_e, jnp.full((P * m,), El, jnp.int32), starts, counts, out_off, recv_counts, "expert")

    # 3. grouped matmuls over the local experts; rows past sum(sizes) (padding) give zeros
    order2 = jnp.argsort(recv_e, stable=True)
    sizes = jnp.bincount(recv_e, length=El).astype(jnp.int32)   # id El (padding) is not counted
    x = recv[order2]
    g = grouped_matmul(x, w1, sizes)
    u = grouped_matmul(x, w3, sizes)
    out = grouped_matmul(glu_activation(cfg, g, u), w2, sizes)
    out = jnp.zeros_like(out).at[order2].set(out)                # back to receive layout

    # 4. return the results to their senders, in the sender's sorted-pair order
    if mode == "padded":
        back = jax.lax.all_to_all(out.reshape(P, m, H), "expert", 0, 0)
        got = back[dest, pos]
    else:
        their_starts = jax.lax.all_to_all(starts, "expert", 0, 0, tiled=True)  # where each sender wants it
        got = _ragged_a2a(mode)(out, jnp.zeros((m, H), out.dtype), jnp.arange(P, dtype=jnp.int32) * m,
                                recv_counts, their_starts, counts, "expert")
    pairs = jnp.zeros_like(got).at[order].set(got).reshape(n, k, H)
    y = jnp.einsum("nkd,nk->nd", pairs.astype(jnp.float32), w, precision=HIGHEST)
    # with the expert hidden split over `tensor`, each shard holds a partial w2 product
    return jax.lax.psum(y, tensor) if tensor else y


def experts_ep(cfg: ModelConfig, z, idx, w, w1, w2, w3):
    """shard_map over the context mesh: tokens split over every batch-like axis (and always
    over `expert`), experts over `expert`, their hidden over `tensor`. Falls back to
    `ragged` when there is no mesh or its expert axis is 1."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    if sizes.get("expert", 1) == 1:
        return experts_ragged(cfg, z, idx, w, w1, w2, w3)
    E, F = w1.shape[0], w1.shape[-1]
    if E % sizes["expert"]:
        raise ValueError(f"ep dispatch: {E} experts do not divide over expert axis {sizes['expert']}")
    tensor = "tensor" if sizes.get("tensor", 1) > 1 and F % sizes["tensor"] == 0 else None
    # Token axes follow the active rules for (batch, length), so tokens enter the shard_map
    # where the model already keeps them; `expert` is added so each expert shard holds
    # different tokens. Never `tensor`: tensor shards share tokens and split the hidden.
    ruled = nn.logical_to_mesh_axes(("batch", "length"))
    tok = []
    for a in ruled or ():
        for b in (a,) if isinstance(a, str) else (a or ()):
            if b in sizes and b != "tensor" and b not in tok:
                tok.append(b)
    if "expert" not in tok:
        tok.append("expert")
    tok = tuple(b for b in tok if sizes[b] > 1)
    shards = math.prod(sizes[b] for b in tok)
    n = z.shape[0]
    pad = -n % shards                      # padded tokens carry weight 0 and are cut off below
    if pad:
        z = jnp.pad(z, ((0, pad), (0, 0)))
        idx = jnp.pad(idx, ((0, pad), (0, 0)))
        w = jnp.pad(w, ((0, pad), (0, 0)))
    ts = PartitionSpec(tok)
    wspec_in, wspec_out = PartitionSpec("expert", None, tensor), PartitionSpec("expert", tensor, None)
    fn = jax.shard_map(functools.partial(_ep_local, cfg, _a2a_mode(), tensor),
                       in_specs=(ts, ts, ts, wspec_in, wspec_out, wspec_in), out_specs=ts)
    return fn(z, idx, w, w1, w2, w3)[:n]


DISPATCH = {"dense": experts_dense, "ragged": experts_ragged, "ep": experts_ep}


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
        gate_w = self.param("gate", logical(nn.initializers.normal(0.02), ("embed", "expert")), (D, E), param_dtype(cfg))
        bias = self.param("e_score_correction_bias", logical(nn.initializers.zeros, ("expert",)), (E,), jnp.float32)
        idx, w, scores = route(xf, gate_w, bias, k, cfg.moe_renormalize, cfg.routed_scaling_factor)
        self.sow("intermediates", "router_scores", scores)
        self.sow("intermediates", "router_idx", idx)

        z = dense(cfg, H, ("embed", "latent"), "routed_expert_down_proj")(xf) if cfg.use_latent_moe else xf
        pdt, cdt = param_dtype(cfg), compute_dtype(cfg)
        w1 = self.param("w1", matrix_init(("expert", "latent", "mlp")), (E, H, F), pdt).astype(cdt)
        w3 = self.param("w3", matrix_init(("expert", "latent", "mlp")), (E, H, F), pdt).astype(cdt)
        w2 = self.param("w2", matrix_init(("expert", "mlp", "latent")), (E, F, H), pdt).astype(cdt)
        y = DISPATCH[cfg.runtime.moe_dispatch](cfg, z.astype(cdt), idx, w, w1, w2, w3).astype(cdt)
        if cfg.use_latent_moe:
            if cfg.latent_moe_use_norm:
                y = RMSNorm(cfg.rms_norm_eps, "latent", name="routed_expert_norm")(y)
            y = dense(cfg, D, ("latent", "embed"), "routed_expert_up_proj")(y)
        if cfg.num_shared_experts:
            y = y + GatedMLP(cfg, cfg.shared_intermediate_size, name="shared_experts")(xf)
        return y.reshape(shape)
