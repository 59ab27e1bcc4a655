"""NumPy oracles of the model's pieces, in float64 and written plainly from SPEC.md: what
the tests hold the JAX code to. Each is an independent statement of the math (loops where
the spec has a sum), never a call into k3jax's own implementation of the same thing."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.checkpoint.adapters import PEFT_PREFIX
from k3jax.checkpoint.mxfp4 import GROUP_SIZE, dequantize_mxfp4_np
from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
from k3jax.layout import layer_subpath
from k3jax.model import LORA_KEY

F32, F64 = np.float32, np.float64


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.logaddexp(0.0, x)


def softmax(s):
    s = np.asarray(s, F64)
    e = np.exp(s - s.max())
    return e / e.sum()


def rmsnorm(x, w, eps):
    x = np.asarray(x, F64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def situ(g, u, b1, b2):
    return b1 * np.tanh(g / b1) * sigmoid(g) * b2 * np.tanh(u / b2)


def glu(cfg, g, u):
    if cfg.hidden_act == "situ":
        return situ(g, u, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return silu(g) * u


def mlp_ref(cfg, P, x):
    g = x @ P["gate_proj"]["kernel"]
    u = x @ P["up_proj"]["kernel"]
    return glu(cfg, g, u) @ P["down_proj"]["kernel"], g, u


def attn_res_ref(stack, count, p, norm_w, proj_w, eps):
    """Per token: sources [stack[:count], p], RMS-normalised keys, raw values."""
    stack, p = np.asarray(stack, F64), np.asarray(p, F64)
    q = F64(norm_w) * F64(proj_w)
    _, B, T, _ = stack.shape
    out = np.zeros_like(p)
    for b in range(B):
        for t in range(T):
            V = [stack[s, b, t] for s in range(count)] + [p[b, t]]
            score = [np.sum(q * v / np.sqrt(np.mean(v * v) + eps)) for v in V]
            alpha = softmax(score)
            out[b, t] = sum(a * v for a, v in zip(alpha, V))
    return out


def mla_ref(cfg, P, x, seg):
    H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    r = cfg.kv_lora_rank
    B, T, _ = x.shape
    if cfg.q_lora_rank is not None:
        q = rmsnorm(x @ P["q_a_proj"]["kernel"], P["q_a_layernorm"]["weight"], 1e-6) @ P["q_b_proj"]["kernel"]
    else:
        q = x @ P["q_proj"]["kernel"]
    q = q.reshape(B, T, H, dn + dr)
    ckv = x @ P["kv_a_proj_with_mqa"]["kernel"]
    c = rmsnorm(ckv[..., :r], P["kv_a_layernorm"]["weight"], 1e-6)
    k_r = ckv[..., r:]
    kv = (c @ P["kv_b_proj"]["kernel"]).reshape(B, T, H, dn + dv)
    out = np.zeros((B, T, H, dv))
    scale = (dn + dr) ** -0.5
    for b in range(B):
        for i in range(T):
            js = [j for j in range(i + 1) if seg is None or seg[b, j] == seg[b, i]]
            for h in range(H):
                scores = [scale * q[b, i, h] @ np.concatenate([kv[b, j, h, :dn], k_r[b, j]]) for j in js]
                alpha = softmax(scores)
                out[b, i, h] = sum(a * kv[b, j, h, dn:] for a, j in zip(alpha, js))
    o = out.reshape(B, T, H * dv)
    if cfg.mla_use_output_gate:
        o = o * sigmoid(x @ P["g_proj"]["kernel"])
    return o @ P["o_proj"]["kernel"]


def conv_silu_ref(x, kernel, seg=None, tail=None):
    """y_t = SiLU(Σ_j kernel[j] · x_{t − (W−1−j)}), zeros before a document's first token."""
    x, kernel = np.asarray(x, F64), np.asarray(kernel, F64)
    W = kernel.shape[0]
    B, T, C = x.shape
    hist = np.zeros((B, W - 1, C)) if tail is None else np.asarray(tail, F64)
    xe = np.concatenate([hist, x], axis=1)  # xe[:, t + W - 1] = x_t
    y = np.zeros((B, T, C))
    for b in range(B):
        for t in range(T):
            for j in range(W):
                s = t - (W - 1 - j)
                if seg is not None and (s < 0 or seg[b, s] != seg[b, t]):
                    continue
                y[b, t] += kernel[j] * xe[b, s + W - 1]
    return silu(y)


