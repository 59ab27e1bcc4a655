"""Routed-expert dispatch (SPEC.md §5): the (token, expert) pairs to the expert FFNs and
back, combined in fp32. The router and the module around it are in k3jax.layers.moe.

`dense` runs every expert on every token (an einsum; small and obviously right, the CPU
oracle); `ragged` sorts the pairs by expert and runs one grouped matmul per weight
(`k3jax.ops.grouped_matmul`: `ragged_dot` on TPU/GPU, row tiles on CPU) — dropless, each
device on its own tokens under a mesh; `ep` sends each pair to the device that owns its
expert and runs the grouped matmuls there, dropless by default or with a receive capacity
(`RuntimeOptions.ep_capacity_factor`); `gather` (decode) reads only the experts the step's
few tokens chose. `auto` (the default) is `gather` for a step with fewer (token, expert)
pairs than a device holds experts (decode: it reads at most the pairs' experts, a grouped
matmul every local one), else `ep` where the rules split the experts over an `expert` mesh
axis, else `ragged`: the one place that rule lives (`dispatch_name`).

Which mesh axes split what is read from the active rules, never assumed: the experts over
the logical `expert` axis's mesh axes, their hidden over `expert_mlp`'s (as far as they
divide), so the shard_maps here see each weight where the params already are.

Every dispatch takes (cfg, act, z, idx, w, weights, adapters): `act(gate, up)` is the
expert FFN's GLU activation, z [N, H] the latent tokens, idx/w [N, k] the routing.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from k3jax.config import EXPERT_ROLES, ConfigError, ModelConfig
from k3jax.mesh import active_mesh_axes, entry_axes, fit_spec
from k3jax.ops.qat import expert_matmul_qat
from k3jax.ops.experts import adapter_spec, dense_adapter_delta, dense_weight, expert_matmul, hidden_splits, weight_spec
from k3jax.ops.moe_gather import gather_local
from k3jax.ops.platform import target_backend

HIGHEST = jax.lax.Precision.HIGHEST

# The three routed-expert weights; w1/w3 map latent -> hidden, w2 hidden -> latent.
ROLES = EXPERT_ROLES
_HIDDEN_IS_OUT = {"w1": True, "w3": True, "w2": False}


def token_axes() -> tuple[str, ...]:
    """Mesh axes (size > 1) the MoE splits tokens over: those the active rules give
    (batch, length), so tokens enter where the model already keeps them. Never `tensor`
    or an axis splitting the expert hidden: those shards share their tokens."""
    hidden = ("tensor",) + active_mesh_axes(("expert_mlp",))
    return tuple(a for a in active_mesh_axes(("batch", "length")) if a not in hidden)


def _entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for these mesh axes (None for none)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def expert_axes(sizes: dict, num_experts: int) -> tuple[str, ...]:
    """Mesh axes the active rules split the experts over, as far as they divide them (the
    params' own placement, `mesh.fit_spec`)."""
    if not sizes:
        return ()
    spec = fit_spec((num_experts,), PartitionSpec(_entry(active_mesh_axes(("expert",)))), sizes)
    return entry_axes(spec[0])


def _hidden_axes(sizes: dict, weights, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Mesh axes the active rules split the expert hidden over, as far as they split every
    expert weight evenly (MXFP4: whole scale groups), less `exclude`."""
    kept: list[str] = []
    for a in active_mesh_axes(("expert_mlp",)) if sizes else ():
        n = math.prod(sizes[b] for b in kept) * sizes[a]
        if a not in exclude and all(hidden_splits(weights[r], _HIDDEN_IS_OUT[r], n) for r in ROLES):
            kept.append(a)
    return tuple(kept)



def _scale(cfg: ModelConfig, role: str) -> float:
    return cfg.runtime.lora.scale_of(f"block_sparse_moe/{role}")


def experts_dense(cfg: ModelConfig, act, z, idx, w, weights, adapters):
    """Every expert on every token, combined with a [N, E] weight matrix (zero off top-k).
    MXFP4 stacks are widened whole here: this is the small-config oracle (under QAT every
    expert as mxfp4(W + s·A·B), k3jax.ops.qat)."""
    if cfg.runtime.qat:
        from k3jax.ops.qat import dense_stack
        ws = {r: dense_stack(weights[r], adapters.get(r), _scale(cfg, r) if r in adapters else 0.0, z.dtype)
              for r in ROLES}
    else:
        ws = {r: dense_weight(weights[r], z.dtype) for r in ROLES}
        for r, ad in adapters.items():
            ws[r] = ws[r] + dense_adapter_delta(ad, _scale(cfg, r), z.dtype)
    comb = jnp.sum(jax.nn.one_hot(idx, ws["w1"].shape[0], dtype=jnp.float32) * w[..., None], axis=1)
    g = jnp.einsum("nd,edf->nef", z, ws["w1"])
    u = jnp.einsum("nd,edf->nef", z, ws["w3"])
    out = jnp.einsum("nef,efd->ned", act(g, u), ws["w2"])
    return jnp.einsum("ne,ned->nd", comb, out.astype(jnp.float32), precision=HIGHEST)


def _ffn(cfg: ModelConfig, act, rows, sizes, weights, adapters, expected_rows=None):
    """The expert FFN on rows sorted by expert (expected_rows: see expert_matmul)."""
    product = expert_matmul_qat if cfg.runtime.qat else expert_matmul
    mm = lambda x, r: product(x, weights[r], sizes, adapters.get(r),  # noqa: E731
                              _scale(cfg, r) if r in adapters else 0.0, expected_rows)
    return mm(act(mm(rows, "w1"), mm(rows, "w3")), "w2")


@jax.custom_vjp
def unsort_rows(x, order):
    """y with y[order[i]] = x[i] (`order` a permutation of x's rows): the rows move by
    gathers both ways (only the [m] int inverse is scattered). `zeros.at[order].set(x)` was
    a row scatter whose zero base XLA:TPU materialises at 32 bits a value and shares
    between layers, alive all step."""
    return x[jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))]


unsort_rows.defvjp(lambda x, order: (unsort_rows(x, order), order),
                   lambda order, ct: (ct[order], np.zeros(order.shape, jax.dtypes.float0)))


def _num_experts(weights) -> int:
    return jax.tree.leaves(weights["w1"])[0].shape[0]


def _specs(weights, adapters, expert_axes_: tuple[str, ...], hidden: tuple[str, ...]):
    expert, tensor = _entry(expert_axes_), _entry(hidden)
    return ({r: weight_spec(weights[r], expert, tensor, _HIDDEN_IS_OUT[r]) for r in ROLES},
            {r: adapter_spec(ad, expert, tensor, _HIDDEN_IS_OUT[r]) for r, ad in adapters.items()})


def _ragged_local(cfg: ModelConfig, act, hidden: tuple[str, ...], z, idx, w, weights, adapters):
    """Sort (token, slot) pairs by expert, grouped matmuls, unsort, fp32 combine. Token
    ids >= E (padding) sort last, count for no expert and come out zero. With the expert
    hidden split over mesh axes `hidden`, each shard's w2 product is partial: summed there."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = z[order // k]
    sizes = jnp.bincount(flat, length=_num_experts(weights)).astype(jnp.int32)
    out = _ffn(cfg, act, rows, sizes, weights, adapters)
    unsorted = unsort_rows(out, order)
    y = jnp.einsum("nkd,nk->nd", unsorted.reshape(n, k, -1).astype(jnp.float32), w, precision=HIGHEST)
    return jax.lax.psum(y, hidden) if hidden else y


def _split_tokens(z, idx, w, shards: int, num_experts: int):
    """Tokens padded to a multiple of `shards`; padded tokens route nowhere (expert id E)
    and carry weight 0. Returns (z, idx, w, n) with n the real token count."""
    n = z.shape[0]
    pad = -n % shards
    if pad:
        z = jnp.pad(z, ((0, pad), (0, 0)))
        idx = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=num_experts)
        w = jnp.pad(w, ((0, pad), (0, 0)))
    return z, idx, w, n


def experts_ragged(cfg: ModelConfig, act, z, idx, w, weights, adapters):
    """Dropless grouped matmuls over every expert. Under a mesh each device sorts and runs
    its own tokens (a shard_map over the token axes, every expert's weights on every
    device, their hidden split as the rules split `expert_mlp`): left to XLA's partitioner,
    the sort gathered every token's routing onto every device, which then ran the whole
    batch's expert matmuls."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    tok = token_axes()
    hidden = _hidden_axes(sizes, weights, exclude=tok)
    if not tok and not hidden:
        return _ragged_local(cfg, act, (), z, idx, w, weights, adapters)
    z, idx, w, n = _split_tokens(z, idx, w, math.prod(sizes[a] for a in tok), _num_experts(weights))
    ts = PartitionSpec(tok or None)
    fn = jax.shard_map(functools.partial(_ragged_local, cfg, act, hidden),
                       in_specs=(ts, ts, ts, *_specs(weights, adapters, (), hidden)), out_specs=ts)
    return fn(z, idx, w, weights, adapters)[:n]


# ---------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------
# Dropless means the receive buffer is sized for the worst case: one device may receive
# every peer's pairs, P × its own m = n·k. With `ep_capacity_factor` c > 0 it holds
# R = ceil(c·m) rows instead: senders are packed in device order, and pairs past R are
# dropped (their expert output is 0), the tail of the later senders' blocks first. Under
# Quantile Balancing each device receives about m, so c ≈ 1.25 rarely drops anything.
# The padded exchange moves P × m rows either way (CPU); ragged_all_to_all moves only the
# real rows. `RuntimeOptions.ep_exchange` 'auto' picks ragged where XLA implements it (TPU,
# GPU), padded on CPU; 'padded' | 'ragged' | 'emulated' force one ('emulated' = the ragged
# bookkeeping run through a padded all_to_all, so CPU tests can check it).


def ep_receive_rows(sent, expert_shards: int, factor: float):
    """Rows of a device's 'ep' receive buffer when each device sends `sent` pairs: every
    peer's pairs (dropless, factor 0), else ceil(factor · sent), never more than dropless."""
    if not factor:
        return expert_shards * sent
    return min(expert_shards * sent, max(1, math.ceil(factor * sent)))


def _layout(cfg: ModelConfig):
    """(mesh axis sizes, the mesh axes the experts are split over, experts per device)
    under the context mesh and rules."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    ex = expert_axes(sizes, cfg.num_experts)
    return sizes, ex, cfg.num_experts // math.prod(sizes[a] for a in ex)


def dispatch_name(cfg: ModelConfig, pairs: int | None = None) -> str:
    """The dispatch this config runs under the context mesh and rules (read while tracing)
    for a step of `pairs` (token, expert) pairs. 'auto' is 'gather' when the pairs are
    fewer than the experts a device holds (it reads at most one expert per pair; the
    grouped matmuls read every local expert), else 'ep' where the rules split the experts
    over the `expert` mesh axis, else 'ragged'."""
    name = cfg.runtime.moe_dispatch
    if name != "auto":
        return name
    _, ex, local = _layout(cfg)
    if pairs is not None and pairs < local:
        return "gather"
    return "ep" if ex == ("expert",) else "ragged"


# A step of at most this many tokens is bound by reading its weights: 'gather' multiplies
# every token with each expert it takes, n FLOPs per weight byte, under a TPU v5p's or an
# H100's FLOP/byte balance (about 166 and 295) for n <= 128. On v5p-256-serve, K3 decoding
# 32 sequences read 12.5 TB a step with 'gather' against 26.0 with 'ep' (docs/performance.md).
GATHER_MAX_TOKENS = 128


def for_inference(cfg: ModelConfig, tokens: int) -> ModelConfig:
    """The config an inference call of `tokens` tokens runs: 'auto' takes 'gather' for a
    decode step (at most GATHER_MAX_TOKENS tokens) even where the pairs outnumber a device's
    experts. Training keeps 'auto's rule: gather's weight gradient would scatter into
    every expert's."""
    if cfg.runtime.moe_dispatch != "auto" or not cfg.num_experts or tokens > GATHER_MAX_TOKENS:
        return cfg
    return cfg.with_runtime(moe_dispatch="gather")


def describe_dispatch(cfg: ModelConfig) -> str:
    """For logs: 'ep (auto; gather under 28 pairs)', the dispatch run under the context
    mesh and what was asked."""
    name = dispatch_name(cfg)
    if name == cfg.runtime.moe_dispatch:
        return name
    return f"{name} ({cfg.runtime.moe_dispatch}; gather under {_layout(cfg)[2]} pairs)"


def drops_pairs(cfg: ModelConfig) -> bool:
    """Whether this config's MoE may drop pairs (an 'ep' receive capacity is set)."""
    return dispatch_name(cfg) == "ep" and bool(cfg.runtime.ep_capacity_factor)


def _a2a_mode(cfg: ModelConfig) -> str:
    if cfg.runtime.ep_exchange != "auto":
        return cfg.runtime.ep_exchange
    return "ragged" if target_backend() in ("tpu", "gpu") else "padded"


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
    if mode == "ragged":  # its axis_name is keyword-only
        return lambda *args: jax.lax.ragged_all_to_all(*args[:6], axis_name=args[6])
    return _emulated_ragged_a2a


def ep_chunks(n: int, k: int, expert_shards: int, hidden: int, itemsize: int, cfg: ModelConfig) -> int:
    """Chunks a device's `n` tokens go through the 'ep' exchange in, one after the other, so
    that a chunk's receive buffer ([rows, hidden]: its first round's, `ep_rounds`; the
    overflow windows are as large) stays within `RuntimeOptions.ep_buffer_mib`: a dropless
    single round is sized for the worst case (every peer's pairs on one device), P x the
    mean, and the expert FFN's intermediates scale with it."""
    budget = cfg.runtime.ep_buffer_mib * (1 << 20)

    def fits(m: int) -> bool:
        return ep_rounds(m * k, expert_shards, cfg.runtime)[0] * hidden * itemsize <= budget

    if not budget or fits(n):
        return 1
    # the most tokens a chunk may hold; chunks are then evened out, never above it
    per_token = ep_rounds(k, expert_shards, cfg.runtime)[0] * hidden * itemsize
    m = max(1, min(n, int(budget // per_token)))
    while m > 1 and not fits(m):
        m -= 1
    return -(-n // m)


def _ep_local(cfg: ModelConfig, act, mode: str, hidden: tuple[str, ...], z, idx, w, weights, adapters):
    """One device's part: its tokens `z` [n, H], its experts' weights [E/P, ...], in
    `ep_chunks` chunks of tokens (each rematerialised, so only one chunk's buffers are live
    in the backward too); padding tokens route nowhere (expert id E)."""
    n, k = idx.shape
    P = jax.lax.axis_size("expert")
    C = ep_chunks(n, k, P, z.shape[-1], z.dtype.itemsize, cfg)
    exchange = functools.partial(_ep_exchange, cfg, act, mode, hidden, weights=weights, adapters=adapters)
    if C == 1:
        return exchange(z, idx, w)
    z, idx, w, _ = _split_tokens(z, idx, w, C, P * _num_experts(weights))
    y, dropped = jax.lax.map(jax.checkpoint(lambda a: exchange(*a)),
                             (z.reshape(C, -1, z.shape[-1]), idx.reshape(C, -1, k), w.reshape(C, -1, k)))
    return y.reshape(-1, y.shape[-1])[:n], jnp.sum(dropped, axis=0)


@jax.named_scope("moe_exchange")
def _ep_exchange(cfg: ModelConfig, act, mode: str, hidden: tuple[str, ...], z, idx, w, *, weights, adapters):
    """One exchange: tokens `z` [n, H] to the experts' devices and back, in one or two
    rounds (`ep_rounds`)."""
    n, k = idx.shape
    m = n * k
    P = jax.lax.axis_size("expert")
    El = _num_experts(weights)                          # experts on this device

    # the pairs sorted by expert, hence by destination device (expert e lives on e // El);
    # padding tokens carry expert id P·El: sorted last, sent nowhere (bincount drops them)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = e_sorted // El
    counts = jnp.bincount(dest, length=P).astype(jnp.int32)
    recv_counts = jax.lax.all_to_all(counts, "expert", 0, 0, tiled=True)   # what each peer sends me
    pairs = _Pairs(z[order // k], (e_sorted % El).astype(jnp.int32), dest, counts,
                   (jnp.cumsum(counts) - counts).astype(jnp.int32), recv_counts,
                   (jnp.cumsum(recv_counts) - recv_counts).astype(jnp.int32))
    one_round = functools.partial(_ep_round, cfg, act, mode, hidden, weights, adapters, pairs)
    first, overflow = ep_rounds(m, P, cfg.runtime)
    got = one_round(0, first)
    if overflow:
        # Exact: the pairs past the first round's rows go in further windows of as many rows,
        # each taken only when some device received more than the rows before it, all of
        # them skipped in one test when none did (the balanced case then costs nothing
        # more). The windows run in a scan, each rematerialised around its conditional, so
        # the backward holds one window's buffers, not the worst case's, and no branch's
        # residuals leave it. The predicates are the same on every device of the mesh, not
        # only of the expert group: a window's backward also reduces the weights' gradients
        # over the token axes, and a device that skipped it would hang its peers. k3jax.aot
        # counts the taken branches out of the balanced estimate by this scope's name.
        with jax.named_scope(OVERFLOW_SCOPE):
            every_axis = tuple(jax.sharding.get_abstract_mesh().axis_names)
            most = jax.lax.pmax(jnp.sum(recv_counts), every_axis)

            @jax.checkpoint
            def window(a):
                return jax.lax.cond(most > a, lambda a: one_round(a, first), lambda a: jnp.zeros_like(got), a)

            def windows(acc):
                starts = first + first * jnp.arange(-(-overflow // first), dtype=jnp.int32)
                return jax.lax.scan(lambda acc, a: (acc + window(a), None), acc, starts)[0]
            got = jax.checkpoint(lambda g: jax.lax.cond(most > first, windows, lambda g: g, g))(got)
    unsorted = unsort_rows(got, order).reshape(n, k, -1)
    y = jnp.einsum("nkd,nk->nd", unsorted.astype(jnp.float32), w, precision=HIGHEST)
    dropped = jnp.maximum(jnp.sum(recv_counts) - first - overflow, 0).reshape(1)   # 0 when dropless
    # with the expert hidden split over `hidden`, each shard holds a partial w2 product
    return (jax.lax.psum(y, hidden) if hidden else y), dropped


OVERFLOW_SCOPE = "ep_overflow"


def ep_rounds(m: int, expert_shards: int, runtime) -> tuple[int, int]:
    """(rows of the first round's receive buffer, rows past it the overflow windows cover;
    0: none) for a device sending m pairs. With a capacity factor c: one round of ceil(c·m)
    rows, the rest dropped. Dropless: a first round sized for the expected load
    (`ep_first_round` × m, as a capacity would be), then windows of as many rows up to the
    worst case, each run only when some device received more: under balanced routing the
    step does the capacity step's work and nothing is dropped (XLA still allocates about a
    worst-case round's memory for it: docs/performance.md). ep_first_round 0: one round sized for the worst case."""
    if runtime.ep_capacity_factor:
        return ep_receive_rows(m, expert_shards, runtime.ep_capacity_factor), 0
    worst = expert_shards * m
    first = ep_receive_rows(m, expert_shards, runtime.ep_first_round)
    return first, worst - first


class _Pairs(NamedTuple):
    """One device's (token, expert) pairs sorted by destination, and what its peers send."""
    rows: jnp.ndarray         # [m, H] the pairs' tokens
    local_e: jnp.ndarray      # [m] each pair's expert on its destination device
    dest: jnp.ndarray         # [m] destination device (P: padding, sent nowhere)
    counts: jnp.ndarray       # [P] pairs I send each device
    starts: jnp.ndarray       # [P] where each destination's block starts in my sorted pairs
    recv_counts: jnp.ndarray  # [P] pairs each peer sends me
    recv_pos: jnp.ndarray     # [P] where each peer's block starts in my packed receive order


def _ep_round(cfg: ModelConfig, act, mode: str, hidden, weights, adapters, p: _Pairs, a: int, R: int):
    """The pairs at positions [a, a + R) of each receiver's packed order (senders in device
    order, each sender's block in its sorted order) to a receive buffer of R rows, through
    the local experts, and back. Returns [m, H]: this round's pairs' results at their
    sender's sorted positions, zeros elsewhere."""
    m, H = p.rows.shape
    P = p.counts.shape[0]
    El = _num_experts(weights)
    lo = jnp.clip(a - p.recv_pos, 0, p.recv_counts).astype(jnp.int32)       # sender's pairs taken before
    accepted = jnp.clip(a + R - p.recv_pos, 0, p.recv_counts).astype(jnp.int32) - lo
    offset = (p.recv_pos + lo - a).astype(jnp.int32)                      # where they land (>= 0)
    sent = jax.lax.all_to_all(accepted, "expert", 0, 0, tiled=True)       # how many of mine each takes
    skip = jax.lax.all_to_all(lo, "expert", 0, 0, tiled=True)             # ... after how many of mine
    if mode == "padded":
        pos = jnp.arange(m) - p.starts[p.dest]
        send = jnp.zeros((P, m, H), p.rows.dtype).at[p.dest, pos].set(p.rows, mode="drop")
        send_e = jnp.full((P, m), El, jnp.int32).at[p.dest, pos].set(p.local_e, mode="drop")
        j = jnp.arange(m)[None, :]
        inside = (j >= lo[:, None]) & (j < (lo + accepted)[:, None])
        slot = jnp.where(inside, p.recv_pos[:, None] + j - a, R).reshape(P * m)  # R: not this round
        recv = jnp.zeros((R, H), p.rows.dtype).at[slot].set(
            jax.lax.all_to_all(send, "expert", 0, 0).reshape(P * m, H), mode="drop")
        recv_e = jnp.full((R,), El, jnp.int32).at[slot].set(
            jax.lax.all_to_all(send_e, "expert", 0, 0).reshape(P * m), mode="drop")
    else:
        a2a = _ragged_a2a(mode)
        where = jax.lax.all_to_all(offset, "expert", 0, 0, tiled=True)     # my block on each receiver
        recv = a2a(p.rows, jnp.zeros((R, H), p.rows.dtype), p.starts + skip, sent, where, accepted, "expert")
        recv_e = a2a(p.local_e, jnp.full((R,), El, jnp.int32), p.starts + skip, sent, where, accepted, "expert")

    # grouped matmuls over the local experts; rows past sum(sizes) (padding) give zeros.
    # Under balanced routing a device receives about the m pairs it sends: the kernels'
    # declared costs count those, not the buffer's rows.
    order2 = jnp.argsort(recv_e, stable=True)
    sizes = jnp.bincount(recv_e, length=El).astype(jnp.int32)   # id El (padding) is not counted
    out = _ffn(cfg, act, recv[order2], sizes, weights, adapters, expected_rows=min(m, R))
    out = unsort_rows(out, order2)                               # back to receive layout

    # the results back to their senders, at the sender's sorted-pair positions
    if mode == "padded":
        full = jnp.where((slot < R)[:, None], out[jnp.minimum(slot, R - 1)], 0).reshape(P, m, H)
        return jnp.where((p.dest < P)[:, None], jax.lax.all_to_all(full, "expert", 0, 0)[p.dest, pos], 0)
    their_starts = jax.lax.all_to_all(p.starts, "expert", 0, 0, tiled=True)  # where each sender wants it
    return _ragged_a2a(mode)(out, jnp.zeros((m, H), out.dtype), offset, accepted, their_starts + lo, sent,
                             "expert")


def experts_ep(cfg: ModelConfig, act, z, idx, w, weights, adapters, *, with_dropped: bool = False):
    """shard_map over the context mesh: tokens split over every batch-like axis (and always
    over `expert`), experts over `expert`, their hidden as the rules split `expert_mlp`.
    Falls back to `ragged` when there is no mesh or its expert axis is 1. `with_dropped`:
    also return the number of (token, expert) pairs the receive capacity dropped (int32
    scalar)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    if sizes.get("expert", 1) == 1:
        y = experts_ragged(cfg, act, z, idx, w, weights, adapters)
        return (y, jnp.zeros((), jnp.int32)) if with_dropped else y
    E = _num_experts(weights)
    if E % sizes["expert"]:
        raise ConfigError(f"ep dispatch: {E} experts do not divide over expert axis {sizes['expert']}")
    ex = expert_axes(sizes, E)
    if ex != ("expert",):
        raise ConfigError(f"ep dispatch sends each pair to the device holding its expert over the `expert` "
                          f"mesh axis, but the rules split the experts over {ex or 'no axis'} "
                          f"(rule expert: {active_mesh_axes(('expert',))}); use moe_dispatch auto, ragged or gather")
    hidden = _hidden_axes(sizes, weights, exclude=("expert",))
    # `expert` joins the token axes so that each expert shard holds different tokens.
    tok = token_axes()
    tok += () if "expert" in tok else ("expert",)
    z, idx, w, n = _split_tokens(z, idx, w, math.prod(sizes[b] for b in tok), E)
    ts = PartitionSpec(tok)
    fn = jax.shard_map(functools.partial(_ep_local, cfg, act, _a2a_mode(cfg), hidden),
                       in_specs=(ts, ts, ts, *_specs(weights, adapters, ("expert",), hidden)), out_specs=(ts, ts))
    y, dropped = fn(z, idx, w, weights, adapters)       # dropped: one count per token shard
    return (y[:n], jnp.sum(dropped)) if with_dropped else y[:n]


def experts_gather(cfg: ModelConfig, act, z, idx, w, weights, adapters):
    """Decode: each device reads only the experts its tokens chose (k3jax.ops.moe_gather).
    The few tokens are replicated to every device; experts stay where the rules put them
    (split over `expert`'s mesh axes, their hidden over `expert_mlp`'s) and one psum joins
    the partial outputs. With the experts unsplit and their hidden over every device
    (`v5p-256-decode`), each device reads 1/P of each chosen expert: the token's experts
    are read once in all."""
    if cfg.runtime.qat:   # decode (no gradient): the stacks as the export stores them, adapters merged
        from k3jax.ops.qat import requantized
        weights = {r: requantized(weights[r], adapters.get(r), _scale(cfg, r) if r in adapters else 0.0)
                   for r in ROLES}
        adapters = {}
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    E = _num_experts(weights)
    ex = expert_axes(sizes, E)
    hidden = _hidden_axes(sizes, weights, exclude=ex)
    local = functools.partial(gather_local, act, E // math.prod(sizes[a] for a in ex), ex, ex + hidden,
                              {r: _scale(cfg, r) for r in adapters})
    if not ex + hidden:
        return local(z, idx, w, weights, adapters)
    rep = PartitionSpec()
    fn = jax.shard_map(local, in_specs=(rep, rep, rep, *_specs(weights, adapters, ex, hidden)), out_specs=rep)
    return fn(z, idx, w, weights, adapters)


DISPATCH = {"dense": experts_dense, "ragged": experts_ragged, "ep": experts_ep, "gather": experts_gather}


@jax.named_scope("moe_dispatch")
def routed_experts(cfg: ModelConfig, act, z, idx, w, weights, adapters):
    """(y [N, H] fp32, pairs the 'ep' capacity dropped: int32 scalar, 0 where none can be)."""
    if drops_pairs(cfg):
        return experts_ep(cfg, act, z, idx, w, weights, adapters, with_dropped=True)
    return DISPATCH[dispatch_name(cfg, idx.size)](cfg, act, z, idx, w, weights, adapters), None
