"""Kimi Delta Attention as a pure function (SPEC.md §3).

Per head, with state S [K, V] and per token t (gate first, then the delta rule, and the
output includes the current token):
    S ← Diag(e^{g_t}) S;   S ← S + (β_t k_t) ⊗ (v_t − Sᵀ k_t);   o_t = Sᵀ (scale · q_t)
— exactly flash-linear-attention's `naive_recurrent_kda`, so the two compare directly.

Implementations (all compute in fp32 and agree to the tolerances in DESIGN.md):
  "recurrent"  a `lax.scan` over tokens; the oracle, deliberately plain.
  "chunk"      the chunkwise UT/WY form (kda_chunk.py): a loop over blocks of whole chunks,
               each block's chunk terms from batched matmuls, the state carried through them.
  "assoc"      the same chunk terms, with every chunk's incoming state from an associative
               scan of the per-chunk affine maps (kda_assoc.py): logarithmic depth.
  "pallas"     Pallas kernels for the chunk terms and the state recurrence, forward and
               backward (pallas_kernels/kda); interpreted on CPU.
  "auto"       (the default) `resolve_impl`: the fastest of these measured for the
               backend and shape (benchmarks/kda.py).
Context parallelism over a mesh axis is `kda_context.context_parallel_kda`.
`kda_step` is the one-token decode update of the same recurrence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.config import KDA_IMPLS as IMPLS
from k3jax.ops import kda_assoc, kda_chunk
from k3jax.ops.platform import target_backend

# "auto" on CPU: the per-token scan while a head's state is small and sequences short (its
# per-step cost is K·V multiply-adds with no chunk matmuls to amortise), else "chunk". On
# this 2-core host, `benchmarks/kda.py --T 128 512 2048 --B 4 --H 4 --K K --C 64 --impls
# recurrent chunk --grad --no-fla --cpu-devices 1`, chunk's speed over recurrent's:
#   K = 16: forward 0.27-0.45x, forward+backward 0.72x (T 128), 0.93x (512), 1.19x (2048)
#   K = 32: forward 0.57-0.66x, forward+backward 2.35-3.32x
#   K = 64: forward 0.88x (128), 1.45-1.54x (512+), forward+backward 4.5-7.4x
# Training (forward+backward) decides: recurrent only where it wins that too.
CPU_RECURRENT_MAX_K = 16
CPU_RECURRENT_MAX_T = 512


def resolve_impl(impl: str, T: int, K: int) -> str:
    """The impl "auto" stands for at sequence length T and head dim K, for the backend
    being traced for (`ops.platform.target_backend`): "chunk" on TPU and GPU (the Pallas
    kernels have not yet been timed on a device), on CPU "recurrent" for small heads on
    short sequences and "chunk" otherwise. Any other name is returned as it is."""
    if impl != "auto":
        return impl
    if target_backend() != "cpu":
        return "chunk"
    return "recurrent" if K <= CPU_RECURRENT_MAX_K and T <= CPU_RECURRENT_MAX_T else "chunk"

_PREC = jax.lax.Precision.HIGHEST


def _check_shape(name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"kda: {name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _validate(q, k, v, g, beta, initial_state, segment_ids, first="q"):
    if q.ndim != 4:
        raise ValueError(f"kda: {first} must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    _check_shape("k", k, q.shape)
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"kda: v has shape {tuple(v.shape)}, expected ({B}, {T}, {H}, V)")
    _check_shape("g", g, q.shape)
    _check_shape("beta", beta, (B, T, H))
    if initial_state is not None:
        _check_shape("initial_state", initial_state, (B, H, K, v.shape[-1]))
    if segment_ids is not None:
        _check_shape("segment_ids", segment_ids, (B, T))
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"kda: segment_ids must be integer, got {segment_ids.dtype}")


def _resets(segment_ids, B, T):
    """[B, T] bool: the state restarts from zero before this token."""
    if segment_ids is None:
        return jnp.zeros((B, T), dtype=bool)
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    # t = 0 never resets: initial_state belongs to the first document.
    return jnp.concatenate([jnp.zeros((B, 1), dtype=bool), changed], axis=1)


def _delta_update(S, q, k, v, g, beta):
    """One token for every (batch, head): fp32 arrays, q pre-scaled. Returns (S, o)."""
    S = S * jnp.exp(g)[..., None]
    k_S = jnp.einsum("bhk,bhkv->bhv", k, S, precision=_PREC)
    S = S + jnp.einsum("bhk,bhv->bhkv", beta[..., None] * k, v - k_S, precision=_PREC)
    o = jnp.einsum("bhk,bhkv->bhv", q, S, precision=_PREC)
    return S, o


def _recurrent(q, k, v, g, beta, initial_state, reset):
    def step(S, x):
        q_t, k_t, v_t, g_t, b_t, r_t = x
        S = jnp.where(r_t[:, None, None, None], 0.0, S)
        return _delta_update(S, q_t, k_t, v_t, g_t, b_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset))
    S, o = jax.lax.scan(step, initial_state, xs)
    return jnp.moveaxis(o, 0, 1), S


def kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    impl="auto",
    chunk_size=64,
    gate_lower_bound=None,
):
    """Kimi Delta Attention over a sequence.

    Args:
      q, k: [B, T, H, K], already L2-normalised per head.
      v: [B, T, H, V].
      g: [B, T, H, K] natural-log per-channel decay (<= 0).
      beta: [B, T, H], already through the sigmoid.
      scale: applied to q; defaults to K ** -0.5.
      initial_state: [B, H, K, V], the state before t = 0 (first document only).
      output_final_state: also return the state after the last token.
      segment_ids: [B, T] int, packed documents; the state restarts from zero wherever
        the id differs from the previous token's.
      impl: "auto" (`resolve_impl`), "recurrent" (oracle), "chunk", "assoc" or "pallas".
      chunk_size: tokens per chunk for the chunked impls; T need not be a multiple of it.
        "pallas" needs a power of two >= 16 here; it runs other head dims zero-padded
        to the next power of two >= 16 (exact, at the padded size's cost).
      gate_lower_bound: None, or a negative number the caller promises every g is >= to
        (K3's "safe" gate, `linear_attn_config.gate_lower_bound`). "chunk" and "assoc"
        then score 16-token sub-chunks (at lb = -5) through one reference token instead
        of halving them down to single tokens, and "pallas" its 16-token diagonal blocks
        in one matmul each instead of 16 column steps: faster and as accurate; g below
        the bound can overflow there. "recurrent" needs no promise and ignores it.

    Returns:
      (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None).
    """
    out_dtype = v.dtype
    impl = resolve_impl(impl, q.shape[1], q.shape[-1]) if q.ndim == 4 else impl
    (q, k, v, g, beta), h0, reset, scale = prepare(q, k, v, g, beta, scale, initial_state,
                                                   segment_ids, impl, chunk_size, gate_lower_bound)
    o, h = run_impl(impl, q, k, v, g, beta, h0, reset, scale, chunk_size,
                    gate_lower_bound=gate_lower_bound)
    return o.astype(out_dtype), (h if output_final_state else None)


def prepare(q, k, v, g, beta, scale, initial_state, segment_ids, impl, chunk_size,
            gate_lower_bound=None):
    """Checks `kda`'s arguments and brings them to what every impl takes: fp32 (q, k, v, g,
    beta), the initial state (zeros if None), reset [B, T] bool and the fp32 scale for q."""
    if impl not in IMPLS:
        raise ValueError(f"kda: unknown impl {impl!r}; expected one of {IMPLS}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"kda: chunk_size must be a positive int, got {chunk_size!r}")
    if gate_lower_bound is not None and not (
        isinstance(gate_lower_bound, (int, float)) and not isinstance(gate_lower_bound, bool)
        and -math.inf < gate_lower_bound < 0
    ):
        raise ValueError(f"kda: gate_lower_bound must be None or a finite negative Python "
                         f"number (it picks the algorithm at trace time), got {gate_lower_bound!r}")
    _validate(q, k, v, g, beta, initial_state, segment_ids)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    if initial_state is None:
        h0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    else:
        h0 = f32(initial_state)
    return (f32(q), f32(k), f32(v), f32(g), f32(beta)), h0, _resets(segment_ids, B, T), f32(scale)


def _varying_axes(x):
    """The manual mesh axes x varies over inside `shard_map` (jax >= 0.10 names them
    `manual_axis_type.varying`, earlier releases `vma`)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(t, "vma", ()))


