"""Routed-expert products over rows sorted by expert: widened or MXFP4-resident weights,
with optional low-rank adapters.

An expert weight is either an array [E, in, out] (widened, `grouped_matmul`) or an
`MXFP4` pair in the checkpoint's [E, out, in/2] orientation (dequantized tile by tile
inside `mxfp4_grouped_matmul`, so no widened copy of the stack exists). An adapter is
(A, B): A [E, in, r] per expert, or [in, r] shared by all experts ('shared_a'), and
B [E, r, out]; it adds scale · (x A) B to each row with its own expert's A and B.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from k3jax.ops.grouped_matmul import grouped_matmul
from k3jax.ops.mxfp4 import MXFP4, dequantize_experts

_HI = jax.lax.Precision.HIGHEST


def expert_matmul(rows, w, sizes, adapter=None, scale: float = 0.0, expected_rows=None):
    """rows [M, in] sorted by expert, group sizes [E] -> [M, out] (rows past Σ sizes are 0):
    the base product plus the low-rank path. expected_rows: rows doing real work under
    balanced routing (the kernels' declared costs). QAT's form is `ops.qat.expert_matmul_qat`."""
    if isinstance(w, MXFP4):
        from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
        y = mxfp4_grouped_matmul(rows, w.packed, w.scale, sizes, expected_rows=expected_rows)
    else:
        y = grouped_matmul(rows, w, sizes, expected_rows=expected_rows)
    if adapter is None:
        return y
    return y + lowrank_product(rows, adapter, sizes, scale, expected_rows).astype(y.dtype)


def lowrank_product(rows, adapter, sizes, scale: float, expected_rows=None):
    """scale · (rows A_e) B_e for each row's expert e, in rows' dtype."""
    a, b = adapter
    dt = rows.dtype
    if a.ndim == 2:   # one A for every expert
        low = jnp.dot(rows, a.astype(dt), preferred_element_type=jnp.float32).astype(dt)
    else:
        low = grouped_matmul(rows, a.astype(dt), sizes, expected_rows=expected_rows)
    up = grouped_matmul(low, b.astype(dt), sizes, expected_rows=expected_rows)
    return (scale * up).astype(dt)


def dense_weight(w, dtype):
    """The whole stack as [E, in, out] in `dtype` (the `dense` oracle's einsum form)."""
    return dequantize_experts(w, dtype) if isinstance(w, MXFP4) else w.astype(dtype)


def dense_adapter_delta(adapter, scale: float, dtype):
    """scale · A_e B_e as [E, in, out], for the `dense` oracle."""
    a, b = adapter
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    delta = (jnp.einsum("dr,erf->edf", a, b, precision=_HI) if a.ndim == 2
             else jnp.einsum("edr,erf->edf", a, b, precision=_HI))
    return (scale * delta).astype(dtype)


def hidden_splits(w, hidden_is_out: bool, tensor_size: int) -> bool:
    """Whether `tensor_size` shards split this weight's expert hidden evenly (for MXFP4
    along the input side, whole 32-value scale groups per shard)."""
    if isinstance(w, MXFP4):
        hidden = w.out_features if hidden_is_out else w.in_features // 32
    else:
        hidden = w.shape[-1] if hidden_is_out else w.shape[-2]
    return hidden % tensor_size == 0


def weight_spec(w, expert, tensor, hidden_is_out: bool):
    """shard_map spec of one expert weight (a pytree prefix for MXFP4's two leaves): experts
    over `expert`, the expert hidden (w1/w3's out, w2's in) over `tensor`."""
    if isinstance(w, MXFP4):   # [E, out, in/…]
        spec = PartitionSpec(expert, tensor, None) if hidden_is_out else PartitionSpec(expert, None, tensor)
        return MXFP4(spec, spec)
    return PartitionSpec(expert, None, tensor) if hidden_is_out else PartitionSpec(expert, tensor, None)


def adapter_spec(adapter, expert, tensor, hidden_is_out: bool):
    """shard_map specs of (A, B), laid out like their base weight."""
    a, _ = adapter
    if a.ndim == 2:
        a_spec = PartitionSpec(None if hidden_is_out else tensor, None)
    else:
        a_spec = PartitionSpec(expert, None if hidden_is_out else tensor, None)
    return (a_spec, PartitionSpec(expert, None, tensor if hidden_is_out else None))
