"""Direct Preference Optimization (`objective: dpo`): the pair losses, the completion
log-probs they take, the reference model, and evaluation on held-out pairs.

Notation: for a pair, x is the chosen completion and y the rejected one; π(x) the policy's
log-prob of x summed over x's completion tokens (k3jax.train.preference: the assistant
tokens after the prompt, nothing else), π_ref the reference model's, |x| the number of those
tokens; β = dpo.beta, ε = dpo.label_smoothing, γ = dpo.gamma.

- sigmoid (DPO, Rafailov et al. 2023): h = β·[(π(x) − π_ref(x)) − (π(y) − π_ref(y))],
  L = −(1 − ε)·log σ(h) − ε·log σ(−h); ε > 0 is conservative DPO (Mitchell 2023): each
  label is taken to be flipped with probability ε, so the loss stops rewarding a margin
  that grows without bound.
- ipo (Azar et al. 2023, eq. 17 with τ = β): h = (π(x) − π_ref(x)) − (π(y) − π_ref(y)),
  L = (h − 1/(2β))²: the log-likelihood ratio is regressed to a finite target instead.
- simpo (Meng et al. 2024): no reference, length-normalised:
  h = β·π(x)/|x| − β·π(y)/|y| − γ, L as sigmoid's (ε included).

Metrics (means over pairs): the implicit rewards r = β·(π − π_ref) (simpo: β·π/|·|),
reward_margin = r(x) − r(y), reward_accuracy = [r(x) > r(y)], logp_accuracy = [π(x) > π(y)]
(evaluation's `accuracy`: which completion the model itself ranks higher, needing no
reference), chosen_logp = π(x), rejected_logp = π(y).

The reference (sigmoid and ipo): with LoRA it is the frozen base with the adapters off,
run inside the step without a gradient: the base weights are already in memory, so it
costs a forward and no memory for weights. Without LoRA the initial params are the
reference; keeping a second copy of every weight through training would double the params'
memory, so instead one forward pass over the training (and eval) pairs before the first
step stores their per-token reference log-probs beside the rows (`precompute_reference`;
a resumed run recomputes it from the same initial params).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model import LORA_KEY, K3Model, variables_of
from k3jax.train import qat
from k3jax.train.preference import CHOSEN, REJECTED

METRICS = ("reward_margin", "reward_accuracy", "logp_accuracy", "chosen_logp", "rejected_logp")


def token_logps(logits, targets, mask):
    """log p(target) at each position, fp32, 0 where `mask` is 0."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return (picked - jax.nn.logsumexp(logits, axis=-1)) * mask


def sequence_logps(tok, segment_ids, mask):
    """Per row: (Σ log-prob over the chosen completion, over the rejected one, and their token
    counts), from per-target log-probs `tok` and the rows' segment ids (preference.py)."""
    c = (segment_ids == CHOSEN) * mask
    r = (segment_ids == REJECTED) * mask
    return jnp.sum(tok * c, -1), jnp.sum(tok * r, -1), jnp.sum(c, -1), jnp.sum(r, -1)


def pair_losses(pc, pr, rc, rr, nc, nr, *, loss: str, beta: float, label_smoothing: float = 0.0,
                gamma: float = 0.0):
    """(loss, chosen reward, rejected reward) per pair (module docstring). pc/pr: policy
    log-prob sums, rc/rr: the reference's (ignored by simpo), nc/nr: completion lengths."""
    if loss == "simpo":
        wc, wr = beta * pc / jnp.maximum(nc, 1.0), beta * pr / jnp.maximum(nr, 1.0)
        h = wc - wr - gamma
    else:
        wc, wr = beta * (pc - rc), beta * (pr - rr)
        h = wc - wr
    if loss == "ipo":
        return ((pc - rc) - (pr - rr) - 1.0 / (2.0 * beta)) ** 2, wc, wr
    eps = label_smoothing
    return -(1.0 - eps) * jax.nn.log_sigmoid(h) - eps * jax.nn.log_sigmoid(-h), wc, wr


