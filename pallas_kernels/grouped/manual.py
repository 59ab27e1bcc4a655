"""Typing the grouped matmul's arrays inside `shard_map` (whose check_vma is on in the MoE
dispatch): a pallas_call's outputs must say which manual mesh axes they vary over, and a
loop carry or custom_vjp cotangent must vary where the values it meets do."""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over (jax >= 0.10 names them
    `manual_axis_type.varying`, earlier releases `vma`); empty outside shard_map."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(t, "vma", ()))


def vary_together(*arrays):
    """The arrays, each cast to vary over every manual axis any of them varies over (a
    type change: values are untouched; its transpose, for a differentiated x, is the psum
    over the axes x did not vary over). Returns (arrays, those axes)."""
    axes = frozenset().union(*map(varying_axes, arrays))

    def cast(a):
        more = axes - varying_axes(a)
        return jax.lax.pcast(a, tuple(sorted(more)), to="varying") if more else a

    return tuple(map(cast, arrays)), axes


def out_struct(shape, dtype, axes):
    """A pallas_call out_shape varying over `axes` (the inputs' own, from vary_together)."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
