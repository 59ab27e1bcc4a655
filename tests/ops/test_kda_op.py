"""k3jax.ops.kda against independent references.

References: a float64 NumPy loop written here (SPEC.md §3's "(I − β k kᵀ) Diag(e^g) S + β k vᵀ"
form, with document resets), flash-linear-attention's torch `naive_recurrent_kda` when it is
installed, and — for packing — separate per-document runs. Tolerances are DESIGN.md's:
fp32 oracle vs float64 ≤ 1e-5, chunk vs recurrent ≤ 1e-4 relative RMS.
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import chunk_transitions, kda, kda_step

from helpers import rel_l2, rel_max
from reference import numpy_kda

kda_jit = jax.jit(kda, static_argnames=("scale", "output_final_state", "impl", "chunk_size"))


# ---------------------------------------------------------------------------------------
# inputs and references


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _l2norm(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_gate(rng, shape, kind):
    """Natural-log decays <= 0."""
    x = rng.standard_normal(shape)
    if kind == "safe":  # K3: lb · sigmoid(·), spread over (-5, 0)
        g = -5.0 * _sigmoid(2.0 * x)
    elif kind == "near5":  # every token close to the safe gate's floor
        g = -5.0 * _sigmoid(x + 6.0)
    elif kind == "near0":  # almost no forgetting
        g = -5.0 * _sigmoid(x - 8.0)
    elif kind == "softplus":  # Kimi-Linear: -exp(A_log) · softplus(·), unbounded below
        g = -2.0 * np.logaddexp(0.0, 4.0 * x + 2.0)
        g.reshape(-1)[::5] = -20.0 - 5.0 * rng.random(g.size)[::5]
    else:
        raise ValueError(kind)
    return g.astype(np.float32)


def make_inputs(seed, B, T, H, K, V=None, gate="safe"):
    V = K if V is None else V
    rng = np.random.default_rng(seed)
    f32 = lambda x: x.astype(np.float32)  # noqa: E731
    return dict(
        q=f32(_l2norm(rng.standard_normal((B, T, H, K)))),
        k=f32(_l2norm(rng.standard_normal((B, T, H, K)))),
        v=f32(rng.standard_normal((B, T, H, V))),
        g=make_gate(rng, (B, T, H, K), gate),
        beta=f32(_sigmoid(rng.standard_normal((B, T, H)))),
    )


def make_state(seed, B, H, K, V):
    return np.random.default_rng(seed + 1000).standard_normal((B, H, K, V)).astype(np.float32)


def make_segments(seed, B, T, chunk_size):
    """Random packing with a boundary exactly at a chunk edge (between tokens C-1 and C).

    Ids are not monotone (they cycle mod 3), so a reset is "id differs from the previous
    token", not "id increases".
    """
    rng = np.random.default_rng(seed + 2000)
    reset = rng.random((B, T)) < 0.04
    reset[:, 0] = False
    for t in (chunk_size, 2 * chunk_size, T - 1):
        if 0 < t < T:
            reset[0, t] = True
    if T > 1:
        reset[-1, 1] = True
    ids = np.cumsum(reset, axis=1) % 3 + 7 * np.arange(B)[:, None]
    return ids.astype(np.int32)




# ---------------------------------------------------------------------------------------
# forward: recurrent vs NumPy, chunk vs recurrent

# (T, H, K, V, chunk_size, gate, initial_state, segments)
FORWARD_CASES = [
    (1, 4, 64, 64, 16, "softplus", True, True),
    (63, 1, 16, 16, 16, "near0", True, False),
    (63, 4, 64, 64, 64, "near5", False, True),
    (64, 4, 16, 16, 64, "softplus", True, True),
    (64, 1, 64, 64, 16, "safe", False, False),
    (65, 4, 16, 16, 16, "safe", True, True),
    (65, 1, 64, 64, 64, "softplus", False, True),
    (200, 4, 64, 64, 64, "safe", True, True),
    (200, 1, 16, 16, 16, "softplus", True, True),
    (200, 1, 64, 64, 16, "near5", True, True),
    (130, 2, 32, 16, 64, "softplus", True, True),  # V != K
]


@pytest.mark.parametrize(
    "T,H,K,V,C,gate,use_h0,use_seg",
    FORWARD_CASES,
    ids=["T{}-H{}-K{}-V{}-C{}-{}-h0{:d}-seg{:d}".format(*c) for c in FORWARD_CASES],
)
def test_forward_against_references(T, H, K, V, C, gate, use_h0, use_seg):
    B = 2
    x = make_inputs(T * 7 + H + K, B, T, H, K, V, gate)
    h0 = make_state(T, B, H, K, V) if use_h0 else None
    seg = make_segments(T, B, T, C) if use_seg else None
    o_np, s_np = numpy_kda(**x, initial_state=h0, segment_ids=seg)
    kw = dict(initial_state=h0, segment_ids=seg, output_final_state=True)
    o_rec, s_rec = kda_jit(**x, impl="recurrent", **kw)
    o_chk, s_chk = kda_jit(**x, impl="chunk", chunk_size=C, **kw)

    assert o_rec.shape == o_chk.shape == (B, T, H, V)
    assert s_chk.shape == (B, H, K, V) and s_chk.dtype == jnp.float32
    assert rel_l2(o_rec, o_np) <= 1e-5 and rel_max(o_rec, o_np) <= 1e-5
    assert rel_l2(s_rec, s_np) <= 1e-5 and rel_max(s_rec, s_np) <= 1e-5
    assert rel_l2(o_chk, o_rec) <= 1e-4
    assert rel_l2(s_chk, s_rec) <= 1e-4


def test_gate_generators_cover_the_ranges():
    rng = np.random.default_rng(0)
    assert make_gate(rng, (4096,), "softplus").min() <= -20.0
    assert make_gate(rng, (4096,), "near5").mean() < -4.9
    assert make_gate(rng, (4096,), "near0").mean() > -0.01
    assert all(make_gate(rng, (4096,), k).max() <= 0.0 for k in ("safe", "near5", "near0", "softplus"))


def test_packed_documents_equal_separate_runs():
    """Each document sees only its own tokens (and h0 only the first one)."""
    B, T, H, K, C = 2, 150, 2, 16, 32
    x = make_inputs(11, B, T, H, K, gate="softplus")
    h0 = make_state(11, B, H, K, K)
    seg = make_segments(11, B, T, C)
    o, s = kda_jit(**x, initial_state=h0, segment_ids=seg, output_final_state=True, chunk_size=C)
    for b in range(B):
        starts = [0] + [t for t in range(1, T) if seg[b, t] != seg[b, t - 1]] + [T]
        assert len(starts) > 3
        for i, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
            piece = {n: a[b : b + 1, t0:t1] for n, a in x.items()}
            o_doc, s_doc = numpy_kda(**piece, initial_state=h0[b : b + 1] if i == 0 else None)
            assert rel_l2(o[b, t0:t1], o_doc[0]) <= 1e-4, (b, t0, t1)
        assert rel_l2(s[b], s_doc[0]) <= 1e-4


# ---------------------------------------------------------------------------------------
# gradients


def _loss_grads(impl, C, x, h0, seg, r_o, r_s):
    def loss(q, k, v, g, beta, h0):
        o, s = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True,
                   impl=impl, chunk_size=C)
        return jnp.sum(o * r_o) + jnp.sum(s * r_s)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*x.values(), h0)


# (T, H, K, chunk_size, gate); both with initial state and packed documents
GRAD_CASES = [(65, 2, 16, 16, "softplus"), (100, 1, 32, 64, "safe")]


@pytest.mark.slow
@pytest.mark.parametrize("T,H,K,C,gate", GRAD_CASES)
def test_gradients_chunk_match_recurrent(T, H, K, C, gate):
    B = 2
    x = make_inputs(T + K, B, T, H, K, gate=gate)
    h0 = make_state(T, B, H, K, K)
    seg = make_segments(T, B, T, C)
    rng = np.random.default_rng(5)
    r_o = rng.standard_normal((B, T, H, K)).astype(np.float32)
    r_s = rng.standard_normal((B, H, K, K)).astype(np.float32)
    g_rec = _loss_grads("recurrent", C, x, h0, seg, r_o, r_s)
    g_chk = _loss_grads("chunk", C, x, h0, seg, r_o, r_s)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_chk, g_rec):
        assert np.all(np.isfinite(a)), name
        assert rel_l2(a, b) <= 1e-4, (name, rel_l2(a, b))


def test_gradients_finite_with_extreme_gates():
    """Masked pairwise exponents would be e^{+thousands}; neither value nor gradient may see them."""
    B, T, H, K, C = 1, 40, 1, 16, 16
    x = make_inputs(3, B, T, H, K)
    x["g"] = np.where(np.arange(T)[None, :, None, None] % 3 == 0, -300.0, -0.01).astype(np.float32)
    x["g"] = x["g"] * np.ones((B, T, H, K), np.float32)
    o_rec, _ = kda_jit(**x, impl="recurrent")

    def loss(*args):
        o, _ = kda(*args, chunk_size=C)
        return jnp.sum(o**2), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*x.values())
    assert np.all(np.isfinite(o))
    assert rel_l2(o, o_rec) <= 1e-4
    for gr in grads:
        assert np.all(np.isfinite(gr))


# (T, H, K, chunk_size, gate, gate_lower_bound): K3's bound with its gates spread and
# piled at the floor, a chunk that is not a power of two, and every g exactly at a weaker
# bound (one leaf spans the whole chunk).
BOUNDED_CASES = [(200, 2, 64, 64, "near5", -5.0), (130, 1, 32, 48, "safe", -5.0),
                 (90, 2, 16, 32, "at_bound", -1.0)]


@pytest.mark.slow
@pytest.mark.parametrize("T,H,K,C,gate,lb", BOUNDED_CASES)
def test_gate_lower_bound_matches_recurrent(T, H, K, C, gate, lb):
    """With the promise g >= lb, chunk, assoc and pallas score sub-chunks through one
    reference token (exponents up to (s-1)|lb|, not <= 0): values, final state and every
    gradient must still match the oracle, which is not told the bound."""
    B = 2
    x = make_inputs(T + C, B, T, H, K, gate="safe" if gate == "at_bound" else gate)
    if gate == "at_bound":
        x["g"] = np.full_like(x["g"], lb)
    assert x["g"].min() >= lb
    h0 = make_state(T, B, H, K, K)
    seg = make_segments(T, B, T, C)
    rng = np.random.default_rng(6)
    r_o = rng.standard_normal((B, T, H, K)).astype(np.float32)
    r_s = rng.standard_normal((B, H, K, K)).astype(np.float32)

    def outputs_and_grads(impl, bound):
        def loss(q, k, v, g, beta, h0):
            o, s = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True,
                       impl=impl, chunk_size=C, gate_lower_bound=bound)
            return jnp.sum(o * r_o) + jnp.sum(s * r_s), (o, s)

        (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
            *x.values(), h0)
        return (o, s, *grads)

    ref = outputs_and_grads("recurrent", None)
    # Pallas takes power-of-two chunks of 16 or more only.
    for impl in ("chunk", "assoc") + (("pallas",) if C % 16 == 0 and C & (C - 1) == 0 else ()):
        got = outputs_and_grads(impl, lb)
        for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref):
            assert np.all(np.isfinite(a)), (impl, name)
            assert rel_l2(a, b) <= 1e-4, (impl, name, rel_l2(a, b))


# ---------------------------------------------------------------------------------------
# decode step, dtypes, associative form


def test_kda_step_matches_recurrent():
    B, T, H, K, V = 2, 12, 3, 16, 8
    x = make_inputs(21, B, T, H, K, V)
    h0 = make_state(21, B, H, K, V)
    o_ref, s_ref = kda_jit(**x, initial_state=h0, output_final_state=True, impl="recurrent")
    step = jax.jit(kda_step)
    state = jnp.asarray(h0)
    outs = []
    for t in range(T):
        o_t, state = step(*(a[:, t] for a in x.values()), state)
        outs.append(o_t)
    assert state.dtype == jnp.float32
    np.testing.assert_allclose(np.stack(outs, axis=1), o_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, s_ref, rtol=1e-6, atol=1e-6)


def test_bf16_inputs_compute_in_fp32():
    B, T, H, K = 1, 40, 2, 16
    x = {n: jnp.asarray(a, jnp.bfloat16) for n, a in make_inputs(4, B, T, H, K).items()}
    o, s = kda_jit(**x, chunk_size=16, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o32, s32 = kda_jit(**{n: a.astype(jnp.float32) for n, a in x.items()}, impl="recurrent",
                       output_final_state=True)
    assert rel_l2(s, s32) <= 1e-4
    assert rel_l2(o.astype(jnp.float32), o32) <= 1e-2  # only the final cast to bf16 differs


def test_final_state_only_on_request_and_custom_scale():
    x = make_inputs(8, 1, 20, 1, 16)
    o, s = kda_jit(**x)
    assert s is None
    o_np, _ = numpy_kda(**x, scale=0.3)
    o2, _ = kda_jit(**x, scale=0.3, chunk_size=8)
    assert rel_l2(o2, o_np) <= 1e-4


@pytest.mark.slow
def test_traced_scale_gets_its_gradient():
    """scale may be a traced value (a learned temperature). `chunk` applies it block by
    block inside its custom VJP, so that VJP must return its cotangent."""
    B, T, H, K, C = 2, 75, 2, 16, 32
    x = make_inputs(9, B, T, H, K, gate="softplus")
    r_o = np.random.default_rng(9).standard_normal((B, T, H, K)).astype(np.float32)

    def grads(impl):
        def loss(scale, q):
            o, _ = kda(q, *list(x.values())[1:], scale=scale, impl=impl, chunk_size=C)
            return jnp.sum(o * r_o)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.float32(0.3), x["q"])

    (ds_rec, dq_rec), (ds_chk, dq_chk) = grads("recurrent"), grads("chunk")
    assert abs(float(ds_chk - ds_rec)) <= 1e-4 * abs(float(ds_rec))
    assert rel_l2(dq_chk, dq_rec) <= 1e-4


def test_chunk_transitions_compose_to_final_state():
    B, T, H, K, V, C = 2, 90, 2, 16, 8, 32
    x = make_inputs(13, B, T, H, K, V, gate="softplus")
    h0 = make_state(13, B, H, K, V)
    seg = make_segments(13, B, T, C)
    _, s_ref = kda_jit(**x, initial_state=h0, segment_ids=seg, output_final_state=True, impl="recurrent")
    transitions = jax.jit(chunk_transitions, static_argnames="chunk_size")
    m, n = transitions(x["k"], x["v"], x["g"], x["beta"], segment_ids=seg, chunk_size=C)
    assert m.shape == (B, H, 3, K, K) and n.shape == (B, H, 3, K, V)

    def compose(a, b):  # a earlier, b later
        return b[0] @ a[0], b[0] @ a[1] + b[1]

    m_all, n_all = jax.lax.associative_scan(compose, (m, n), axis=2)
    s = m_all[:, :, -1] @ h0 + n_all[:, :, -1]
    assert rel_l2(s, s_ref) <= 1e-4


# ---------------------------------------------------------------------------------------
# flash-linear-attention's own oracle


def _load_fla_naive():
    """fla's naive.py by file path: importing fla.ops would pull in triton."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    if not os.path.exists(path):
        pytest.skip(f"fla is installed but has no {path}")
    pytest.importorskip("torch", reason="fla's naive KDA needs torch")
    pytest.importorskip("einops", reason="fla's naive KDA needs einops")
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_recurrent_kda


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_matches_fla_naive_recurrent(gate):
    import torch

    naive = _load_fla_naive()
    B, T, H, K, V, C = 2, 100, 2, 32, 16, 32
    x = make_inputs(17, B, T, H, K, V, gate=gate)
    h0 = make_state(17, B, H, K, V)
    seg = make_segments(17, B, T, C)
    t = {n: torch.from_numpy(a) for n, a in x.items()}

    o_ref, s_ref = naive(**t, initial_state=torch.from_numpy(h0), output_final_state=True)
    for impl in ("recurrent", "chunk"):
        o, s = kda_jit(**x, initial_state=h0, output_final_state=True, impl=impl, chunk_size=C)
        tol = 1e-5 if impl == "recurrent" else 1e-4
        assert rel_l2(o, o_ref.numpy()) <= tol and rel_l2(s, s_ref.numpy()) <= tol

    # Packed documents: fla has no segment ids, so run it per document.
    o, s = kda_jit(**x, initial_state=h0, segment_ids=seg, output_final_state=True, chunk_size=C)
    for b in range(B):
        starts = [0] + [i for i in range(1, T) if seg[b, i] != seg[b, i - 1]] + [T]
        for i, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
            init = torch.from_numpy(h0[b : b + 1]) if i == 0 else None
            o_doc, s_doc = naive(**{n: a[b : b + 1, t0:t1] for n, a in t.items()},
                                 initial_state=init, output_final_state=True)
            assert rel_l2(o[b, t0:t1], o_doc[0].numpy()) <= 1e-4
        assert rel_l2(s[b], s_doc[0].numpy()) <= 1e-4


