"""The fused attention over cached latents (pallas_kernels.latent_attention, interpreted on
CPU) against a NumPy softmax, and MLA's decode through it against XLA's two products, on
one device and split over 8 (sequences, heads and cache positions on different axes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.mla import StackedPast, absorbed_attention
from k3jax.mesh import load_mesh, use_mesh
from k3jax.ops.latent_attention import attend_past
from pallas_kernels.latent_attention import past_attention


def numpy_past(q, cache, lengths, dv, lo, hi):
    """Softmax over positions [lo, hi) below each row's length, in float64."""
    B, R, _ = q.shape
    o, lse = np.zeros((B, R, dv)), np.full((B, R), -np.inf)
    for b in range(B):
        pos = [p for p in range(lo, hi) if p < lengths[b]]
        if pos:
            s = q[b].astype(np.float64) @ cache[b, pos].astype(np.float64).T
            top = s.max(1, keepdims=True)
            p = np.exp(s - top)
            o[b] = p @ cache[b, pos, :dv] / p.sum(1, keepdims=True)
            lse[b] = top[:, 0] + np.log(p.sum(1))
    return o, lse


def _lse_close(got, want):
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_equals_a_softmax_over_each_rows_valid_positions(dtype):
    """Rows with no, one, some and all positions valid; every layer of a stack; a range of
    positions that starts past some rows' lengths (as a device reading a later part does)."""
    rng = np.random.default_rng(0)
    G, B, S, E, R, dv = 3, 4, 384, 40, 5, 32
    q = rng.normal(size=(B, R, E)).astype(np.float32)
    cache = jnp.asarray(rng.normal(size=(G, B, S, E)), dtype)
    c64 = np.asarray(cache.astype(jnp.float32))
    cache = jnp.swapaxes(cache, 2, 3)          # the kernel reads caches feature-major [G, B, E, S]
    lengths = np.array([0, 1, 300, S])
    for index in range(G):
        o, lse = past_attention(q, cache, lengths, dv, index=index, mode="interpret")
        want_o, want_lse = numpy_past(q, c64[index], lengths, dv, 0, S)
        np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)  # fp32 against float64
        _lse_close(lse, want_lse)
    o, lse = past_attention(q, cache, lengths, dv, index=1, start=256, length=128, mode="interpret")
    want_o, want_lse = numpy_past(q, c64[1], lengths, dv, 256, S)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)  # fp32 against float64
    _lse_close(lse, want_lse)


def _decode_inputs(B=4, T=1, H=4, S=64, r=16, dr=8, dn=8, dv=8, G=2, seed=1):
    rng = np.random.default_rng(seed)
    E = r + dr
    q = jnp.asarray(rng.normal(size=(B, T, H, dn + dr)), jnp.float32)
    entries = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    stack = jnp.asarray(rng.normal(size=(G, B, E, S)), jnp.float32)     # feature-major, as cached
    kv_b = jnp.asarray(rng.normal(size=(r, H, dn + dv)) / 4, jnp.float32)
    lengths = jnp.asarray(np.r_[0, S, rng.integers(1, S, B - 2)], jnp.int32)   # none, all, some
    return q, entries, stack, kv_b, lengths, dn


@pytest.mark.parametrize("T", [1, 3])
def test_mla_decode_through_the_kernel_equals_xlas_two_products(T):
    """A stacked layer's cache (read in place) and a plain one; new tokens causal among themselves."""
    q, entries, stack, kv_b, lengths, dn = _decode_inputs(T=T)
    for past in (StackedPast(stack, jnp.int32(1)), stack[1]):
        want = absorbed_attention(q, entries, past, lengths, kv_b, dn, 0.3, impl="xla")
        got = absorbed_attention(q, entries, past, lengths, kv_b, dn, 0.3, impl="pallas")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["expert_hidden8", "data2_context2_expert2"])
def test_split_over_the_mesh_the_past_attention_equals_one_device(preset):
    """expert_hidden8: heads over `expert`, each device of the 4 `tensor` ones reads a
    quarter of the positions; data2_context2_expert2: rows over `data`, the cache's
    positions over `context`, split further where the rows are replicated."""
    q, _, stack, kv_b, lengths, dn = _decode_inputs(S=512)
    w_uk = kv_b[..., :dn]
    qf = jnp.concatenate([jnp.einsum("bthd,rhd->bthr", q[..., :dn], w_uk), q[..., dn:]], -1)
    want_o, want_lse = attend_past(qf, stack, 1, lengths, 16)
    with use_mesh(*load_mesh(preset)):
        run = jax.jit(lambda *a: attend_past(*a, 16))
        o, lse = run(qf, stack, jnp.int32(1), lengths)
        jaxpr = str(jax.make_jaxpr(lambda *a: attend_past(*a, 16))(qf, stack, jnp.int32(1), lengths))
    assert "pmax" in jaxpr     # the positions were split: partial results merged
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-5)


def test_lowers_for_tpu_as_one_kernel_in_a_typed_shard_map():
    """Traced for TPU (as `k3jax compile` does), the past attention is the Mosaic kernel
    inside a shard_map with its type check on, and XLA's products over the cache are gone."""
    from k3jax.aot.gpu import target
    q, _, stack, _, lengths, _ = _decode_inputs(S=512)
    qf = jnp.zeros(q.shape[:3] + (stack.shape[2],), jnp.float32)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (qf, stack, jnp.int32(1), lengths)]
    with target("tpu"), use_mesh(*load_mesh("expert_hidden8")):
        try:
            text = jax.export.export(jax.jit(lambda *a: attend_past(*a, 16)), platforms=["tpu"])(*args).mlir_module()
        except (ImportError, NotImplementedError) as err:
            pytest.skip(f"this jaxlib cannot lower Pallas for TPU: {type(err).__name__}: {err}")
    assert "tpu_custom_call" in text and "latent_past_attention" in text
    assert "stablehlo.dot_general" not in text
