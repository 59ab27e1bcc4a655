"""What the loop asks of the train config's objective (`objective: sft | dpo`), so that the
loop itself does not branch on it: the batches, their layout for a mesh, the work before the
first step, evaluation on held-out records, and the objective's metrics in the log line.
SFT's answers are the loop's plain ones; DPO's come from preference.py and dpo.py.
"""
from __future__ import annotations

import numpy as np

from k3jax.train import batches as tbatches


def is_dpo(tc: dict) -> bool:
    return tc.get("objective", "sft") == "dpo"


def make_batches(tc: dict, path: str, tok, k3, process_index: int, process_count: int, media_dir=None):
    """The training batches: SFT's `data.loader` choice, or DPO's preference rows (in memory)."""
    d = tc["data"]
    if is_dpo(tc):
        from k3jax.train.preference import build_preference
        return tbatches.MemoryBatches(build_preference(d, tok, k3, path), d, tc["seed"])
    return tbatches.make_batches(d, path, tc["seed"], tok, k3, process_index, process_count, media_dir=media_dir)


def batch_spec(cfg, tc: dict) -> dict:
    """Global shapes and dtypes of a step's batch: SFT's, plus DPO's precomputed reference
    log-probs where the reference is precomputed (dpo.reference_kind)."""
    spec = tbatches.batch_spec(tc["data"])
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
    from k3jax.train.dpo import Evaluator
    from k3jax.train.preference import build_preference
    return Evaluator(cfg, tc, build_preference(tc["data"], tok, k3, path), tc["data"]["batch_size"])


def prepare(cfg, tc: dict, params, batches, evaluate, log) -> None:
    """Before the first step, with the run's initial params: DPO without LoRA scores every
    training and eval pair with them once (the reference; dpo.precompute_reference)."""
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


def step_metrics(m) -> dict:
    """The objective's own metrics of a step's output, as floats for metrics.jsonl."""
    from k3jax.train.dpo import METRICS
    return {k: float(m[k]) for k in METRICS if k in m}


def describe(rec: dict) -> str:
    """The objective's part of the log line (after the loss): '' for SFT."""
    out = ""
    if "reward_margin" in rec:
        out += (f" | margin {rec['reward_margin']:.3f} | acc {rec['reward_accuracy']:.2f} | logp chosen/rejected "
                f"{rec['chosen_logp']:.2f}/{rec['rejected_logp']:.2f}")
    if "eval_accuracy" in rec:
        out += f" | eval acc {rec['eval_accuracy']:.3f} loss {rec['eval_loss']:.4f}"
    return out