def _varying_like(x, *refs):
    """x typed as varying over every manual mesh axis the refs vary over. Under
    `shard_map`'s type check, a scan carry started from x must have the type of what the
    body makes of the refs."""
    axes = frozenset().union(*map(_varying_axes, refs)) - _varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def run_impl(impl, q, k, v, g, beta, h0, reset, scale, chunk_size, outputs=True,
             gate_lower_bound=None):
    """One impl on prepared inputs: fp32, h0 [B, H, K, V], reset [B, T] bool, q's scale.
    Returns (o, final state), both fp32. With outputs=False o is None: `chunk` then does
    only the state's work; the other impls compute o and drop it."""
    h0 = _varying_like(h0, q, k, v, g, beta, reset)  # the state carry, inside a shard_map
    if impl == "chunk":
        # Scaled block by block, inside the loop: scaling the whole q up front is a full
        # extra pass over [B, T, H, K] in memory (3-7% of the forward at 16k on CPU).
        return kda_chunk.chunk_kda(q, k, v, g, beta, h0, reset, scale, chunk_size,
                                   None, outputs, gate_lower_bound)  # None: blocks of block_tokens()
    q = q * scale
    if impl == "recurrent":
        o, h = _recurrent(q, k, v, g, beta, h0, reset)
    elif impl == "assoc":
        o, h = kda_assoc.assoc_kda(q, k, v, g, beta, h0, reset, chunk_size, gate_lower_bound)
    else:
        from pallas_kernels.kda import pallas_kda  # Pallas is imported only when asked for

        o, h = pallas_kda(q, k, v, g, beta, h0, reset, chunk_size, gate_lower_bound=gate_lower_bound)
    return (o if outputs else None), h


