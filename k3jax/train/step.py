"""The pure train step: `train_step(state, batch) -> (state, metrics)`, jitted, state donated.

A step runs `grad_accum` microbatches under `lax.scan` (one compiled body, activations of
one microbatch alive at a time), sums token-weighted losses and gradients, divides by the
global count of loss tokens (so accumulation is exactly a bigger batch), casts gradients to
fp32 (optimizer state is fp32 even with bf16 params), applies the optimizer, and finally
replaces every router bias with the Quantile Balancing solution from this step's router
scores (a frozen router keeps its bias). With `runtime.optimizer_offload` the optimizer
state lives in host memory and comes to the device only for the update (train/offload.py).

The objective (`tc['objective']`) chooses the per-microbatch loss and nothing else: 'sft'
sums token cross-entropy over the loss tokens; 'dpo' (k3jax/train/dpo.py) sums the pair
losses of the microbatch's preference rows and counts pairs, its reference log-probs taken
without a gradient before the policy's forward (the base with adapters off under LoRA, or
the batch's precomputed `ref_logp`), and adds up its metrics (reward margin, accuracies,
chosen/rejected log-probs) like the loss, each divided by the global pair count; 'grpo'
(k3jax/train/grpo.py) sums the clipped policy loss over completion tokens against the
batch's rollout log-probs and advantages (plus the k3 KL to the batch's `ref_logp`).

Only the trained params (`muon.trained_mask`: not frozen, not a router bias, not integer
MXFP4 bytes; with LoRA, the adapters alone) are differentiated: the others enter the loss
as constants, so no gradient, accumulator or optimizer state exists for them.

Images (multimodal fine-tuning, `make_train_step(..., vision=VisionConfig)`): the batch may
carry `images` = {'pixels': [A, L, 3, P, P], 'grid_thws': [N, 3]}, the same packed images
for each of the A microbatches' layout (grids are static, so every microbatch has the same
image sizes), and the params a `vision` subtree. Each microbatch's k-th `<|media_pad|>`
(row-major, already expanded) takes its k-th projector row; the tower and projector get
gradients like any param unless their group is frozen. Without `vision` the step is the
text-only one, unchanged.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from k3jax.config import ConfigError, ModelConfig, VisionConfig
from k3jax.ops.moe_dispatch import drops_pairs
from k3jax.layers.vision import check_grids, check_pixels, rows_per_image
from k3jax.errors import InputError
from k3jax.model import K3Model, variables_of
from k3jax.train import balancing, offload, qat
from k3jax.train.muon import path_str, trained_mask
from k3jax.model.multimodal import check_media_rows
from k3jax.model.multimodal import VISION_KEY, image_inputs, split_params


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any          # every param (base, adapters under 'lora', vision)
    opt_state: Any       # over the trained params only


def split_trained(params, mask):
    """(trained, fixed): two trees shaped like `params`, None where the other holds a leaf."""
    trained = jax.tree.map(lambda x, m: x if m else None, params, mask)
    fixed = jax.tree.map(lambda x, m: None if m else x, params, mask)
    return trained, fixed


def merge_trained(trained, fixed):
    """Inverse of `split_trained`."""
    return jax.tree.map(lambda a, b: b if a is None else a, trained, fixed, is_leaf=lambda x: x is None)


def frozen_routers(groups) -> set[str]:
    """Bias paths ('/'-joined) of routers whose bias Quantile Balancing must leave alone."""
    return {path_str(p)for p, g in jax.tree_util.tree_leaves_with_path(groups)
            if path_str(p).endswith("e_score_correction_bias") and g == "frozen"}


def _checkpoint_mask(groups):
    """Under LoRA a checkpoint holds the adapters and the router biases (Quantile Balancing
    re-solves them), not the frozen base; None: the whole state."""
    if not any(g == "lora" for g in jax.tree.leaves(groups)):
        return None
    return jax.tree.map(lambda g: g in ("lora", "router_bias"), groups)


def checkpoint_view(state: TrainState, groups) -> TrainState:
    """The part of the state a checkpoint saves (see `_checkpoint_mask`)."""
    mask = _checkpoint_mask(groups)
    return state if mask is None else state.replace(params=split_trained(state.params, mask)[0])


def from_checkpoint_view(state: TrainState, restored: TrainState, groups) -> TrainState:
    """A restored `checkpoint_view` completed with the frozen base of `state`."""
    mask = _checkpoint_mask(groups)
    if mask is None:
        return restored
    return restored.replace(params=merge_trained(restored.params, split_trained(state.params, mask)[1]))


def opt_init(tx, params, groups):
    """The optimizer state over the trained params, fp32 (see `init_state`)."""
    trained, _ = split_trained(params, trained_mask(groups))
    return tx.init(jax.tree.map(lambda x: x.astype(jnp.float32), trained))


def cross_entropy(logits, targets, mask):
    """(Σ masked token CE, Σ mask) in fp32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.sum((lse - picked) * mask), jnp.sum(mask)


