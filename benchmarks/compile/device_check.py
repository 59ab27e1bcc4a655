"""One-command check for the first time a GPU (or TPU) is lent: every Pallas kernel against
its pure-JAX path at K3's shapes, timed beside the XLA `chunk` path, plus a few toy train
and decode steps, all checked against references; results as JSON.

    python benchmarks/compile/device_check.py [--out DIR] [--T 8192] [--H 96] [--budget-s 420]
    python benchmarks/compile/device_check.py --dry-run        # this CPU: interpret mode, small shapes

Sections (each reported, a failure never stops the rest; a section that would start past
--budget-s is reported as skipped, so one H200 run stays under 8 minutes):
  kda_forward   pallas vs chunk (the pure-JAX path) at B=1, T, H heads of K=V=128, bf16
                inputs, K3's gate bound; both against `recurrent` on the first --T-ref tokens
                (fp32 relative RMS ≤ 1e-4, DESIGN.md); forward times beside the anchors:
                fla chunk_kda 4.84 ms and FlashKDA 2.62 ms at T=8192, H=96 on an H20; goal
                on an H200 ≤ 3.3 ms.
  kda_backward  gradients of pallas vs chunk (relative RMS per input), forward+backward times.
  gmm           the bf16/fp32 grouped matmul kernels (pallas_kernels/gmm: gmm forward, gmm
                through Wᵀ for dx, tgmm for dW) through grouped_matmul's custom VJP: values
                and all three gradients in fp32 against a float64 oracle on ragged group sizes
                with empty experts and rows past Σ sizes (≤ 1e-5 relative, DESIGN.md's fp32-op
                bar; an empty expert's dW exactly 0); then at a device's share of K3's experts
                (56 of [3584, 3072], bf16) forward and forward+backward times beside
                `lax.ragged_dot` and its autodiff (whose dW XLA makes a dense product).
  mxfp4_gmm     the fused MXFP4 grouped matmul (pallas_kernels/mxfp4_gmm) against its pure
                path and bf16 grouped_matmul on the dequantized experts, K3's expert shapes
                (a device's share: 56 experts of [3072, 3584]).
  qat_gmm       the re-quantizing kernels of quantization-aware fine-tuning (mxfp4_gmm with
                a merge, Mosaic / Triton): identity rows read the exporter's weights out of
                both orientations bit for bit (a small case), then at the mxfp4_gmm shapes
                against the pure path's re-quantizing blocks, timed beside the plain kernel.
  toy_train     three steps of the real train step (toy config, kda_impl=pallas): losses
                finite; step 1's loss equal to kda_impl=chunk's on the same params and batch.
  toy_decode    prefill + cached decode of the toy model (kda_impl=pallas): each decode
                step's logits against a full forward over the same tokens.

JSON: {OUT or --out}/device_check.json (one object: device, settings, per section its checks,
times and errors). Exit 1 when a check fails or a section errors.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import common
import jax
import jax.numpy as jnp
import numpy as np

common.repo_on_path()
from k3jax.ops.kda import kda  # noqa: E402

ANCHORS_MS = {"fla chunk_kda fwd, H20": 4.84, "FlashKDA fwd, H20": 2.62, "goal fwd, H200": 3.3}
TOL = 1e-4    # DESIGN.md: chunk / pallas vs recurrent in fp32, relative RMS
K3_GATE_LOWER_BOUND = common.k3().gate_lower_bound


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def timed(fn, reps: int) -> float:
    """Median seconds over `reps` runs after one warm-up (compile) run."""
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def kda_inputs(T, H, K, dtype, seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    x = dict(q=unit(rng.standard_normal((1, T, H, K))), k=unit(rng.standard_normal((1, T, H, K))),
             v=rng.standard_normal((1, T, H, K)),
             g=K3_GATE_LOWER_BOUND / (1.0 + np.exp(-2.0 * rng.standard_normal((1, T, H, K)))),
             beta=1.0 / (1.0 + np.exp(-rng.standard_normal((1, T, H)))))
    return {k: jnp.asarray(v, dtype) for k, v in x.items()}


def _kda_fn(impl, C):
    def f(q, k, v, g, beta):
        o, h = kda(q, k, v, g, beta, output_final_state=True, impl=impl, chunk_size=C,
                   gate_lower_bound=K3_GATE_LOWER_BOUND)
        return o.astype(jnp.float32), h
    return jax.jit(f)


def section_kda_forward(a):
    # checked on the bf16 inputs' values in fp32 (outputs in fp32, so TOL applies), timed
    # on the bf16 inputs themselves
    x16 = kda_inputs(a.T, a.H, a.K, jnp.bfloat16)
    x = {k: v.astype(jnp.float32) for k, v in x16.items()}
    out = {"shape": {"B": 1, "T": a.T, "H": a.H, "K": a.K, "V": a.K, "C": a.C, "dtype": "bfloat16"}}
    fns = {impl: _kda_fn(impl, a.C) for impl in ("pallas", "chunk")}
    res = {impl: jax.device_get(f(**x)) for impl, f in fns.items()}
    out["pallas_vs_chunk"] = {"o": rel_rms(res["pallas"][0], res["chunk"][0]),
                              "state": rel_rms(res["pallas"][1], res["chunk"][1])}
    short = {k: v[:, :a.T_ref] for k, v in x.items()}
    ref = jax.device_get(_kda_fn("recurrent", a.C)(**short))
    got = {impl: jax.device_get(f(**short)) for impl, f in fns.items()}
    out["vs_recurrent_first_tokens"] = {impl: {"o": rel_rms(g[0], ref[0]), "state": rel_rms(g[1], ref[1])}
                                        for impl, g in got.items()}
    out["ms"] = {impl: 1e3 * timed(lambda f=f: f(**x16), a.reps) for impl, f in fns.items()}
    out["anchors_ms"] = ANCHORS_MS
    worst = max([*out["pallas_vs_chunk"].values()]
                + [v for d in out["vs_recurrent_first_tokens"].values() for v in d.values()])
    out["ok"] = worst <= TOL
    return out


def section_kda_backward(a):
    x16 = kda_inputs(a.T, a.H, a.K, jnp.bfloat16, seed=1)
    rng = np.random.default_rng(2)
    do = jnp.asarray(rng.standard_normal((1, a.T, a.H, a.K)), jnp.float32)
    dh = jnp.asarray(rng.standard_normal((1, a.H, a.K, a.K)), jnp.float32)

    def grad_fn(impl):
        f = _kda_fn(impl, a.C)

        def loss(*args):
            o, h = f(*args)
            return jnp.sum(o * do) + jnp.sum(h * dh)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    args16 = tuple(x16[k] for k in ("q", "k", "v", "g", "beta"))
    args = tuple(v.astype(jnp.float32) for v in args16)
    gp, gc = grad_fn("pallas"), grad_fn("chunk")
    p, c = jax.device_get(gp(*args)), jax.device_get(gc(*args))
    out = {"pallas_vs_chunk": {n: rel_rms(p[i], c[i]) for i, n in enumerate(("dq", "dk", "dv", "dg", "dbeta"))}}
    out["ms_forward_backward"] = {"pallas": 1e3 * timed(lambda: gp(*args16), a.reps),
                                  "chunk": 1e3 * timed(lambda: gc(*args16), a.reps)}
    out["ok"] = max(out["pallas_vs_chunk"].values()) <= TOL
    return out


def _ragged_sizes(rng, M, E, n_empty, leftover):
    """Group sizes summing to M - leftover with n_empty zero groups, uneven otherwise."""
    weights = rng.dirichlet(np.full(E, 0.5))
    weights[rng.choice(E, n_empty, replace=False)] = 0.0
    sizes = np.floor(weights / weights.sum() * (M - leftover)).astype(np.int64)
    sizes[np.argmax(sizes)] += M - leftover - sizes.sum()
    return sizes


def section_gmm(a):
    from k3jax.ops.grouped_matmul import grouped_matmul
    rng = np.random.default_rng(6)
    # values and gradients: fp32 against a float64 oracle, ragged sizes, empty experts,
    # rows past the sum, no dimension a multiple of a tile
    E, M, K, N = a.gmm_check
    sizes = _ragged_sizes(rng, M, E, n_empty=2, leftover=5)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((E, K, N)).astype(np.float32) / np.sqrt(K)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    group = np.repeat(np.arange(E), sizes)
    n = sizes.sum()
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    y_ref = np.zeros((M, N))
    y_ref[:n] = np.einsum("mk,mkn->mn", x64[:n], w64[group])
    dx_ref = np.zeros((M, K))
    dx_ref[:n] = np.einsum("mn,mkn->mk", dy64[:n], w64[group])
    dw_ref = np.zeros((E, K, N))
    np.add.at(dw_ref, group, np.einsum("mk,mn->mkn", x64[:n], dy64[:n]))

    def loss(x, w):
        return jnp.sum(grouped_matmul(x, w, jnp.asarray(sizes), impl="pallas") * dy)
    y = jax.jit(lambda x, w: grouped_matmul(x, w, jnp.asarray(sizes), impl="pallas"))(x, w)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    dw = np.asarray(dw)
    empty = np.flatnonzero(sizes == 0)
    out = {"check_shape": {"E": E, "M": M, "K": K, "N": N, "empty_experts": empty.tolist(),
                           "rows_past_sum": int(M - n)},
           "fp32_vs_float64": {"y": rel_rms(y, y_ref), "dx": rel_rms(dx, dx_ref), "dw": rel_rms(dw, dw_ref)},
           "empty_experts_dw_max_abs": float(np.max(np.abs(dw[empty]))),
           "rows_past_sum_y_max_abs": float(np.max(np.abs(np.asarray(y)[n:]))) if n < M else 0.0,
           "tolerance": 1e-5}
    ok = (max(out["fp32_vs_float64"].values()) <= 1e-5 and out["empty_experts_dw_max_abs"] == 0.0
          and out["rows_past_sum_y_max_abs"] == 0.0)

    # speed at a device's share of K3's experts, bf16
    E, M, K, N = a.gmm_experts, a.gmm_speed_rows, a.gmm_k, a.gmm_n
    sizes = jnp.asarray(_ragged_sizes(rng, M, E, n_empty=1, leftover=0), jnp.int32)
    xb = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    wb = jnp.asarray(rng.standard_normal((E, K, N)) / np.sqrt(K), jnp.bfloat16)
    dyb = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    fwd = {"pallas": lambda x, w: grouped_matmul(x, w, sizes, impl="pallas"),
           "ragged_dot": lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32
                                                         ).astype(jnp.bfloat16)}
    fwd_j = {k: jax.jit(f) for k, f in fwd.items()}
    bwd_j = {k: jax.jit(jax.grad(lambda x, w, f=f: jnp.sum(f(x, w).astype(jnp.float32) * dyb), argnums=(0, 1)))
             for k, f in fwd.items()}
    yp, yr = (np.asarray(fwd_j[k](xb, wb), np.float32) for k in ("pallas", "ragged_dot"))
    gp, gr = (jax.device_get(bwd_j[k](xb, wb)) for k in ("pallas", "ragged_dot"))
    flops = 2 * M * K * N
    ms_f = {k: 1e3 * timed(lambda f=f: f(xb, wb), a.reps) for k, f in fwd_j.items()}
    ms_b = {k: 1e3 * timed(lambda f=f: f(xb, wb), a.reps) for k, f in bwd_j.items()}
    out.update({"speed_shape": {"E": E, "M": M, "K": K, "N": N, "dtype": "bfloat16"},
                "bf16_pallas_vs_ragged_dot": {"y": rel_rms(yp, yr), "dx": rel_rms(gp[0], gr[0]),
                                              "dw": rel_rms(gp[1], gr[1])},
                "bf16_tolerance": 1e-2,
                "ms_forward": ms_f, "ms_forward_backward": ms_b,
                "tflops_forward": {k: flops / (v * 1e-3) / 1e12 for k, v in ms_f.items()},
                "tflops_forward_backward": {k: 3 * flops / (v * 1e-3) / 1e12 for k, v in ms_b.items()}})
    out["ok"] = bool(ok and max(out["bf16_pallas_vs_ragged_dot"].values()) <= 1e-2)
    return out


def section_mxfp4_gmm(a):
    from k3jax.checkpoint.mxfp4 import quantize_mxfp4
    from k3jax.ops.grouped_matmul import grouped_matmul
    from k3jax.ops.mxfp4 import dequantize_mxfp4
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
    E, N, K, M = a.gmm_experts, a.gmm_n, a.gmm_k, a.gmm_rows
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((E, N, K)) * 0.02).astype(np.float32)      # checkpoint's [out, in]
    packed, scale = quantize_mxfp4(w)
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    sizes = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E), jnp.int32)
    dense = jnp.swapaxes(dequantize_mxfp4(packed, scale, jnp.bfloat16), -1, -2)   # [E, K, N]
    fns = {impl: jax.jit(lambda x, impl=impl: mxfp4_grouped_matmul(x, packed, scale, sizes, impl=impl))
           for impl in ("pallas", "pure")}
    fns["bf16 grouped_matmul"] = jax.jit(lambda x: grouped_matmul(x, dense, sizes))
    res = {k: np.asarray(jax.device_get(f(x)), np.float32) for k, f in fns.items()}
    out = {"shape": {"E": E, "N": N, "K": K, "M": M},
           "pallas_vs_pure": rel_rms(res["pallas"], res["pure"]),
           "pure_vs_bf16_dequantized": rel_rms(res["pure"], res["bf16 grouped_matmul"]),
           "ms": {k: 1e3 * timed(lambda f=f: f(x), a.reps) for k, f in fns.items()}}
    out["tolerance"] = 1e-2      # bf16 products, fp32 accumulation in different orders
    out["ok"] = max(out["pallas_vs_pure"], out["pure_vs_bf16_dequantized"]) <= out["tolerance"]
    return out


def section_qat_gmm(a):
    from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np, quantize_mxfp4
    from k3jax.checkpoint.update_loss import merged_fp32
    from k3jax.ops.mxfp4_matmul import mxfp4_grouped_matmul
    rng = np.random.default_rng(5)
    # bit for bit on a small case: the weights the export stores, read through identity rows
    E, N, K, r, s = 2, 64, 64, 4, 1.5
    packed, scale = quantize_mxfp4((rng.standard_normal((E, N, K)) * 0.05).astype(np.float32))
    ad = ((rng.standard_normal((E, K, r)) * 0.3).astype(np.float32), (rng.standard_normal((E, r, N)) * 0.02).astype(np.float32))
    want = np.stack([dequantize_mxfp4_np(*quantize_mxfp4(merged_fp32(dequantize_mxfp4_np(packed[e], scale[e], np.float32),
                                                                      ad[1][e].T, ad[0][e].T, s)[0]), np.float32)
                     for e in range(E)])                                              # [E, N, K]
    eye = lambda n: jnp.tile(jnp.eye(n, dtype=jnp.float32), (E, 1))  # noqa: E731
    got_t = mxfp4_grouped_matmul(eye(K), packed, scale, jnp.full((E,), K, jnp.int32), impl="pallas", merge=(*ad, s))
    got_n = mxfp4_grouped_matmul(eye(N), packed, scale, jnp.full((E,), N, jnp.int32), impl="pallas",
                                 transpose_rhs=False, merge=(*ad, s))
    exact = bool(np.array_equal(np.asarray(got_t).reshape(E, K, N), np.swapaxes(want, 1, 2))
                 and np.array_equal(np.asarray(got_n).reshape(E, N, K), want))
    # at the mxfp4_gmm section's shapes: the kernel against the pure path's blocks
    E, N, K, M = a.gmm_experts, a.gmm_n, a.gmm_k, a.gmm_rows
    packed, scale = map(jnp.asarray, quantize_mxfp4((rng.standard_normal((E, N, K)) * 0.02).astype(np.float32)))
    ad = (jnp.asarray(rng.standard_normal((E, K, 16)) * 0.02, jnp.float32),
          jnp.asarray(rng.standard_normal((E, 16, N)) * 0.02, jnp.float32))
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    sizes = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E), jnp.int32)
    fns = {impl: jax.jit(lambda x, impl=impl: mxfp4_grouped_matmul(x, packed, scale, sizes, impl=impl, merge=(*ad, 2.0)))
           for impl in ("pallas", "pure")}
    fns["pallas, no merge"] = jax.jit(lambda x: mxfp4_grouped_matmul(x, packed, scale, sizes, impl="pallas"))
    res = {k: np.asarray(jax.device_get(f(x)), np.float32) for k, f in fns.items() if k != "pallas, no merge"}
    out = {"exporters_weights_bit_for_bit": exact, "shape": {"E": E, "N": N, "K": K, "M": M, "rank": 16},
           "pallas_vs_pure": rel_rms(res["pallas"], res["pure"]),
           "ms": {k: 1e3 * timed(lambda f=f: f(x), a.reps) for k, f in fns.items()}, "tolerance": 1e-2}
    out["ok"] = exact and out["pallas_vs_pure"] <= out["tolerance"]
    return out


def _toy(kda_impl, layers):
    """The toy config in fp32 (or its first `layers` layers: the dry run's, for compile time)."""
    from k3jax.config import load
    cfg = load("toy", kda_impl=kda_impl, moe_dispatch="ragged", dtype="float32", param_dtype="float32")
    if layers and layers < cfg.num_hidden_layers:
        kinds = cfg.layer_kinds[:layers]
        cfg = cfg.replace(num_hidden_layers=layers, hf_extra={}, hf_keys=(),
                          kda_layers=tuple(i + 1 for i, k in enumerate(kinds) if k == "kda"),
                          full_attn_layers=tuple(i + 1 for i, k in enumerate(kinds) if k == "mla"))
    return cfg


def section_toy_train(a):
    """The real train step (kda_impl=pallas) for a few steps; its first loss against the
    same params' and batch's loss with kda_impl=chunk (a forward pass: one compile less)."""
    from k3jax.model import K3Model, init_params
    from k3jax.train import config as tconf, muon, step as tstep
    tc = tconf.resolve({"data": {"seq_len": a.toy_seq, "batch_size": 4}, "steps": a.train_steps})
    rng = np.random.default_rng(4)
    toks = rng.integers(0, 256, (a.train_steps, 1, 4, a.toy_seq + 1))
    batches = [{"tokens": jnp.asarray(t[..., :-1], jnp.int32), "targets": jnp.asarray(t[..., 1:], jnp.int32),
                "segment_ids": jnp.ones(t[..., :-1].shape, jnp.int32),
                "loss_mask": jnp.ones(t[..., 1:].shape, jnp.float32)} for t in toks]
    cfg = _toy("pallas", a.toy_layers)
    params = init_params(cfg, jax.random.PRNGKey(0))
    chunk = _toy("chunk", a.toy_layers)

    @jax.jit
    def chunk_loss(p, b):
        logits = K3Model(chunk).apply({"params": p}, b["tokens"][0], b["segment_ids"][0])
        total, count = tstep.cross_entropy(logits, b["targets"][0], b["loss_mask"][0])
        return total / count
    ref = float(chunk_loss(params, batches[0]))
    tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], tc["steps"])
    step = tstep.make_train_step(cfg, tc, tx, groups)
    state = tstep.init_state(params, tx, groups)
    losses, ts = [], []
    for b in batches:
        t0 = time.perf_counter()
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        ts.append(time.perf_counter() - t0)
    out = {"losses": losses, "chunk_forward_loss": ref, "ms_per_step": 1e3 * float(np.median(ts[1:] or ts)),
           "step1_pallas_vs_chunk": abs(losses[0] - ref) / abs(ref)}
    out["ok"] = bool(all(np.isfinite(losses)) and out["step1_pallas_vs_chunk"] <= TOL)
    return out


