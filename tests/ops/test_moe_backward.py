"""The MoE's backward shaping: un-sorting rows by gathers, and the weights' gradients tied to
the input's (k3jax.ops.moe_dispatch.unsort_rows, k3jax.layers.moe.gradients_together)."""
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.moe import gradients_together
from k3jax.ops.moe_dispatch import unsort_rows
from k3jax.ops.mxfp4 import MXFP4


def test_unsort_rows_is_the_inverse_permutation_and_its_gradient_the_permutation():
    r = np.random.default_rng(0)
    x = r.normal(size=(37, 5)).astype(np.float32)
    order = r.permutation(37).astype(np.int32)
    want = np.zeros_like(x)
    want[order] = x                               # y[order[i]] = x[i]
    np.testing.assert_array_equal(np.asarray(unsort_rows(jnp.asarray(x), jnp.asarray(order))), want)
    ct = r.normal(size=x.shape).astype(np.float32)
    _, vjp = jax.vjp(lambda a: unsort_rows(a, jnp.asarray(order)), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(ct))[0]), ct[order])


def test_weight_gradients_leave_the_layer_with_the_input_gradient():
    """Values and gradients are untouched; the backward holds one barrier over the input's
    cotangent and every float weight's (integer MXFP4 bytes pass outside it)."""
    r = np.random.default_rng(1)
    z = jnp.asarray(r.normal(size=(6, 4)), jnp.float32)
    w = jnp.asarray(r.normal(size=(3, 4, 4)), jnp.float32)
    q = MXFP4(jnp.zeros((3, 4, 2), jnp.uint8), jnp.zeros((3, 4, 1), jnp.uint8))

    def f(z, w, tied):
        if tied:
            z, (w, _), _ = gradients_together(z, (w, q), {})
        return jnp.sum(jnp.sin(jnp.einsum("nd,edf->nef", z, w)))

    for a, b in zip(jax.grad(f, (0, 1))(z, w, True), jax.grad(f, (0, 1))(z, w, False)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)), static_argnums=2)(z, w, True).jaxpr
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    shapes = sorted(tuple(v.aval.shape) for v in barriers[-1].invars)
    assert len(barriers) == 2 and shapes == [(3, 4, 4), (6, 4)], shapes
