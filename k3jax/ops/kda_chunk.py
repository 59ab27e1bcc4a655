"""Chunkwise (UT / WY) form of Kimi Delta Attention, SPEC.md §3.

Callers go through `k3jax.ops.kda.kda(..., impl="chunk")`; this module holds the math.
Inputs here are already fp32, q carries the attention scale (chunk_terms) or comes with it
(chunk_kda), and packed documents arrive as a boolean `reset` [B, T] (True where the state
restarts from zero).

Within a chunk of C tokens, with G the in-chunk cumulative log decay:
  A = StrictTril(diag(β) [k_i·(k_j ⊙ e^{G_i−G_j})]),  (I + A) [W | U] = diag(β) [K ⊙ e^G | V],
  P = Tril_incl(q_i·(k_j ⊙ e^{G_i−G_j})),  K̃ = K ⊙ e^{G_C−G},  Q̃ = Q ⊙ e^G,
and per chunk, carrying h:  V' = U − W h;  O = Q̃ h + P V';  h ← Diag(e^{G_C}) h + K̃ᵀ V'.

Every exponent is kept <= 0: the gate can be unbounded below (Kimi-Linear's softplus
gate), so e^{G_j−G_i} for j < i would overflow. Pairwise decays are factored through a
reference token that sits between i and j, so each factor is e^{≤0} (_intra_chunk_scores).

XLA:CPU notes that shaped this file: batched matmuls run far faster than cumsum
(reduce-window), triangular_solve, three-operand einsums or lax.cond, so the cumulative
sum, the scores and the triangular inverse are all plain matmuls.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.platform import target_backend
from pallas_kernels.kda_blocks import pair_join_mask, score_leaf

# fp32 matmuls throughout: the state accumulates over the whole sequence and the decays
# span many orders of magnitude, so bf16 passes (TPU default precision) are not enough.
_PREC = jax.lax.Precision.HIGHEST



def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_PREC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product(spec, a, b):
    """_einsum(spec, a, b) of two operands, with a gradient whose matmuls produce their
    results in the layout they are used in. Autodiff's own produces them transposed and
    leaves XLA:CPU a transposed-operand matmul (Eigen) at a third of the usual rate."""
    return _einsum(spec, a, b)


def _natural(target, x, y):
    """einsum of x ("xs") and y ("ys") into `target`, the operands ordered so that the
    matmul's natural output order (batch, x's free, y's free) is already the target's."""
    (xs, xv), (ys, yv) = x, y
    free_x = [target.index(c) for c in xs if c in target and c not in ys]
    free_y = [target.index(c) for c in ys if c in target and c not in xs]
    if free_x and free_y and min(free_y) < min(free_x):
        (xs, xv), (ys, yv) = (ys, yv), (xs, xv)
    return _einsum(f"{xs},{ys}->{target}", xv, yv)


def _product_fwd(spec, a, b):
    return _einsum(spec, a, b), (a, b)


def _product_bwd(spec, res, ct):
    a, b = res
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    return _natural(sa, (out, ct), (sb, b)), _natural(sb, (sa, a), (out, ct))


_product.defvjp(_product_fwd, _product_bwd)


class ChunkTerms(NamedTuple):
    """Per-chunk quantities, each [B, H, N, ...] (N chunks of C tokens)."""

    q_decayed: jax.Array  # Q̃, rows that see the incoming state: [..., C, K]
    p: jax.Array  # intra-chunk causal scores P, incl. diagonal: [..., C, C]
    w: jax.Array  # W: [..., C, K]
    u: jax.Array  # U: [..., C, V]
    k_tail: jax.Array  # K̃, rows that reach the outgoing state: [..., C, K]
    decay: jax.Array  # e^{G_C}, zero if a document starts inside the chunk: [..., K]


def _to_chunks(x, n_chunks, chunk_size):
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padded in T."""
    b, t, h = x.shape[:3]
    pad = n_chunks * chunk_size - t
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n_chunks, chunk_size, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def _rows_dot_cols(a, b, col):
    """(a colᵀ, b colᵀ) as one matmul: a and b stacked by rows. Two matmuls of these small
    shapes cost XLA:CPU more than one of twice the rows (5% of the 16k forward)."""
    n = a.shape[-2]
    both = _einsum("...ik,...jk->...ij", jnp.concatenate([a, b], axis=-2), col)
    return both[..., :n, :], both[..., n:, :]