def kda_step(q, k, v, g, beta, state, *, scale=None):
    """One decode token: q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V].

    Returns (o [B, H, V] in v's dtype, new state fp32).
    """
    if q.ndim != 3:
        raise ValueError(f"kda_step: q must be [B, H, K], got shape {tuple(q.shape)}")
    B, H, K = q.shape
    for name, x, shape in (
        ("k", k, (B, H, K)),
        ("g", g, (B, H, K)),
        ("beta", beta, (B, H)),
        ("state", state, (B, H, K, v.shape[-1])),
    ):
        if tuple(x.shape) != shape:
            raise ValueError(f"kda_step: {name} has shape {tuple(x.shape)}, expected {shape}")
    if v.ndim != 3 or tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"kda_step: v has shape {tuple(v.shape)}, expected ({B}, {H}, V)")
    if scale is None:
        scale = K**-0.5
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    S, o = _delta_update(f32(state), f32(q) * scale, f32(k), f32(v), f32(g), f32(beta))
    return o.astype(v.dtype), S


def chunk_transitions(k, v, g, beta, *, segment_ids=None, chunk_size=64):
    """Per-chunk affine state maps h ↦ M h + N (SPEC.md §3, associative form).

    k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], beta [B,T,H]; T is zero-padded to a multiple of
    chunk_size (padding is the identity map). Returns M [B,H,N,K,K] and N [B,H,N,K,V], fp32.
    Compose (earlier a, later b) as (M_b M_a, M_b N_a + N_b).
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"kda: chunk_size must be a positive int, got {chunk_size!r}")
    _validate(k, k, v, g, beta, None, segment_ids, first="k")
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    reset = _resets(segment_ids, k.shape[0], k.shape[1])
    return kda_chunk.chunk_transitions(f32(k), f32(v), f32(g), f32(beta), reset, chunk_size)
