"""Quantile Balancing (SPEC.md §5): re-solve the router bias from each step's router scores.

For one MoE layer with scores s [m, n] (sigmoid, fp32), current bias b [n], top-k routing:
  α_i  = (k+1)-th largest of s_i + b          (the entry cut-off for token i)
  r_ij = α_i − s_ij                           (the bias expert j would need to win token i)
  b̂_j = the (q+1)-th smallest of r_{:,j},  q = ⌊m·k/n⌋   (exactly q tokens have r_ij < b̂_j)
  b    ← b̂ − mean(b̂)                         (replaced, not stepped; used from the next step)

`exact` sorts r per expert (fine while m·n is small), sweeping the experts a few times
(Gauss–Seidel, see `solve_exact`) so the balance is exact on the step's own scores. `hist` is the at-scale estimator: per-expert
histograms of r over uniform bins on [min b − 1, max b + 1] (r always lies there because
s ∈ (0, 1)); the counts are plain sums, so microbatches and data-parallel shards add up (under
jit the global-batch sum is one all-reduce that GSPMD inserts), and the target rank is
interpolated linearly inside its bin.

Tokens with `valid == False` (padding) neither count towards m nor get a vote.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def entry_margins(scores, bias, k: int):
    """r [m, n] = α_i − s_ij with α_i the (k+1)-th largest of s_i + b."""
    s = scores.astype(jnp.float32)
    biased = s + bias.astype(jnp.float32)
    n = s.shape[-1]
    if k >= n:  # every expert is always picked: no cut-off exists
        return jnp.full_like(s, -jnp.inf)
    alpha = jax.lax.top_k(biased, k + 1)[0][..., k]
    return alpha[..., None] - s


def _recentre(b):
    return b - jnp.mean(b)


def solve_exact(scores, bias, k: int, valid=None, sweeps: int = 6):
    """The new (re-centred) bias from one step's scores [m, n]; valid [m] bool or None.

    Expert by expert (Gauss–Seidel), the quantile rule with each expert's exact cut-off:
    token i admits expert j iff s_ij + b_j beats the k-th largest *other* biased score t_ij
    (= α_i when j is already selected, which is the SPEC's formula), so b_j is set halfway
    between the q-th and (q+1)-th smallest r_ij = t_ij − s_ij and exactly q tokens pick j.
    One Jacobi pass (all experts at once, the SPEC's literal rule) leaves a large residual
    imbalance when the incoming routing is skewed, because every expert's move shifts the
    others' cut-offs; a few sweeps give every expert m·k/n tokens (±1) on the same scores,
    so the next step starts balanced. Cost: sweeps·n sorts of m values — small batches only.
    """
    s = scores.astype(jnp.float32)
    m, n = s.shape
    if k >= n:
        return jnp.zeros_like(bias, jnp.float32)
    valid = jnp.ones((m,), bool) if valid is None else valid
    q = jnp.clip((jnp.sum(valid).astype(jnp.int32) * k) // n, 1, m - 1)

    def one_expert(step, b):
        j = step % n
        others = jnp.where(jnp.arange(n) == j, -jnp.inf, s + b)
        t = jax.lax.top_k(others, k)[0][:, k - 1]
        r = jnp.sort(jnp.where(valid, t - s[:, j], jnp.inf))
        return b.at[j].set(0.5 * (r[q - 1] + r[q]))

    b = jax.lax.fori_loop(0, sweeps * n, one_expert, bias.astype(jnp.float32))
    return _recentre(b)


def hist_range(bias):
    return jnp.min(bias) - 1.0, jnp.max(bias) + 1.0


def histogram(scores, bias, k: int, valid=None, bins: int = 1000):
    """Per-expert counts [n, bins] of r over [min b − 1, max b + 1]; additive across shards."""
    r = entry_margins(scores, bias, k)
    lo, hi = hist_range(bias)
    m, n = r.shape
    idx = jnp.clip(jnp.floor((r - lo) / (hi - lo) * bins), 0, bins - 1).astype(jnp.int32)
    w = jnp.ones((m,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    flat = idx + bins * jnp.arange(n, dtype=jnp.int32)[None, :]
    counts = jnp.zeros((n * bins,), jnp.float32).at[flat.reshape(-1)].add(
        jnp.broadcast_to(w[:, None], (m, n)).reshape(-1))
    return counts.reshape(n, bins)


def solve_hist(counts, bias, k: int):
    """The new bias from summed histograms: the point where the cumulative count reaches
    q = m·k/n, linearly interpolated inside its bin (m = tokens counted per expert row)."""
    n, bins = counts.shape
    lo, hi = hist_range(bias)
    width = (hi - lo) / bins
    m = jnp.sum(counts[0])
    q = jnp.floor(m * k / n)
    cum = jnp.cumsum(counts, axis=1)
    j = jnp.argmax(cum > q, axis=1)                     # first bin holding the (q+1)-th value
    before = jnp.where(j > 0, jnp.take_along_axis(cum, (j - 1)[:, None], 1)[:, 0], 0.0)
    inside = jnp.take_along_axis(counts, j[:, None], 1)[:, 0]
    frac = jnp.clip((q + 0.5 - before) / jnp.maximum(inside, 1.0), 0.0, 1.0)
    return _recentre(lo + (j + frac) * width)


def expert_load(idx, n: int, valid=None):
    """Tokens per expert [n] from top-k indices [m, k] (fp32 counts)."""
    w = jnp.ones(idx.shape[:1], jnp.float32) if valid is None else valid.astype(jnp.float32)
    return jnp.zeros((n,), jnp.float32).at[idx.reshape(-1)].add(
        jnp.broadcast_to(w[:, None], idx.shape).reshape(-1))


# ---------------------------------------------------------------------------------------
# Whole-model plumbing: biases live in params, scores in the 'intermediates' collection
# ---------------------------------------------------------------------------------------
def bias_paths(params) -> list[tuple[str, ...]]:
    """Key paths of every MoE layer's router bias (unrolled: [n]; scanned: [layers, n])."""
    out = []
    for p, _ in jax.tree_util.tree_leaves_with_path(params):
        keys = tuple(str(getattr(k, "key", k)) for k in p)
        if keys[-1] == "e_score_correction_bias":
            out.append(keys)
    return out


def _get(tree, keys):
    for key in keys:
        tree = tree[key]
    return tree


def layer_router_outputs(intermediates, path):
    """(scores [.., m, n], idx [.., m, k]) sown by the MoE layer at a bias path."""
    node = _get(intermediates, path[:-1])
    scores, idx = node["router_scores"], node["router_idx"]
    return (scores[0] if isinstance(scores, tuple) else scores,
            idx[0] if isinstance(idx, tuple) else idx)


def step_stats(params, intermediates, k: int, valid, method: str, bins: int):
    """Per bias path: what the balancer needs from one microbatch, and the expert loads.

    exact: the margins' inputs (scores) are kept; hist: only the [n, bins] counts. Leading
    scan axes (stacked layers) are vmapped.
    """
    out = {}
    for path in bias_paths(params):
        bias = _get(params, path)
        scores, idx = layer_router_outputs(intermediates, path)
        lead = bias.ndim - 1
        load = expert_load
        if method == "hist":
            f = lambda s, b: histogram(s, b, k, valid, bins)
        else:
            f = lambda s, b: s
        g = lambda i: load(i, bias.shape[-1], valid)
        for _ in range(lead):
            f, g = jax.vmap(f), jax.vmap(g)
        out["/".join(path)] = {"stat": f(scores, bias), "load": g(idx)}
    return out


def accumulator_zeros(params, method: str, bins: int):
    """Zeros shaped like the stats that add up across microbatches (step_stats' "load", and
    with 'hist' its "stat" counts), from the bias shapes alone: no model trace needed."""
    out = {}
    for path in bias_paths(params):
        b = _get(params, path)
        entry = {"load": jnp.zeros(b.shape, jnp.float32)}
        if method == "hist":
            entry["stat"] = jnp.zeros((*b.shape, bins), jnp.float32)
        out["/".join(path)] = entry
    return out


def new_biases(params, stats, k: int, valid, method: str, sweeps: int = 6):
    """Params with every router bias replaced by its re-solved value.

    `stats` from `step_stats`, already combined over microbatches: exact → scores
    concatenated along tokens (and `valid` likewise); hist → counts summed.
    """
    updates = {}
    for path in bias_paths(params):
        if "/".join(path) not in stats:   # a frozen router keeps its bias
            continue
        bias = _get(params, path)
        stat = stats["/".join(path)]["stat"]
        if method == "hist":
            f = lambda c, b: solve_hist(c, b, k)
        else:
            f = lambda s, b: solve_exact(s, b, k, valid, sweeps)
        for _ in range(bias.ndim - 1):
            f = jax.vmap(f)
        updates[path] = f(stat, bias).astype(bias.dtype)
    return _replace(params, updates)


def _replace(tree, updates, prefix=()):
    if not isinstance(tree, dict) and not hasattr(tree, "items"):
        return updates.get(prefix, tree)
    return {key: _replace(v, updates, prefix + (key,)) for key, v in tree.items()}


def load_summary(stats, k: int, n_tokens):
    """Per-layer max/min expert load relative to the balanced m·k/n: {path: [.., 2]}."""
    out = {}
    for path, st in stats.items():
        load = st["load"]
        ideal = jnp.maximum(n_tokens * k / load.shape[-1], 1e-9)
        out[path] = jnp.stack([jnp.max(load, -1) / ideal, jnp.min(load, -1) / ideal], -1)
    return out
