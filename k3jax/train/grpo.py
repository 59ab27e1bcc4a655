"""Group Relative Policy Optimization (`objective: grpo`): prompt records, group-normalised
advantages and the clipped policy loss. Rollouts (the batches) are k3jax/train/rollouts.py.

Notation: a prompt q has a group of G = grpo.group_size sampled completions o_1..o_G with
rewards r_i (k3jax/train/rewards.py); π the current policy, π_old the policy that sampled
them (the params at the rollout), π_ref the reference; per completion token t,
ρ_t = π(o_t | ·) / π_old(o_t | ·), ε_lo = grpo.clip_eps, ε_hi = grpo.clip_eps_high (null: ε_lo).

- Advantages (Shao et al. 2024, DeepSeekMath §4.1.2, outcome supervision): every token of
  o_i gets Â_i = (r_i − mean(r)) / (std(r) + 1e-6) over its group (population std);
  `scale_rewards: false` drops the division (Dr. GRPO, Liu et al. 2025: the std weights
  easy and hard questions unevenly).
- Per token: ℓ_t = −min(ρ_t·Â, clip(ρ_t, 1 − ε_lo, 1 + ε_hi)·Â) + β·k3_t, with the KL term
  k3_t = exp(π_ref − π) − (π_ref − π) − 1 in log-probs (Schulman's k3 estimator of
  KL(π ‖ π_ref), unbiased and ≥ 0; β = grpo.kl_beta, 0: no reference needed).
- Aggregation (grpo.loss_agg): 'sequence' (GRPO): each completion's mean over its tokens,
  averaged over completions; 'token' (DAPO, Yu et al. 2025): one mean over every completion
  token of the batch, so long completions are not down-weighted; 'constant' (Dr. GRPO): the
  sum over tokens divided by completions × grpo.max_tokens, a constant, so no length bias.

Several updates per rollout batch (grpo.updates_per_batch): π_old's log-probs are computed
once at the rollout and ride in the batch; at the first update ρ = 1 and the clip is inert.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from k3jax.errors import InputError
from k3jax.textfiles import jsonl_files, jsonl_records

METRICS = ("kl", "clip_fraction", "ratio")


def read_prompts(path: str) -> list[tuple[str, dict]]:
    """(file:line, record) of each prompt of a .jsonl file or a folder of them: an object with
    a non-empty `messages` list of message objects (the rest is for the rewards)."""
    out = []
    for file in jsonl_files(path, "prompt data"):
        out += _read_prompts_of(file)
    return out


def _read_prompts_of(path: str) -> list[tuple[str, dict]]:
    out = []
    for n, row in jsonl_records(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected an object with a 'messages' list (and the fields rewards read)")
        msgs = row.get("messages")
        if msgs is None:
            raise InputError(f"{where}: missing 'messages' (a prompt record is {{\"messages\": [...], "
                             f"\"answer\": ...}})")
        if not isinstance(msgs, list) or not msgs:
            raise InputError(f"{where}: 'messages' must be a non-empty list of messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise InputError(f"{where}: messages[{i}] must be an object with a 'role'")
        if msgs[-1]["role"] == "assistant":
            raise InputError(f"{where}: messages[{len(msgs) - 1}] is an assistant turn: a prompt ends before "
                             f"the reply the policy writes")
        if row.get("tools") is not None and not isinstance(row["tools"], list):
            raise InputError(f"{where}: 'tools' must be a list of tool declarations")
        out.append((where, row))
    if not out:
        raise InputError(f"{path}: no prompts")
    return out


def group_advantages(rewards, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """rewards [P, G] (P groups of G) -> advantages [P, G] (module docstring)."""
    r = np.asarray(rewards, np.float64)
    a = r - r.mean(axis=1, keepdims=True)
    if scale:
        a = a / (r.std(axis=1, keepdims=True) + eps)
    return a.astype(np.float32)


def token_terms(opts: dict, logp, old_logp, ref_logp, adv, mask):
    """(Σ loss, count, {metric: Σ}) of a microbatch (module docstring), the step dividing
    both sums by the global count. logp/old_logp/ref_logp [B, T] per target (ref None: no KL
    term), adv [B] per completion, mask [B, T] completion targets. Rows without a completion
    token (padding) count for nothing. Metrics are aggregated like the loss: 'kl' (k3),
    'clip_fraction' (tokens where the clipped term was taken with a gradient of zero),
    'ratio' (mean ρ)."""
    mask = mask.astype(logp.dtype)
    n = jnp.sum(mask, -1)
    a = adv[:, None]
    ratio = jnp.exp(logp - old_logp)
    lo, hi = 1.0 - opts["clip_eps"], 1.0 + (opts["clip_eps_high"] if opts["clip_eps_high"] is not None
                                            else opts["clip_eps"])
    unclipped, clipped = ratio * a, jnp.clip(ratio, lo, hi) * a
    per_tok = -jnp.minimum(unclipped, clipped)
    clip_hit = (clipped < unclipped).astype(logp.dtype)
    if ref_logp is not None:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        per_tok = per_tok + opts["kl_beta"] * kl
    else:
        kl = jnp.zeros_like(per_tok)
    valid = (n > 0).astype(logp.dtype)
    agg = opts["loss_agg"]
    if agg == "token":
        weight = mask                                         # Σ over tokens / Σ tokens
        count = jnp.sum(mask)
    elif agg == "sequence":
        weight = mask / jnp.maximum(n, 1.0)[:, None]          # per-completion mean, / completions
        count = jnp.sum(valid)
    else:                                                     # 'constant': Σ / (completions · max_tokens)
        weight = mask / float(opts["max_tokens"])
        count = jnp.sum(valid)
    # metrics: token means ('token') or means of per-completion means (the others)
    mweight = mask if agg == "token" else mask / jnp.maximum(n, 1.0)[:, None]
    sums = {"kl": jnp.sum(kl * mweight), "clip_fraction": jnp.sum(clip_hit * mweight),
            "ratio": jnp.sum(ratio * mweight)}
    return jnp.sum(per_tok * weight), count, sums
