"""What the loop asks of the train config's objective (`objective: sft | dpo | grpo`), so that
the loop itself does not branch on it: the batches, each step's batch (GRPO's are rollouts of
the current params: `batch_for`), their layout for a mesh, the work before the first step,
evaluation on held-out records, and the objective's metrics in the log line.
SFT's answers are the loop's plain ones; DPO's come from preference.py and dpo.py, GRPO's
from rollouts.py and grpo.py.
"""
from __future__ import annotations

import numpy as np

from k3jax.train import batches as tbatches


def is_dpo(tc: dict) -> bool:
    return tc.get("objective", "sft") == "dpo"


def is_grpo(tc: dict) -> bool:
    return tc.get("objective", "sft") == "grpo"


def make_batches(tc: dict, path: str, tok, k3, process_index: int, process_count: int, media_dir=None):
    """The training batches: SFT's `data.loader` choice, DPO's preference rows (in memory), or
    GRPO's rollouts (bound to the model in `prepare`)."""
    d = tc["data"]
    if is_grpo(tc):
        from k3jax.train.rollouts import RolloutBatches, build_prompts
        return RolloutBatches(tc, build_prompts(tc, tok, path), tok, k3.text.pad_token_id)
    if is_dpo(tc):
        from k3jax.train.preference import build_preference
        return tbatches.MemoryBatches(build_preference(d, tok, k3, path), d, tc["seed"])
    return tbatches.make_batches(d, path, tc["seed"], tok, k3, process_index, process_count, media_dir=media_dir)


def batch_spec(cfg, tc: dict) -> dict:
    """Global shapes and dtypes of a step's batch: SFT's, plus DPO's precomputed reference
    log-probs where the reference is precomputed (dpo.reference_kind)."""
    spec = tbatches.batch_spec(tc["data"])
    if is_grpo(tc):
        shape = spec["loss_mask"][0]
        spec["advantages"] = (shape[:2], np.float32)
        spec["old_logp"] = (shape, np.float32)
        if tc["grpo"]["kl_beta"] > 0:
            spec["ref_logp"] = (shape, np.float32)
    if is_dpo(tc):
        from k3jax.train.dpo import reference_kind
        if reference_kind(cfg, tc) == "precomputed":
            spec["ref_logp"] = (spec["loss_mask"][0], np.float32)
    return spec


def evaluator(cfg, tc: dict, tok, k3, path: str | None):
    """A callable params -> {'eval_...': value} over data.eval_path (at `path`), or None
    when the config names no eval data."""
    if path is None:
        return None
    if is_grpo(tc):
        from k3jax.train.rollouts import Evaluator as RolloutEvaluator, build_prompts
        ev = RolloutEvaluator(tc, build_prompts(tc, tok, path), tok)
        ev.cfg = cfg
        return ev
    from k3jax.train.dpo import Evaluator
    from k3jax.train.preference import build_preference
    return Evaluator(cfg, tc, build_preference(tc["data"], tok, k3, path), tc["data"]["batch_size"])


def prepare(cfg, tc: dict, params, batches, evaluate, log, mesh=None) -> None:
    """Before the first step, with the run's initial params: DPO without LoRA scores every
    training and eval pair with them once (the reference; dpo.precompute_reference). GRPO
    binds its rollouts to the model, with a copy of the initial params as the reference
    where one is needed without LoRA (the step donates the params it is given), and to the
    run's mesh (`mesh`: (Mesh, rules) or None), where its engine keeps the caches."""
    if is_grpo(tc):
        g = tc["grpo"]
        ref = None
        if g["kl_beta"] > 0 and cfg.runtime.lora is None:
            import jax
            ref = jax.tree.map(lambda x: x.copy(), params)
        from k3jax.infer.generator import MeshScope
        scope = MeshScope.around(*mesh) if mesh is not None else None
        batches.bind(cfg, ref, scope)
        if evaluate is not None:
            evaluate.scope = scope
        kind = "none" if g["kl_beta"] == 0 else "initial params (a copy)" if ref is not None else \
            "the base with adapters off"
        log(f"grpo: loss_agg {g['loss_agg']}, clip {g['clip_eps']}/{g['clip_eps_high'] or g['clip_eps']}, "
            f"kl_beta {g['kl_beta']} (reference: {kind}), scale_rewards {g['scale_rewards']}")
        return
    if not is_dpo(tc):
        return
    from k3jax.train.dpo import precompute_reference, reference_kind
    kind = reference_kind(cfg, tc)
    if kind == "precomputed":
        import time
        t = time.perf_counter()
        sets = [batches.ds] + ([evaluate.ds] if evaluate is not None else [])
        precompute_reference(cfg, params, sets, tc["data"]["batch_size"])
        log(f"dpo: reference log-probs of {sum(s.n_rows for s in sets)} pairs from the initial weights in "
            f"{time.perf_counter() - t:.1f} s")
    else:
        log(f"dpo: loss {tc['dpo']['loss']}, reference "
            + ("the base with adapters off (in the step)" if kind == "adapters_off" else "none"))


def eval_due(tc: dict, step: int) -> bool:
    """Evaluate after this step: every eval_every steps and at the last."""
    return step == tc["steps"] or bool(tc["eval_every"]) and step % tc["eval_every"] == 0


def batch_for(batches, step: int, params) -> dict:
    """The batch of `step`: a function of the step, or (GRPO) of the step and the params."""
    return batches.batch(step, params) if getattr(batches, "needs_params", False) else batches.batch(step)


def step_metrics(m, batches=None, seconds: float = 0.0) -> dict:
    """The objective's own metrics of a step's output, as floats for metrics.jsonl, plus
    what the batch source measured over the `seconds` since the last call (GRPO's rollouts)."""
    from k3jax.train.dpo import METRICS
    from k3jax.train.grpo import METRICS as GRPO_METRICS
    out = {k: float(m[k]) for k in METRICS + GRPO_METRICS if k in m}
    if batches is not None and hasattr(batches, "window"):
        out.update(batches.window(seconds))
    return out


def describe(rec: dict) -> str:
    """The objective's part of the log line (after the loss): '' for SFT."""
    out = ""
    if "reward_margin" in rec:
        out += (f" | margin {rec['reward_margin']:.3f} | acc {rec['reward_accuracy']:.2f} | logp chosen/rejected "
                f"{rec['chosen_logp']:.2f}/{rec['rejected_logp']:.2f}")
    if "reward_mean" in rec:
        out += (f" | reward {rec['reward_mean']:.3f}±{rec['reward_std']:.3f} | kl {rec.get('kl', 0.0):.4f} | "
                f"clip {rec.get('clip_fraction', 0.0):.3f} | len {rec['response_length']:.1f} | rollout "
                f"{rec['rollout_tokens_per_s']:,.0f} tok/s | update {rec['update_tokens_per_s']:,.0f} tok/s")
    if "eval_solved" in rec:
        out += f" | eval reward {rec['eval_reward']:.3f} solved {rec['eval_solved']:.3f}"
    if "eval_accuracy" in rec:
        out += f" | eval acc {rec['eval_accuracy']:.3f} loss {rec['eval_loss']:.4f}"
    return out