def objective_fns(cfg: ModelConfig, tc: dict):
    """(loss_terms(logits, mb, ref) -> (Σ loss, count, {metric: Σ}), reference(params, mb) ->
    what loss_terms takes as `ref` (no gradient), metric names) of the train config's objective."""
    from k3jax.train import dpo
    if tc.get("objective", "sft") == "grpo":
        from k3jax.train import grpo
        opts = tc["grpo"]

        def grpo_terms(logits, mb, ref):
            logp = dpo.token_logps(logits, mb["targets"], mb["loss_mask"])
            return grpo.token_terms(opts, logp, mb["old_logp"], ref, mb["advantages"], mb["loss_mask"])
        # the reference's log-probs come with the rollout (rollouts.py), none when kl_beta is 0
        return grpo_terms, (lambda params, mb: mb.get("ref_logp")), grpo.METRICS
    if tc.get("objective", "sft") == "dpo":
        opts = tc["dpo"]

        def dpo_terms(logits, mb, ref):
            return dpo.pair_terms(opts, dpo.token_logps(logits, mb["targets"], mb["loss_mask"]), ref, mb)
        return dpo_terms, dpo.step_reference(cfg, tc), dpo.METRICS

    def sft_terms(logits, mb, ref):
        return (*cross_entropy(logits, mb["targets"], mb["loss_mask"]), {})
    return sft_terms, lambda params, mb: None, ()


def balance_method(cfg: ModelConfig, tc: dict) -> str | None:
    b = tc["balance"]
    if not b["enabled"] or not cfg.num_experts or "moe" not in cfg.ffn_kinds:  # no router, nothing to balance
        return None
    if b["method"] != "auto":
        return b["method"]
    d = tc["data"]
    tokens = d["batch_size"] * d["grad_accum"] * d["seq_len"]
    return "exact" if tokens * cfg.num_experts <= b["exact_max_elements"] else "hist"