def pair_terms(opts: dict, tok, ref_tok, mb):
    """(Σ loss, number of pairs, {metric: Σ over pairs}) of a microbatch: what the step adds
    up over microbatches and divides by the global pair count. `ref_tok`: the reference's
    per-target log-probs, or None (simpo). Rows without a scored chosen and rejected
    completion (evaluation's padding rows) count for nothing."""
    pc, pr, nc, nr = sequence_logps(tok, mb["segment_ids"], mb["loss_mask"])
    if ref_tok is None:
        rc = rr = jnp.zeros_like(pc)
    else:
        rc, rr, _, _ = sequence_logps(ref_tok, mb["segment_ids"], mb["loss_mask"])
    valid = ((nc > 0) & (nr > 0)).astype(jnp.float32)
    losses, wc, wr = pair_losses(pc, pr, rc, rr, nc, nr, loss=opts["loss"], beta=opts["beta"],
                                 label_smoothing=opts["label_smoothing"], gamma=opts["gamma"])
    per_pair = {"reward_margin": wc - wr, "reward_accuracy": (wc > wr).astype(jnp.float32),
                "logp_accuracy": (pc > pr).astype(jnp.float32), "chosen_logp": pc, "rejected_logp": pr}
    return jnp.sum(losses * valid), jnp.sum(valid), {k: jnp.sum(v * valid) for k, v in per_pair.items()}


def policy_logps(cfg, params, mb):
    """Per-target log-probs of the model `cfg` (adapters included) on a batch's rows."""
    logits = K3Model(cfg).apply(variables_of(qat.view(cfg, params)), mb["tokens"], mb["segment_ids"])
    return token_logps(logits, mb["targets"], mb["loss_mask"])


def base_logps(cfg, params, mb):
    """The LoRA reference: the same forward with the adapters off (the frozen base), no gradient."""
    base = cfg.with_runtime(lora=None)
    p = {k: v for k, v in params.items() if k != LORA_KEY}
    return jax.lax.stop_gradient(policy_logps(base, p, mb))


def reference_kind(cfg, tc: dict) -> str:
    """'none' (simpo), 'adapters_off' (LoRA: in the step) or 'precomputed' (see module doc)."""
    if tc["dpo"]["loss"] == "simpo":
        return "none"
    return "adapters_off" if cfg.runtime.lora is not None else "precomputed"


def step_reference(cfg, tc: dict):
    """(params, microbatch) -> the reference's per-target log-probs the step uses, or None."""
    kind = reference_kind(cfg, tc)
    if kind == "adapters_off":
        return lambda params, mb: base_logps(cfg, params, mb)
    if kind == "precomputed":
        return lambda params, mb: mb["ref_logp"]
    return lambda params, mb: None


@functools.lru_cache(maxsize=4)
def _jitted(cfg, base: bool):
    """One compiled forward per model for the reference pass and evaluation."""
    return jax.jit(functools.partial(base_logps if base else policy_logps, cfg))


def precompute_reference(cfg, params, datasets, batch_size: int) -> None:
    """Fill each PreferenceDataset's `ref` with the per-target log-probs of `params` (the
    run's initial weights), batch_size rows a forward."""
    f = _jitted(cfg, False)
    for ds in datasets:
        out = [np.asarray(f(params, {k: v[0] for k, v in b.items()}))
               for b in ds.chunks(batch_size)]
        ds.ref = np.concatenate(out)[:ds.n_rows].astype(np.float32)


class Evaluator:
    """`evaluate(params)` -> {'eval_loss', 'eval_accuracy' (logp), 'eval_reward_accuracy',
    'eval_reward_margin', 'eval_chosen_logp', 'eval_rejected_logp', 'eval_pairs'} over every
    pair of a held-out PreferenceDataset, from the given weights (one forward a batch of
    rows; the precomputed reference is the dataset's own, filled by precompute_reference)."""

    def __init__(self, cfg, tc: dict, ds, batch_size: int):
        self.cfg, self.ds, self.batch_size = cfg, ds, batch_size
        self.opts, self.kind = tc["dpo"], reference_kind(cfg, tc)

    def __call__(self, params) -> dict:
        total = None
        for b in self.ds.chunks(self.batch_size):
            mb = {k: v[0] for k, v in b.items()}
            ref = (None if self.kind == "none" else mb["ref_logp"] if self.kind == "precomputed"
                   else _jitted(self.cfg, True)(params, mb))
            s = pair_terms(self.opts, _jitted(self.cfg, False)(params, mb), ref, mb)
            s = jax.tree.map(lambda x: np.float64(x), s)
            total = s if total is None else jax.tree.map(np.add, total, s)
        loss, n, extras = total
        n = max(float(n), 1.0)
        return {"eval_loss": float(loss) / n, "eval_accuracy": float(extras["logp_accuracy"]) / n,
                "eval_reward_accuracy": float(extras["reward_accuracy"]) / n,
                "eval_reward_margin": float(extras["reward_margin"]) / n,
                "eval_chosen_logp": float(extras["chosen_logp"]) / n,
                "eval_rejected_logp": float(extras["rejected_logp"]) / n, "eval_pairs": int(total[1])}