def section_toy_decode(a):
    from k3jax.infer import generate as G
    from k3jax.model import forward, init_params
    cfg = _toy("pallas", a.toy_layers)
    params = init_params(cfg, jax.random.PRNGKey(1))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 256, (2, a.toy_seq)).astype(np.int32)
    new = rng.integers(0, 256, (2, a.decode_steps)).astype(np.int32)
    logits, cache = G.prefill(cfg, params, prompt, max_len=a.toy_seq + a.decode_steps)
    errs, ts = [], []
    full = np.asarray(forward(cfg, params, np.concatenate([prompt, new], 1)))
    errs.append(float(np.max(np.abs(np.asarray(logits) - full[:, a.toy_seq - 1]))))
    for t in range(a.decode_steps - 1):
        t0 = time.perf_counter()
        logits, cache = G.decode(cfg, params, cache, new[:, t])
        jax.block_until_ready(logits)
        ts.append(time.perf_counter() - t0)
        errs.append(float(np.max(np.abs(np.asarray(logits) - full[:, a.toy_seq + t]))))
    out = {"max_abs_logit_diff_vs_forward": max(errs), "ms_per_token": 1e3 * float(np.median(ts[1:] or ts)),
           "tolerance": 2e-3}     # DESIGN.md's max |diff| on fp32 logits
    out["ok"] = out["max_abs_logit_diff_vs_forward"] <= out["tolerance"]
    return out