def make_train_step(cfg: ModelConfig, tc: dict, tx: optax.GradientTransformation, groups, *,
                    vision: VisionConfig | None = None, media_pad_id: int | None = None):
    """The jitted step for a model config, resolved train config, optimizer and group tree.

    With `vision` (and the config's `media_pad_id`), a step that also takes batches with
    images; see the module docstring."""
    model = K3Model(cfg)
    method = balance_method(cfg, tc)
    k = cfg.num_experts_per_token
    bins, sweeps = int(tc["balance"]["bins"]), int(tc["balance"]["sweeps"])
    moe_layers = cfg.ffn_kinds.count("moe") if cfg.num_experts else 0
    mask = trained_mask(groups)
    keep_bias = frozen_routers(groups)
    loss_terms, reference, extra_names = objective_fns(cfg, tc)

    def micro(trained, fixed, mb, grids=None):
        ref = reference(merge_trained(trained, fixed), mb)

        def loss_fn(t):
            p = qat.view(cfg, merge_trained(t, fixed))   # the identity unless cfg.runtime.qat
            img = {}
            if grids is not None:
                p, vp = split_params(p)
                img = image_inputs(cfg, vision, vp, mb["images"]["pixels"], grids, mb["tokens"], media_pad_id)
            logits, inter = model.apply(variables_of(p), mb["tokens"], mb["segment_ids"],
                                        mutable=["intermediates"], **img)
            loss_sum, count, extras = loss_terms(logits, mb, ref)
            return loss_sum, (count, extras, inter.get("intermediates", {}))
        (loss_sum, (count, extras, inter)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        valid = (mb["segment_ids"] > 0).reshape(-1)
        params = merge_trained(trained, fixed)
        stats = (balancing.step_stats(params, jax.lax.stop_gradient(inter), k, valid, method or "exact", bins)
                 if method else {})
        dropped = sum((jnp.sum(x) for p, x in jax.tree_util.tree_leaves_with_path(inter)
                       if "ep_dropped" in jax.tree_util.keystr(p)), jnp.zeros((), jnp.int32))
        return loss_sum, count, extras, grads, stats, valid, dropped

    def train_step(state: TrainState, batch, grids=None):
        params = state.params
        trained, fixed = split_trained(params, mask)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained)

        def body(carry, mb):
            loss_sum, count, sums, grads, hist, dropped = carry
            l, c, e, g, stats, valid, d = micro(trained, fixed, mb, grids)
            dropped = dropped + d
            sums = jax.tree.map(jnp.add, sums, e)
            grads = jax.tree.map(jnp.add, grads, g)
            if method == "hist":   # histograms and loads add up across microbatches
                hist = jax.tree.map(jnp.add, hist, stats)
                out = None
            else:                  # exact: keep this microbatch's scores for the global solve
                hist = jax.tree.map(jnp.add, hist, {p: {"load": s["load"]} for p, s in stats.items()})
                out = ({p: s["stat"] for p, s in stats.items()}, valid)
            return (loss_sum + l, count + c, sums, grads, hist, dropped), out

        hist0 = balancing.accumulator_zeros(params, method, bins) if method else {}
        sums0 = {name: jnp.zeros(()) for name in extra_names}
        (loss_sum, count, sums, grads, agg, dropped), per_mb = jax.lax.scan(
            body, (jnp.zeros(()), jnp.zeros(()), sums0, zeros, hist0, jnp.zeros((), jnp.int32)), batch)
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = loss_sum / denom

        opt_in = state.opt_state
        if cfg.runtime.optimizer_offload:    # in host memory until the microbatches are done
            opt_in = offload.fetch_after(opt_in, count)
        updates, opt_state = tx.update(grads, opt_in, trained)
        if cfg.runtime.optimizer_offload:
            opt_state = offload.to_host(opt_state)
        new_params = merge_trained(optax.apply_updates(trained, updates), fixed)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": count,
                   **{name: v / denom for name, v in sums.items()}}
        if drops_pairs(cfg):
            # (token, expert) pairs the 'ep' receive capacity dropped, over all routed pairs
            pairs = batch["tokens"].size * k * moe_layers
            # a Python float: K3's pairs at 2048 x 4096 overflow an int32 argument
            metrics["ep_dropped"] = dropped.astype(jnp.float32) / float(max(pairs, 1))
        if method:
            n_valid = jnp.sum(batch["segment_ids"] > 0)
            if method == "exact":
                scores, valid = per_mb
                # [A, .., m, n] → [.., A·m, n]: one solve over the whole global batch
                merged = {p: {"stat": jnp.moveaxis(s, 0, -3).reshape(*s.shape[1:-2], -1, s.shape[-1])}
                          for p, s in scores.items() if p not in keep_bias}
                new_params = balancing.new_biases(new_params, merged, k, valid.reshape(-1), "exact", sweeps)
            else:
                new_params = balancing.new_biases(new_params, {p: v for p, v in agg.items() if p not in keep_bias},
                                                  k, None, "hist")
            loads = balancing.load_summary(agg, k, n_valid)
            metrics["load"] = loads
            flat = jnp.concatenate([v.reshape(-1, 2) for v in loads.values()])
            metrics["load_max"], metrics["load_min"] = jnp.max(flat[:, 0]), jnp.min(flat[:, 1])
        return TrainState(step=state.step + 1, params=new_params, opt_state=opt_state), metrics

    if vision is None:
        return jax.jit(train_step, donate_argnums=(0,))
    if media_pad_id is None:
        raise ConfigError("a train step with vision needs the config's media_pad_id")
    jitted = jax.jit(train_step, donate_argnums=(0,), static_argnames="grids")

    def step(state: TrainState, batch):
        if "images" not in batch:
            return jitted(state, batch)
        images = dict(batch["images"])
        grids = check_grids(vision, np.asarray(images.pop("grid_thws")))
        pixels = images["pixels"]
        if getattr(pixels, "ndim", 0) != 5:
            raise InputError(f"batch images.pixels must be [grad_accum, num_patches, 3, P, P], got shape "
                             f"{getattr(pixels, 'shape', None)}")
        for a in range(pixels.shape[0]):
            check_pixels(vision, pixels[a], grids)
        if VISION_KEY not in state.params:
            raise InputError("the batch has images but the params hold no vision tower")
        tokens = batch["tokens"]
        if getattr(tokens, "is_fully_addressable", True):  # host check: one sync, before any compile
            n_rows = sum(rows_per_image(vision, grids))
            for a, t in enumerate(np.asarray(tokens)):
                try:
                    check_media_rows(t, media_pad_id, n_rows)
                except InputError as e:
                    raise InputError(f"microbatch {a}: {e}") from None
        return jitted(state, {**batch, "images": images}, grids=grids)

    return step


def init_state(params, tx, groups) -> TrainState:
    # Initialise from fp32 params so every moment (Adam's nu included) is fp32 with bf16
    # params too; otherwise the state's dtype would change after the first update.
    opt_state = jax.jit(lambda p: opt_init(tx, p, groups))(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