# ---------------------------------------------------------------------------------------
# argument checking


def test_bad_arguments_raise_clear_errors():
    x = make_inputs(0, 2, 10, 2, 16)
    with pytest.raises(ValueError, match="impl"):
        kda(**x, impl="triton")
    with pytest.raises(ValueError, match="chunk_size"):
        kda(**x, chunk_size=0)
    for bound in (0.0, 2.0, -np.inf, True, "-5", np.ones(1, np.float32)):
        with pytest.raises(ValueError, match="gate_lower_bound"):
            kda(**x, gate_lower_bound=bound)
    for name, bad in [
        ("k", x["k"][:, :, :1]),
        ("v", x["v"][:, :5]),
        ("g", x["g"][..., :8]),
        ("beta", x["beta"][..., None]),
    ]:
        with pytest.raises(ValueError, match=name):
            kda(**{**x, name: bad})
    with pytest.raises(ValueError, match="q"):
        kda(**{**x, "q": x["q"][0]})
    with pytest.raises(ValueError, match="initial_state"):
        kda(**x, initial_state=np.zeros((2, 2, 16, 8), np.float32))
    with pytest.raises(ValueError, match="segment_ids"):
        kda(**x, segment_ids=np.zeros((2, 9), np.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        kda(**x, segment_ids=np.zeros((2, 10), np.float32))
    step_args = {n: a[:, 0] for n, a in x.items()}
    with pytest.raises(ValueError, match="state"):
        kda_step(**step_args, state=np.zeros((2, 2, 16, 15), np.float32))


def test_auto_picks_by_backend_and_shape(monkeypatch):
    """'auto' is 'chunk' when tracing for TPU or GPU (ahead-of-time compiles name the
    target), and on CPU 'recurrent' only for small heads over short sequences; the choice
    gives the same outputs as the impl it names."""
    from k3jax.ops import kda as kda_mod
    K, T = kda_mod.CPU_RECURRENT_MAX_K, kda_mod.CPU_RECURRENT_MAX_T
    monkeypatch.setenv("K3JAX_TARGET_BACKEND", "cpu")
    assert kda_mod.resolve_impl("auto", T, K) == "recurrent"
    assert kda_mod.resolve_impl("auto", T + 1, K) == "chunk"
    assert kda_mod.resolve_impl("auto", T, 2 * K) == "chunk"
    assert kda_mod.resolve_impl("pallas", T, K) == "pallas"
    for backend in ("tpu", "gpu"):
        monkeypatch.setenv("K3JAX_TARGET_BACKEND", backend)
        assert kda_mod.resolve_impl("auto", 16, 8) == "chunk"
    monkeypatch.setenv("K3JAX_TARGET_BACKEND", "cpu")
    r = np.random.default_rng(0)
    q, k = (_l2norm(r.normal(size=(1, 40, 2, 8))) for _ in range(2))
    v = r.normal(size=(1, 40, 2, 8))
    g = -np.abs(r.normal(size=(1, 40, 2, 8))) * 0.1
    beta = r.random((1, 40, 2))
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    np.testing.assert_array_equal(kda(*args)[0], kda(*args, impl="recurrent")[0])