def kda_layer_ref(cfg, P, x, seg):
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    B, T, _ = x.shape

    def branch(name):
        return conv_silu_ref(x @ P[f"{name}_proj"]["kernel"], P[f"{name}_conv1d"], seg).reshape(B, T, H, K)

    def l2(a):
        return a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)

    q, k, v = l2(branch("q")), l2(branch("k")), branch("v")
    f = (x @ P["f_a_proj"]["kernel"] @ P["f_b_proj"]["kernel"]).reshape(B, T, H, K)
    a = np.exp(P["A_log"])[None, None, :, None]
    z = f + P["dt_bias"].reshape(H, K)
    if cfg.gate_lower_bound is not None:
        g = cfg.gate_lower_bound * sigmoid(a * z)
    else:
        g = -a * softplus(z)
    beta = sigmoid(x @ P["b_proj"]["kernel"])  # [B, T, H]

    o = np.zeros((B, T, H, K))
    for b in range(B):
        for h in range(H):
            S = np.zeros((K, K))
            for t in range(T):
                if seg is not None and t > 0 and seg[b, t] != seg[b, t - 1]:
                    S = np.zeros((K, K))
                S = np.exp(g[b, t, h])[:, None] * S
                u = beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, h])
                S = S + np.outer(k[b, t, h], u)
                o[b, t, h] = S.T @ (q[b, t, h] * K ** -0.5)
    if cfg.use_full_rank_gate:
        gate = x @ P["g_proj"]["kernel"]
    else:
        gate = x @ P["g_a_proj"]["kernel"] @ P["g_b_proj"]["kernel"]
    o = rmsnorm(o, P["o_norm"]["weight"], cfg.rms_norm_eps) * sigmoid(gate.reshape(B, T, H, K))
    return o.reshape(B, T, H * K) @ P["o_proj"]["kernel"], g