def _intra_chunk_scores(q, k, G, leaf=1):
    """Pairwise scores x_i·(k_j ⊙ e^{G_i−G_j}) for x = q and x = k, i > j, [..., C, C].

    Only the strictly lower triangle is meaningful (the rest is zero, or finite values
    inside leaf blocks): the caller masks, and takes the diagonal x_i·k_i, which does not
    depend on G, directly.
    Recursive halving: in a block of b tokens, every pair (i in the upper half, j in the
    lower half) factors through the upper half's first token m (j < m <= i) as
    e^{G_i−G_m} · e^{G_m−G_j}, both e^{<=0}, so the whole off-diagonal quadrant is one
    matmul; the two halves recurse. Every exponent is <= 0 for any gate, the FLOPs are
    those of one half C×C×K product, and there are log2(C) exps per element of q and k
    (an elementwise [C, C, K] decay tensor would need C, and is memory-bound on CPU).

    A gate bounded below (g >= lb, K3's "safe" gate) allows leaf blocks of `leaf` tokens
    (score_leaf): each is one matmul through its middle token, whose factors e^{±≤(leaf/2)|lb|}
    and products e^{≤(leaf−1)|lb|} stay finite in fp32. That replaces the recursion's
    smallest levels, whose tiny matmuls cost far more than their FLOPs (16-token leaves:
    ~7% of the 16k forward on CPU).
    """
    *lead, b, K = k.shape
    if b == 1:
        zero = jnp.zeros((*lead, 1, 1), k.dtype)
        return zero, zero
    if b <= leaf:
        m = G[..., b // 2 : b // 2 + 1, :]
        row = jnp.exp(G - m)
        return _rows_dot_cols(q * row, k * row, k * jnp.exp(m - G))
    h = b // 2
    halves = lambda x: x.reshape(*lead, 2, h, K)  # noqa: E731
    q2, k2, G2 = halves(q), halves(k), halves(G)
    m = G2[..., 1, :1, :]
    row = jnp.exp(G2[..., 1, :, :] - m)  # upper half, e^{G_i − G_m}
    col = k2[..., 0, :, :] * jnp.exp(m - G2[..., 0, :, :])  # lower half, e^{G_m − G_j}
    off_q, off_k = _rows_dot_cols(q2[..., 1, :, :] * row, k2[..., 1, :, :] * row, col)
    # Recurse on a flat batch: nesting [..., 2, 2, ..., h, K] would grow the rank with
    # log2(C), and XLA:CPU aborts on rank-8 fusions (C = 128).
    fold = lambda x: x.reshape(-1, h, K)  # noqa: E731
    in_q, in_k = _intra_chunk_scores(fold(q2), fold(k2), fold(G2), leaf)
    in_q, in_k = (x.reshape(*lead, 2, h, h) for x in (in_q, in_k))

    def assemble(off, inner):
        zero = jnp.zeros_like(off)
        top = jnp.concatenate([inner[..., 0, :, :], zero], axis=-1)
        bottom = jnp.concatenate([off, inner[..., 1, :, :]], axis=-1)
        return jnp.concatenate([top, bottom], axis=-2)

    return assemble(off_q, in_q), assemble(off_k, in_k)


def _triangles(C, dtype, *parts):
    """[C, len(parts)·C]: the named C×C triangles of ones side by side ("lower": j <= i,
    "upper": j >= i, "before": j < i)."""
    ones = jnp.ones((C, C), dtype)
    tri = {"lower": jnp.tril(ones), "upper": jnp.triu(ones), "before": jnp.tril(ones, k=-1)}
    return jnp.concatenate([tri[p] for p in parts], axis=1)


def _by_triangles(tri, x):
    """tri [C, C'] applied to x [Z, C', K] within each chunk, as a matmul: XLA:CPU lowers
    cumsum to a reduce-window (C adds per element, unvectorised), several times slower.
    The triangle is broadcast over Z so the product is batched and comes out [Z, C, K]:
    with one shared triangle XLA computes [Z·K, C] instead, and every elementwise
    consumer then reads it transposed (measured 10% of the forward at 16k)."""
    return _einsum("zij,zjk->zik", jnp.broadcast_to(tri, (x.shape[0], *tri.shape)), x)


@jax.custom_vjp
def _chunk_decays(g):
    """(G, A) for g [Z, C, K]: G the in-chunk cumulative log decay Σ_{t<=i} g_t, and
    A = Σ_{t>i} g_t the log decay from token i to the chunk's end (= G_C − G_i).

    The gradient sends A's cotangent to those g_t directly. Sent through G instead,
    every g_t would receive G_C's cotangent (Σ_i d_i) minus the part for tokens before t,
    a difference of large terms: under strong decay (g ≈ −5) that lost dg ~1e-4 of its
    accuracy at T = 1000. Both cotangents go back in one product with two triangles side
    by side (autodiff's transpose of the forward product also left XLA:CPU a transposed
    copy)."""
    G = _by_triangles(_triangles(g.shape[1], g.dtype, "lower"), g)
    return G, G[:, -1:, :] - G


def _chunk_decays_bwd(_, cts):
    dG, dA = cts
    C = dG.shape[1]
    # dg_t = Σ_{i>=t} dG_i + Σ_{i<t} dA_i
    return (_by_triangles(_triangles(C, dG.dtype, "upper", "before"), jnp.concatenate([dG, dA], 1)),)


_chunk_decays.defvjp(lambda g: (_chunk_decays(g), None), _chunk_decays_bwd)


# Diagonal blocks this size are inverted whole (unit_lower_inverse), then joined in small
# batched products (blocked_unit_lower_inverse): inverting the whole chunk with masked
# C×C products was 37% slower on the 16k forward.
_SOLVE_BLOCK = 16


def blocked_unit_lower_inverse(a):
    """(I + A)^{-1} for strictly lower-triangular A [Z, C, C].

    Built explicitly and applied to W's and U's right-hand sides in a product each.
    Forward substitution by 16-row blocks costs half the FLOPs, but its C/16 dependent
    steps of small matmuls, slices and concatenations took XLA:CPU four times their FLOP
    time (a fifth of the 16k forward at C = 64); XLA:CPU's triangular_solve is slower
    still.

    The 16×16 diagonal blocks are inverted by unit_lower_inverse, then neighbouring
    inverses are joined pairwise, [[T1, 0], [A21, T2]] ↦ [[T1, 0], [−T2 A21 T1, T2]],
    all pairs of a level in one batched product: log2(C/16) levels. A is zero-padded to a
    power of two first; the inverse's leading C×C block is that of A's leading block.
    """
    Z, C, _ = a.shape
    P = 1 << (C - 1).bit_length()
    if P != C:
        a = jnp.pad(a, [(0, 0), (0, P - C), (0, P - C)])
    size = min(P, _SOLVE_BLOCK)
    blocks = a.reshape(Z, P // size, size, P // size, size)
    t = unit_lower_inverse(jnp.stack([blocks[:, i, :, i] for i in range(P // size)], axis=1))
    while size < P:  # t: [Z, m, size, size], the inverses of the m diagonal blocks
        m = P // size
        blocks = a.reshape(Z, m, size, m, size)
        a21 = jnp.stack([blocks[:, 2 * i + 1, :, 2 * i] for i in range(m // 2)], axis=1)
        t1, t2 = t[:, 0::2], t[:, 1::2]
        t21 = -_einsum("zmij,zmjk->zmik", t2, _einsum("zmij,zmjk->zmik", a21, t1))
        top = jnp.concatenate([t1, jnp.zeros_like(t1)], axis=-1)
        bottom = jnp.concatenate([t21, t2], axis=-1)
        t = jnp.concatenate([top, bottom], axis=-2)
        size *= 2
    return t.reshape(Z, P, P)[:, :C, :C]


@jax.custom_vjp
def unit_lower_solve(a, *rhs):
    """(I + A)^{-1} x for each x [Z, C, D] in rhs, A [Z, C, C] strictly lower triangular
    (only its strictly lower triangle is read).

    The inverse is built once (blocked_unit_lower_inverse) and each x is one product with
    it: one product of [W | U]'s concatenation cost XLA:CPU more than two. The gradient is
    the solve's own, dx = Tᵀ dy and dA = −StrictTril(Σ dx yᵀ) with T the inverse: two
    products per right-hand side. Autodiff through the inverse's joins instead left XLA:CPU
    dozens of 16×16 products at a few percent of its matmul rate (16k forward+backward:
    818 → 754 ms).
    """
    return _unit_lower_solve_fwd(a, *rhs)[0]


def _unit_lower_solve_fwd(a, *rhs):
    inverse = blocked_unit_lower_inverse(a)
    ys = tuple(_einsum("zij,zjd->zid", inverse, x) for x in rhs)
    return ys, (inverse, ys)


def _unit_lower_solve_bwd(res, dys):
    inverse, ys = res
    dxs = tuple(_einsum("zji,zjd->zid", inverse, dy) for dy in dys)
    da = sum(_einsum("zid,zjd->zij", dx, y) for dx, y in zip(dxs, ys))
    C = inverse.shape[-1]
    return (-jnp.where(np.tril(np.ones((C, C), bool), -1), da, 0.0), *dxs)


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def unit_lower_inverse(a):
    """(I + A)^{-1} for strictly lower-triangular A [..., n, n], n a power of two.

    Neighbouring diagonal blocks' inverses are joined pairwise, sizes 1, 2, 4, ...: with T
    block-diagonal (blocks of size s, inverses of I + A's diagonal blocks) and A_s the
    blocks just below T's (pair_join_mask), T − T A_s T is the inverse for blocks of 2s.
    2·log2(n) − 2 batched matmuls. The product formula Π_k (I + (−A)^{2^k}) costs the same
    but adds up powers of A that can be far larger than the result: with consecutive keys
    nearly equal and β ≈ 1 (A ≈ all ones below the diagonal), A^8 reaches 3e3 in a 16×16
    block and U lost 1e-4 of relative accuracy. XLA:CPU's batched triangular_solve runs
    at a small fraction of its matmul rate, and matmuls are what TPUs and GPUs do best.
    """
    n = a.shape[-1]
    row, col = np.arange(n)[:, None], np.arange(n)[None, :]
    t = jnp.eye(n, dtype=a.dtype) - jnp.where(pair_join_mask(row, col, 1), a, 0.0)
    s = 2
    while s < n:
        below = jnp.where(pair_join_mask(row, col, s), a, 0.0)
        t = t - _einsum("...ij,...jk->...ik", t, _einsum("...ij,...jk->...ik", below, t))
        s *= 2
    return t


def chunk_terms(q, k, v, g, beta, reset, chunk_size, gate_lower_bound=None) -> ChunkTerms:
    """Everything about each chunk that does not depend on its incoming state.

    q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], beta [B,T,H] fp32 (q pre-scaled);
    reset [B,T] bool; gate_lower_bound: None, or a promise that g >= it everywhere
    (score_leaf). T is zero-padded up to a multiple of chunk_size: a padded token
    has g = 0 and β = 0, so it neither decays nor writes the state, and q = 0 reads nothing.
    """
    B, T, H, _ = q.shape
    n_chunks = max(1, -(-T // chunk_size))

    # Work on one flat batch axis Z = B·H·N: XLA:CPU (jax 0.10.2) segfaults in the
    # gradient of these elementwise-plus-einsum blocks when a size-1 axis sits between
    # larger leading axes (e.g. [B, H, 1, C, K]); a single batch axis avoids it.
    def flat(x):
        x = _to_chunks(x, n_chunks, chunk_size)
        return x.reshape(-1, *x.shape[3:])

    q, k, v, g, beta = (flat(x) for x in (q, k, v, g, beta))  # [Z, C, ...]

    # Document structure per chunk, as masks (never -inf gates: inf − inf = nan).
    r = jnp.pad(reset, [(0, 0), (0, n_chunks * chunk_size - T)])
    r = jnp.cumsum(r.reshape(B, 1, n_chunks, chunk_size).astype(jnp.int32), axis=-1)  # [B]-sized
    r = jnp.broadcast_to(r, (B, H, n_chunks, chunk_size)).reshape(-1, chunk_size)
    sees_in = r == 0  # no reset between the chunk start and this token (inclusive)
    reaches_out = r == r[..., -1:]  # no reset after this token within the chunk
    same_doc = r[..., :, None] == r[..., None, :]  # [Z, C, C]
    clean = r[..., -1] == 0  # the incoming state survives the whole chunk

    G, after = _chunk_decays(g)
    G_last = G[..., -1:, :]
    pow2 = 1 << (chunk_size - 1).bit_length()  # the halving recursion wants a power of two
    leaf = score_leaf(gate_lower_bound, chunk_size)
    if pow2 == chunk_size:
        p_raw, a_raw = _intra_chunk_scores(q, k, G, leaf)
    else:  # pad with k = 0 tokens (no scores) that do not decay, then drop them
        pad = [(0, 0), (0, pow2 - chunk_size), (0, 0)]
        p_raw, a_raw = _intra_chunk_scores(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(G, pad, mode="edge"),
                                           leaf)
        p_raw, a_raw = p_raw[:, :chunk_size, :chunk_size], a_raw[:, :chunk_size, :chunk_size]
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool), k=-1)
    # P's diagonal q_i·k_i straight from q and k: a leaf block's factors would also send
    # its O(1) terms into dG, twice with opposite signs, and under strong decay (dg ~ e^-5)
    # that rounding cost dg ~5e-5 of relative accuracy.
    diagonal = jnp.eye(chunk_size, dtype=bool)
    p = jnp.where(diagonal, jnp.sum(q * k, -1)[..., None], jnp.where(strict & same_doc, p_raw, 0.0))
    a = jnp.where(strict & same_doc, a_raw, 0.0) * beta[..., :, None]

    # T = (I + A)^{-1} diag(β) applied to [K ⊙ e^G | V]. Rows past a reset must not read
    # the incoming state, so their K ⊙ e^G rows are zeroed (A couples only tokens of the
    # same document).
    k_decayed = jnp.where(sees_in[..., None], k * jnp.exp(G), 0.0)
    w, u = unit_lower_solve(a, beta[..., None] * k_decayed, beta[..., None] * v)

    terms = ChunkTerms(
        q_decayed=jnp.where(sees_in[..., None], q * jnp.exp(G), 0.0),
        p=p,
        w=w,
        u=u,
        k_tail=jnp.where(reaches_out[..., None], k * jnp.exp(after), 0.0),
        decay=jnp.where(clean[..., None], jnp.exp(G_last[..., 0, :]), 0.0),
    )
    return jax.tree.map(lambda x: x.reshape(B, H, n_chunks, *x.shape[1:]), terms)


# Tokens per block of the schedule (whole chunks), by backend. On CPU a block's terms
# must stay in cache: 128 measured fastest for chunks of 16, 32 and 64 (benchmarks/kda.py;
# 16k forward with K3's gate bound, C = 32: 390 / 376 / 389 ms at 64 / 128 / 256 tokens
# per block). A GPU or TPU has no such limit, and every loop iteration costs it a fixed
# launch and synchronisation overhead and runs matmuls too small to fill it, so it takes
# longer blocks (not yet timed on one: benchmarks/kda.py --impls chunk on the device).
BLOCK_TOKENS = {"cpu": 128}
BLOCK_TOKENS_ACCELERATOR = 512


def block_tokens(backend=None):
    """Tokens per block on `backend` (default: the traced program's target, `target_backend`)."""
    return BLOCK_TOKENS.get(backend or target_backend(), BLOCK_TOKENS_ACCELERATOR)


class _Blocks(NamedTuple):
    """How a sequence of T tokens splits into blocks of whole chunks."""

    L: int  # tokens per block
    n: int  # blocks
    pad: int  # zero tokens appended to fill the last block

    @classmethod
    def of(cls, T, chunk_size, chunks_per_block=None):
        chunks_per_block = chunks_per_block or max(1, block_tokens() // chunk_size)
        n_chunks = max(1, -(-T // chunk_size))
        L = max(1, min(chunks_per_block, n_chunks)) * chunk_size
        n = -(-n_chunks * chunk_size // L)
        return cls(L, n, n * L - T)

    def padded(self, x):
        """x [B, T, ...] zero-padded in T to whole blocks. A padded token has g = 0 and
        β = 0, so it neither decays nor writes the state, and q = 0 reads nothing."""
        return jnp.pad(x, [(0, 0), (0, self.pad)] + [(0, 0)] * (x.ndim - 2))

    def take(self, x, i):
        return jax.lax.dynamic_slice_in_dim(x, i * self.L, self.L, axis=1)

    def put(self, buf, x, i):
        return jax.lax.dynamic_update_slice_in_dim(buf, x, i * self.L, axis=1)


def _block(q, k, v, g, beta, reset, h, scale, chunk_size, outputs=True, gate_lower_bound=None):
    """One block of chunks: inputs [B, L, H, ·] (q not yet scaled) and its incoming state
    h [B, H, K, V] to (outgoing state, outputs [B, L, H, V], or None without `outputs`).
    Its chunks' state-independent terms come from one batched pass, the state walks
    through them, and the outputs come from one more."""
    B, L, H, _ = q.shape
    c = chunk_terms(q * scale, k, v, g, beta, reset, chunk_size, gate_lower_bound)  # each [B, H, S, ...]
    outs = []
    for s in range(L // chunk_size):
        wq = c.w[:, :, s]
        if outputs:  # W h and Q̃ h in one product: the state is read once per chunk
            wq = jnp.concatenate([wq, c.q_decayed[:, :, s]], axis=2)
        wq_h = _product("bhck,bhkv->bhcv", wq, h)
        v_new = c.u[:, :, s] - wq_h[:, :, :chunk_size]
        if outputs:
            outs.append((v_new, wq_h[:, :, chunk_size:]))
        # The decay as an einsum, not a broadcast product: the gradient's Σ_v dh·h then stays
        # a matmul, where XLA:CPU runs a multiply-reduce 10x slower (3% of forward+backward).
        h = (_einsum("bhk,bhkv->bhkv", c.decay[:, :, s], h)
             + _product("bhck,bhcv->bhkv", c.k_tail[:, :, s], v_new))
    if not outputs:
        return h, None
    v_new = jnp.stack([x[0] for x in outs], axis=2)
    o = jnp.stack([x[1] for x in outs], axis=2) + _product("bhsij,bhsjv->bhsiv", c.p, v_new)
    return h, jnp.moveaxis(o.reshape(B, H, L, -1), 1, 2)


def _blocked_forward(q, k, v, g, beta, initial_state, reset, scale, chunk_size, chunks_per_block,
                     keep_states=False, outputs=True, gate_lower_bound=None):
    """A loop over blocks of `chunks_per_block` chunks (_block). Blocking keeps every
    intermediate of a step in cache: building the terms for the whole sequence at once
    makes each of the many elementwise passes stream the full [B,H,N,C,K] tensors through
    memory, which is what made this path slower than the token recurrence on CPU at long T.
    Returns (o or None without `outputs`, final state, and with keep_states every block's
    incoming state [n_blocks, B, H, K, V], which is all the backward needs besides the
    inputs)."""
    T = q.shape[1]
    blk = _Blocks.of(T, chunk_size, chunks_per_block)
    xs = tuple(blk.padded(x) for x in (q, k, v, g, beta, reset))

    # A fori_loop slicing the inputs in place: a scan over pre-split xs makes XLA:CPU copy
    # every input into the loop's buffers first (a full pass over memory each).
    def step(i, carry):
        h, o, states = carry
        if keep_states:
            states = states.at[i].set(h)
        h, ob = _block(*(blk.take(x, i) for x in xs), h, scale, chunk_size, outputs, gate_lower_bound)
        return h, (blk.put(o, ob, i) if outputs else o), states

    o = jnp.zeros_like(xs[2]) if outputs else None  # varies like v inside a shard_map
    states = jnp.zeros_like(initial_state, shape=(blk.n if keep_states else 0, *initial_state.shape))
    h, o, states = jax.lax.fori_loop(0, blk.n, step, (initial_state, o, states))
    return (o[:, :T] if outputs else None), h, states


def _blocked_backward(q, k, v, g, beta, reset, scale, states, do, dh, chunk_size,
                      chunks_per_block, outputs=True, gate_lower_bound=None):
    """The gradient, block by block in reverse: each block's forward is recomputed from its
    stored incoming state and differentiated there, carrying dL/dh backwards. Like the
    forward it stays in cache, and it keeps nothing per chunk beyond one block's terms.
    Returns (dq, dk, dv, dg, dβ, dh0, dscale)."""
    T = q.shape[1]
    blk = _Blocks.of(T, chunk_size, chunks_per_block)
    xs = tuple(blk.padded(x) for x in (q, k, v, g, beta))
    r = blk.padded(reset)
    do = blk.padded(do) if outputs else None

    def step(j, carry):
        dh, dscale, grads = carry
        i = blk.n - 1 - j
        _, vjp = jax.vjp(lambda *a: _block(*a[:5], blk.take(r, i), a[5], a[6], chunk_size, outputs,
                                           gate_lower_bound),
                         *(blk.take(x, i) for x in xs), states[i], scale)
        *dxb, dh, ds = vjp((dh, blk.take(do, i) if outputs else None))
        return dh, dscale + ds, tuple(blk.put(buf, d, i) for buf, d in zip(grads, dxb))

    grads = tuple(jnp.zeros_like(x) for x in xs)
    dh0, dscale, grads = jax.lax.fori_loop(0, blk.n, step, (dh, jnp.zeros_like(scale), grads))
    return tuple(d[:, :T] for d in grads) + (dh0, dscale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def chunk_kda(q, k, v, g, beta, initial_state, reset, scale, chunk_size,
              chunks_per_block=None, outputs=True, gate_lower_bound=None):
    """Chunkwise KDA. fp32 in and out, q unscaled and `scale` a fp32 scalar; returns
    (o [B,T,H,V], final state [B,H,K,V]). With outputs=False only the final state is
    computed (o is None, and XLA drops the terms made from q): the context-parallel pass
    that finds a segment's transition needs nothing else. gate_lower_bound: see
    chunk_terms.

    Forward and backward both run block by block (_blocked_forward, _blocked_backward);
    tests/ops/test_kda_op.py holds both to the recurrent oracle.
    """
    o, h, _ = _blocked_forward(q, k, v, g, beta, initial_state, reset, scale, chunk_size,
                               chunks_per_block, outputs=outputs, gate_lower_bound=gate_lower_bound)
    return o, h


def _chunk_kda_fwd(q, k, v, g, beta, initial_state, reset, scale, chunk_size, chunks_per_block,
                   outputs, gate_lower_bound):
    o, h, states = _blocked_forward(q, k, v, g, beta, initial_state, reset, scale, chunk_size,
                                    chunks_per_block, keep_states=True, outputs=outputs,
                                    gate_lower_bound=gate_lower_bound)
    return (o, h), (q, k, v, g, beta, reset, scale, states)


def _chunk_kda_bwd(chunk_size, chunks_per_block, outputs, gate_lower_bound, res, cotangents):
    q, k, v, g, beta, reset, scale, states = res
    *grads, dh0, dscale = _blocked_backward(q, k, v, g, beta, reset, scale, states, *cotangents,
                                            chunk_size, chunks_per_block, outputs, gate_lower_bound)
    return (*grads, dh0, np.zeros(reset.shape, jax.dtypes.float0), dscale)


chunk_kda.defvjp(_chunk_kda_fwd, _chunk_kda_bwd)


def _transitions(c: ChunkTerms):
    """(M = Diag(e^{G_C}) − K̃ᵀW, N = K̃ᵀU) from chunk terms of any leading shape."""
    m = _einsum("...ck,...cj->...kj", c.k_tail, c.w)
    m = jnp.eye(m.shape[-1], dtype=m.dtype) * c.decay[..., None, :] - m
    return m, _einsum("...ck,...cv->...kv", c.k_tail, c.u)


def chunk_transitions(k, v, g, beta, reset, chunk_size):
    """Each chunk as an affine map of its incoming state, h ↦ M h + N (SPEC.md §3).

    Returns M [B,H,N,K,K] = Diag(e^{G_C}) − K̃ᵀW and N [B,H,N,K,V] = K̃ᵀU. Composing
    (earlier a, later b) as (M_b M_a, M_b N_a + N_b) is associative, so a prefix scan of
    these yields every chunk's incoming state.
    """
    # The transition does not involve q; k stands in for it and P is simply unused.
    return _transitions(chunk_terms(k, k, v, g, beta, reset, chunk_size))