SECTIONS = {"gmm": section_gmm, "kda_forward": section_kda_forward, "kda_backward": section_kda_backward,
            "mxfp4_gmm": section_mxfp4_gmm, "qat_gmm": section_qat_gmm, "toy_train": section_toy_train,
            "toy_decode": section_toy_decode}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpret mode, small shapes")
    ap.add_argument("--out", default=None, help="directory for device_check.json (default $OUT, else .)")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=96, help="KDA heads (K3: 96; a per-device share under a mesh)")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--T-ref", type=int, default=1024, help="tokens checked against recurrent")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no section past this many seconds (default 420 on a device, none with --dry-run)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--toy-layers", dest="toy_layers_arg", type=int, default=None,
                    help="toy sections: the toy's first N layers (default: all 13; the dry run's 4, every layer kind)")
    a = ap.parse_args(argv)
    a.gmm_k, a.gmm_n = common.expert_weights()["w1/w3"]
    a.gmm_experts, a.gmm_rows = 56, 4096    # a device's share of K3's experts
    a.gmm_check, a.gmm_speed_rows = (13, 1000, 200, 136), 16384
    a.train_steps = 3
    a.toy_seq, a.decode_steps, a.toy_layers = 128, 8, None
    if a.dry_run:   # interpret-mode kernels and XLA:CPU compiles: the smallest shapes that run every path
        a.T, a.H, a.K, a.T_ref, a.reps, a.C = 32, 1, 16, 32, 1, 16
        a.gmm_experts, a.gmm_n, a.gmm_k, a.gmm_rows = 2, 64, 64, 16
        a.gmm_check, a.gmm_speed_rows = (5, 70, 40, 24), 32
        a.toy_seq, a.decode_steps, a.toy_layers, a.train_steps = 16, 2, 4, 2
    a.toy_layers = a.toy_layers_arg or a.toy_layers
    if a.budget_s is None:
        a.budget_s = float("inf") if a.dry_run else 420.0
    out_dir = a.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    dev = jax.devices()[0]
    result = {"device": f"{dev.platform} {getattr(dev, 'device_kind', '')}", "devices": jax.device_count(),
              "jax": jax.__version__, "host": platform.node(), "dry_run": a.dry_run,
              "settings": {k: getattr(a, k) for k in ("T", "H", "K", "C", "T_ref", "reps")}, "sections": {}}
    t_start, failed = time.perf_counter(), []
    for name in a.sections:
        elapsed = time.perf_counter() - t_start
        if elapsed > a.budget_s:
            result["sections"][name] = {"skipped": f"budget: {elapsed:.0f} s of {a.budget_s:.0f} s spent"}
            print(f"{name}: skipped (budget)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            r = SECTIONS[name](a)
        except Exception as e:  # noqa: BLE001 — reported; the other sections still run
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        r["seconds"] = time.perf_counter() - t0
        result["sections"][name] = r
        if r.get("ok") is False:
            failed.append(name)
        print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'traceback'})}", flush=True)
        with open(os.path.join(out_dir, "device_check.json"), "w") as f:   # after every section
            json.dump(result, f, indent=1)
    result["seconds"] = time.perf_counter() - t_start
    result["failed"] = failed
    with open(os.path.join(out_dir, "device_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    kf = result["sections"].get("kda_forward", {})
    if "ms" in kf:
        print(f"KDA forward T={a.T} H={a.H}: pallas {kf['ms']['pallas']:.2f} ms, chunk {kf['ms']['chunk']:.2f} ms "
              f"(anchors: {', '.join(f'{k} {v} ms' for k, v in ANCHORS_MS.items())})")
    print(f"device check: {len(failed)} failed {failed} in {result['seconds']:.0f} s -> "
          f"{os.path.join(out_dir, 'device_check.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