def route_ref(x, gate_w, bias, k, scaling):
    s = sigmoid(np.asarray(x, F64) @ np.asarray(gate_w, F64))
    biased = s + F64(bias)
    order = np.argsort(-biased, axis=-1)
    sel = order[:, :k]
    srt = np.take_along_axis(biased, order, axis=-1)
    margin = srt[:, k - 1] - srt[:, k] if k < s.shape[-1] else np.full(len(s), np.inf)
    w = np.take_along_axis(s, sel, axis=-1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * scaling
    return sel, w, s, margin


def combine_matrix(idx, w, E):
    """[N, E] with w at the selected experts: compares selections as sets."""
    idx, w = np.asarray(idx), np.asarray(w, F64)
    assert all(len(set(r)) == len(r) for r in idx.tolist()), "an expert selected twice"
    m = np.zeros((idx.shape[0], E))
    np.put_along_axis(m, idx, w, axis=-1)
    return m


def experts_ref(cfg, z, idx, w, w1, w2, w3):
    out = np.zeros((z.shape[0], w2.shape[-1]))
    for n in range(z.shape[0]):
        for e, wk in zip(idx[n], w[n]):
            out[n] += wk * (glu(cfg, z[n] @ w1[e], z[n] @ w3[e]) @ w2[e])
    return out


def moe_ref(cfg, P, x):
    x = np.asarray(x, F64).reshape(-1, cfg.hidden_size)
    sel, w, _, margin = route_ref(x, P["gate"], P["e_score_correction_bias"], cfg.num_experts_per_token,
                                  cfg.routed_scaling_factor)
    z = x @ P["routed_expert_down_proj"]["kernel"] if cfg.use_latent_moe else x
    y = experts_ref(cfg, z, sel, w, P["w1"], P["w2"], P["w3"])
    if cfg.use_latent_moe:
        if cfg.latent_moe_use_norm:
            y = rmsnorm(y, P["routed_expert_norm"]["weight"], cfg.rms_norm_eps)
        y = y @ P["routed_expert_up_proj"]["kernel"]
    if cfg.num_shared_experts:
        y = y + mlp_ref(cfg, P["shared_experts"], x)[0]
    return y, sel, margin


def numpy_kda(q, k, v, g, beta, scale=None, initial_state=None, segment_ids=None):
    """float64 per-token reference, S_t = (I − β k kᵀ) Diag(e^g) S_{t-1} + β k vᵀ."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = np.zeros((B, H, K, V)) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros((B, T, H, V))
    eye = np.eye(K)
    for t in range(T):
        if segment_ids is not None and t > 0:
            S[segment_ids[:, t] != segment_ids[:, t - 1]] = 0.0
        kt, bt = k[:, t], beta[:, t, :, None, None]
        proj = eye - bt * kt[..., :, None] * kt[..., None, :]
        S = proj @ (np.exp(g[:, t])[..., None] * S) + bt * kt[..., :, None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], S)
    return o, S


def grouped_matmul_ref(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    r = 0
    for e, n in enumerate(sizes):
        out[r:r + n] = x[r:r + n].astype(np.float64) @ w[e].astype(np.float64)
        r += n
    return out


_TWICE_E2M1 = [0, 1, 2, 3, 4, 6, 8, 12]


def e2m1_value(code: int, s: int) -> float:
    """Independent decode: sign bit, integer table, exact power of two (Python floats are
    doubles, which hold every MXFP4 value exactly)."""
    if s == 255:
        return math.nan
    v = math.ldexp(_TWICE_E2M1[code & 7], s - 128)
    return -v if code & 8 else v


def mxfp4_decode_ref(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[..., out, in/2], [..., out, in/32] -> float64 [..., out, in], element by element."""
    n_in = packed.shape[-1] * 2
    out = np.empty((*packed.shape[:-1], n_in), dtype=np.float64)
    for idx in np.ndindex(*packed.shape[:-1]):
        for i in range(n_in):
            byte = int(packed[idx + (i // 2,)])
            code = byte & 0xF if i % 2 == 0 else byte >> 4
            out[idx + (i,)] = e2m1_value(code, int(scale[idx + (i // GROUP_SIZE,)]))
    return out


def mxfp4_gmm_ref(x, packed, scale, sizes, transpose_rhs):
    """float64 per-row products: row r times its group's decoded W (or Wᵀ); rows past the
    groups are zero."""
    w = dequantize_mxfp4_np(packed, scale, np.float32).astype(np.float64)
    x = np.asarray(x, np.float32).astype(np.float64)
    out = np.zeros((x.shape[0], w.shape[1] if transpose_rhs else w.shape[2]))
    group = np.repeat(np.arange(len(sizes)), sizes)
    for r, e in enumerate(group):
        out[r] = w[e] @ x[r] if transpose_rhs else x[r] @ w[e]
    return out


def ep_kept_pairs(idx, P, El, R):
    """The documented capacity policy in NumPy: tokens split into P contiguous blocks (one
    per device of an expert-only mesh); each device receives its experts' pairs packed in
    sender order, each sender's pairs sorted by expert (stable), and keeps the first R."""
    N, k = idx.shape
    n = N // P
    keep = np.zeros((N, k), bool)
    used = np.zeros(P, int)
    for p in range(P):                                   # senders in device order
        flat = idx[p * n:(p + 1) * n].reshape(-1)
        order = np.argsort(flat, kind="stable")
        for q in range(P):
            mine = [i for i in order if flat[i] // El == q]
            take = mine[:max(0, R - used[q])]
            used[q] += len(take)
            for i in take:
                keep[p * n + i // k, i % k] = True
    return keep


def peft_merged_reference(base_dir, peft_tensors):
    """The base checkpoint's tensors (MXFP4 experts dequantized) with W + B·A applied from a
    PEFT file (its lora_alpha equals r: scales folded into B), as {name: float64 [out, in]}."""
    ckpt = ShardedCheckpoint(base_dir)
    deltas, out = {}, {}
    for name, t in peft_tensors.items():
        if ".lora_" not in name:    # modules_to_save: the tensor itself (the router biases)
            out[name[len(PEFT_PREFIX):]] = t.astype(np.float64)
            continue
        mod = name[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0]
        deltas.setdefault(mod, {})[name.rsplit(".lora_", 1)[1][0]] = t.astype(np.float64)
    for mod, ab in deltas.items():
        if f"{mod}.weight_packed" in ckpt.keys():
            w = dequantize_mxfp4_np(ckpt.get(f"{mod}.weight_packed"), ckpt.get(f"{mod}.weight_scale"), np.float64)
        else:
            w = ckpt.get(f"{mod}.weight").astype(np.float64)
        assert ab["A"].shape == (ab["A"].shape[0], w.shape[1]) and ab["B"].shape == (w.shape[0], ab["A"].shape[0])
        out[mod] = w + ab["B"] @ ab["A"]
    ckpt.close()
    return out


def peft_merge_magnitude(base_dir, peft_tensors):
    """{module: |W| + |B|·|A|} for the adapted modules of a PEFT file: what the rounding of a
    floating-point merge W + B·A scales with (the products' and the sum's), cancellation included."""
    ckpt = ShardedCheckpoint(base_dir)
    ab = {}
    for name, t in peft_tensors.items():
        if ".lora_" in name:
            mod, which = name[len(PEFT_PREFIX):].rsplit(".lora_", 1)
            ab.setdefault(mod, {})[which[0]] = np.abs(t.astype(np.float64))
    out = {}
    for mod, x in ab.items():
        if f"{mod}.weight" in ckpt.keys():
            out[mod] = np.abs(ckpt.get(f"{mod}.weight").astype(np.float64)) + x["B"] @ x["A"]
    ckpt.close()
    return out


def lora_merged_params(cfg, params):
    """An independent NumPy merge: every adapted kernel / expert stack replaced by
    W + (alpha/r)·A·B (experts: per expert; shared_a: the one A), in float64."""
    spec = cfg.runtime.lora
    base = jax.tree.map(lambda x: np.asarray(x, np.float64) if x.dtype.kind == "f" else np.asarray(x),
                        {k: v for k, v in params.items() if k != LORA_KEY})
    hits = 0
    for path, a in jax.tree_util.tree_leaves_with_path(params[LORA_KEY]):
        keys = [k.key for k in path]
        if keys[-1] != "lora_a":
            continue
        node, ad = base, params[LORA_KEY]
        for k in keys[:-2]:
            node, ad = node[k], ad[k]
        name, ad = keys[-2], ad[keys[-2]]
        a, b = np.asarray(ad["lora_a"], np.float64), np.asarray(ad["lora_b"], np.float64)
        s = spec.scale_of(layer_subpath(keys[:-1]))
        if name in ("w1", "w2", "w3"):
            w = node[name]
            if isinstance(w, dict):   # MXFP4: dequantized [.., E, out, in] -> [.., E, in, out]
                w = np.swapaxes(dequantize_mxfp4_np(w["weight_packed"], w["weight_scale"], np.float64), -1, -2)
            delta = np.einsum("...ir,...ero->...eio", a, b) if a.ndim == b.ndim - 1 else a @ b
            node[name] = w + s * delta
        else:
            node[name]["kernel"] = node[name]["kernel"] + s * (a @ b)
        hits += 1
    assert hits > 0
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if x.dtype.kind == "f" else x, base)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def preference_loss_ref(pc, pr, rc, rr, nc, nr, loss, beta, label_smoothing=0.0, gamma=0.0):
    """Per-pair preference losses in float64, from the papers. pc/pr: the policy's summed
    log-probs of the chosen / rejected completion, rc/rr: the reference's, nc/nr: their
    token counts.
    - 'sigmoid': DPO (Rafailov et al. 2023, eq. 7), -log σ(β log[π(yw)/πref(yw)] - β log[π(yl)/πref(yl)]),
      with conservative DPO's smoothing (Mitchell 2023): the expected loss when the label
      is wrong with probability ε, (1-ε)·L(u) + ε·L(-u).
    - 'ipo': IPO (Azar et al. 2023, eq. 17), (h - 1/(2τ))² with h the log-ratio difference and τ = β.
    - 'simpo': SimPO (Meng et al. 2024, eq. 6), -log σ(β/|yw| log π(yw) - β/|yl| log π(yl) - γ),
      smoothed like DPO."""
    pc, pr, rc, rr, nc, nr = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr, nc, nr))
    if loss == "ipo":
        h = (pc - rc) - (pr - rr)
        return (h - 1.0 / (2.0 * beta)) ** 2
    if loss == "sigmoid":
        u = beta * (pc - rc) - beta * (pr - rr)
    elif loss == "simpo":
        u = beta / nc * pc - beta / nr * pr - gamma
    else:
        raise ValueError(loss)
    return (1.0 - label_smoothing) * -_log_sigmoid(u) + label_smoothing * -_log_sigmoid(-u)


def grpo_advantages_ref(rewards, scale=True, eps=1e-6):
    """DeepSeekMath (Shao et al. 2024) §4.1.2: Â_i = (r_i − mean(r)) / std(r) over a group of
    G outputs of one question; Dr. GRPO (Liu et al. 2025) drops the std. Loops, float64."""
    out = []
    for group in rewards:
        g = [float(x) for x in group]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / len(g))
        out.append([(x - mean) / (std + eps) if scale else x - mean for x in g])
    return np.array(out)


def grpo_loss_ref(logp, old_logp, ref_logp, adv, mask, eps_lo, eps_hi, beta, agg, max_tokens):
    """GRPO's objective, negated (DeepSeekMath eq. 3, with PPO's clipped surrogate and the
    k3 KL estimator π_ref/π − log(π_ref/π) − 1), one token at a time in float64, aggregated as
    GRPO (mean per output, then over outputs), DAPO (Yu et al. 2025, eq. 8: over all tokens) or
    Dr. GRPO (Liu et al. 2025: Σ tokens / (outputs · max_tokens)). Returns (loss, mean k3 and
    clip fraction aggregated as the loss's outputs are)."""
    per_out, kl_out, clip_out, tok_loss, tok_kl, tok_clip, n_tok = [], [], [], 0.0, 0.0, 0.0, 0
    for b in range(len(adv)):
        terms, kls, clips = [], [], []
        for t in range(len(mask[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old_logp[b][t])
            a = float(adv[b])
            surr = min(ratio * a, min(max(ratio, 1 - eps_lo), 1 + eps_hi) * a)
            kl = 0.0
            if ref_logp is not None:
                kl = math.exp(ref_logp[b][t] - logp[b][t]) - (ref_logp[b][t] - logp[b][t]) - 1
            terms.append(-surr + beta * kl)
            kls.append(kl)
            clips.append(float(min(max(ratio, 1 - eps_lo), 1 + eps_hi) * a < ratio * a))
        if not terms:
            continue
        tok_loss, tok_kl, tok_clip, n_tok = tok_loss + sum(terms), tok_kl + sum(kls), tok_clip + sum(clips), \
            n_tok + len(terms)
        per_out.append(sum(terms) / len(terms) if agg == "sequence" else sum(terms) / max_tokens)
        kl_out.append(sum(kls) / len(kls))
        clip_out.append(sum(clips) / len(clips))
    if agg == "token":
        return tok_loss / n_tok, tok_kl / n_tok, tok_clip / n_tok
    return sum(per_out) / len(per_out), sum(kl_out) / len(kl_out), sum(clip_out) / len(clip_out)
