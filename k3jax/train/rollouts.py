"""GRPO's batches: rollouts of the current policy with k3jax's own engine, scored and packed.

Per rollout, P = batch_size × grad_accum / G prompts (grpo.group_size = G) are taken in a
seeded order, epoch by epoch, and each is rendered with K3's generation prompt
(k3jax.chat, data.chat.thinking / thinking_effort or the record's own) and sampled G times
by `k3jax.infer.engine.Engine.run` with the *current* params (LoRA adapters unmerged, as the
engine serves a LoRA run): fixed slots, each completion its own seeded stream
(temperature, top-p), stopping at `<|end_of_msg|>` (kept in the trained tokens: ending the
turn is part of the reply) or at grpo.max_tokens; a row that finishes frees its slot for
the next. Each reply is parsed (`k3jax.chat.parse_reply`) and scored by the config's
rewards; advantages are normalised within each group (grpo.group_advantages).

A row of data.seq_len + 1 tokens holds one completion after its prompt; the loss mask
covers the completion's tokens only. Beside the rows ride `advantages` [A, B], `old_logp`
(π_old per target, one forward of the rollout params, so the first update's ratio is 1)
and, with grpo.kl_beta > 0, `ref_logp`: the base with adapters off under LoRA (frozen, so
computed once here rather than in every update), else the run's initial params, of which
`bind` keeps a copy (a second set of weights in memory, as the price of an exact reference).

A rollout batch serves grpo.updates_per_batch consecutive steps (k = step // updates); a
run resumed between them samples afresh with the resumed params.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.chat.generation import prompt_ids
from k3jax.chat.packing import ROW_OPTIONS
from k3jax.chat.parsing import parse_reply
from k3jax.errors import InputError
from k3jax.tokenizer import END_OF_MSG
from k3jax.train.batches import Recomputed
from k3jax.train.data import rows_to_batch
from k3jax.train.grpo import group_advantages, read_prompts
from k3jax.train.rewards import Rewards

# prompt tokens a rollout slot is fed per engine step (the engine's other width is 1: decode)
PROMPT_CHUNK = 32


class PromptSet:
    """Prompt records and their rendered ids (generation prompt included)."""

    def __init__(self, records, tokenizer, options: dict, room: int):
        self.records, self.ids = [], []
        for where, row in records:
            opts = {**options, **{k: row[k] for k in ROW_OPTIONS if k in row}}
            try:
                ids = prompt_ids(row["messages"], tokenizer, row.get("tools"), **opts)
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{where}: {' '.join(str(e).split())}") from None
            if len(ids) > room:
                raise InputError(f"{where}: the prompt renders to {len(ids)} tokens; with grpo.max_tokens the row "
                                 f"holds {room} (raise data.seq_len)")
            self.records.append((where, row, opts.get("thinking", True)))
            self.ids.append(ids)
        self.n_rows = len(self.ids)

    def summary(self) -> str:
        n = [len(i) for i in self.ids]
        return f"prompts: {self.n_rows} (rendered {min(n)}..{max(n)} tokens)"


def build_prompts(tc: dict, tok, path: str) -> PromptSet:
    chat, g, d = tc["data"]["chat"], tc["grpo"], tc["data"]
    return PromptSet(read_prompts(path), tok, {"thinking": chat["thinking"],
                                               "thinking_effort": chat["thinking_effort"]},
                     d["seq_len"] + 1 - g["max_tokens"])


@functools.lru_cache(maxsize=8)
def _logps(cfg, base: bool):
    from k3jax.train import dpo
    return jax.jit(functools.partial(dpo.base_logps if base else dpo.policy_logps, cfg))


def rollout(cfg, params, prompts: PromptSet, picks, tok, rewards: Rewards, *, max_tokens: int, max_len: int,
            temperature: float, top_p: float, seeds, slots: int, stop: int | None = None, scope=None):
    """Sample `picks` (prompt indices, one completion each, seed `seeds[i]`) with the
    engine, each ending at the `stop` id (default `<|end_of_msg|>`, the end of a turn) or
    after max_tokens, on `scope`'s mesh (generator.MeshScope; None: no mesh); returns
    [(prompt ids, completion ids (stop included), total reward, [each], finish_reason)] in order."""
    from k3jax.infer.engine import Engine, Request
    from k3jax.infer.sampling import SamplingParams
    stop = tok.token_id(END_OF_MSG) if stop is None else stop
    eng = Engine(cfg, params, slots=slots, max_len=max_len, chunk=PROMPT_CHUNK, prefix_entries=0, scope=scope)
    reqs = [Request(prompt=list(prompts.ids[i]), max_tokens=max_tokens, stop_ids=frozenset({stop}),
                    sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=int(s)))
            for i, s in zip(picks, seeds)]
    eng.run(reqs)
    out = []
    for i, r in zip(picks, reqs):
        where, record, thinking = prompts.records[i]
        ids = list(r.out) + ([stop] if r.finish_reason == "stop" else [])
        reply = {**parse_reply(ids, thinking=thinking, tokenizer=tok), "finish_reason": r.finish_reason}
        total, each = rewards.score(where, record, reply)
        out.append((prompts.ids[i], ids, total, each, r.finish_reason))
    return out


def pack_rows(results, width: int, pad_id: int):
    """[(prompt, completion, ...)] -> batch arrays [R, width - 1] with the completion's
    targets alone in the loss mask."""
    R = len(results)
    tokens, segs = np.full((R, width), pad_id, np.int32), np.zeros((R, width), np.int32)
    train = np.zeros((R, width), bool)
    for j, (p, c, *_) in enumerate(results):
        n = len(p) + len(c)
        tokens[j, :n] = list(p) + list(c)
        segs[j, :n] = 1
        train[j, len(p):n] = True
    b = rows_to_batch(tokens, segs)
    b["loss_mask"] = b["loss_mask"] * train[:, 1:]
    return b


class RolloutBatches(Recomputed):
    """The loop's batch source for GRPO (batches.MemoryBatches' interface; `needs_params`:
    the loop hands `batch` the current params, objectives.batch_for)."""

    loader, local, has_images, needs_params = "grpo", False, False, True

    def __init__(self, tc: dict, prompts: PromptSet, tok, pad_id: int):
        self.tc, self.g, self.d, self.prompts, self.tok, self.pad_id = tc, tc["grpo"], tc["data"], prompts, tok, pad_id
        self.rewards = Rewards(self.g["rewards"], self.g["reward_weights"])
        rows = self.d["batch_size"] * self.d["grad_accum"]
        self.n_prompts = rows // self.g["group_size"]
        self.cfg = self.ref_params = self.scope = None
        self._k, self._batch = None, None
        self._window = {"rollout_s": 0.0, "gen_tokens": 0, "update_tokens": 0, "rewards": [], "lengths": [],
                        "stopped": 0, "n": 0}

    def bind(self, cfg, ref_params=None, scope=None):
        """The model to sample and score with; `ref_params`: the reference's params (no LoRA);
        `scope`: the run's mesh (generator.MeshScope), where the rollouts' caches live."""
        self.cfg, self.ref_params, self.scope = cfg, ref_params, scope

    def describe(self) -> str:
        return (f"{self.prompts.summary()}; {self.n_prompts} prompts x {self.g['group_size']} completions "
                f"(<= {self.g['max_tokens']} tokens) per rollout, {self.g['updates_per_batch']} update(s) each; "
                f"rewards {', '.join(self.g['rewards'])}")

    def picks(self, k: int) -> np.ndarray:
        """Prompt indices of rollout k: a seeded permutation per pass over the prompts."""
        n, N = self.n_prompts, self.prompts.n_rows
        pos = np.arange(k * n, (k + 1) * n)
        return np.array([np.random.default_rng([self.tc["seed"], p // N]).permutation(N)[p % N] for p in pos])

    def batch(self, step: int, params) -> dict:
        k = step // self.g["updates_per_batch"]
        if self._k != k:
            self._batch, self._k = self._make(k, params), k
        self._window["update_tokens"] += int((self._batch["segment_ids"] > 0).sum())
        return self._batch

    def _make(self, k: int, params) -> dict:
        g, d, G = self.g, self.d, self.g["group_size"]
        picks = np.repeat(self.picks(k), G)
        seeds = [(self.tc["seed"] * 1_000_003 + k * 65_537 + j) % 2**31 for j in range(len(picks))]
        t = time.perf_counter()
        res = rollout(self.cfg, params, self.prompts, picks, self.tok, self.rewards, max_tokens=g["max_tokens"],
                      max_len=d["seq_len"], temperature=g["temperature"], top_p=g["top_p"], seeds=seeds,
                      slots=min(g["rollout_slots"], len(picks)), scope=self.scope)
        w = self._window
        w["rollout_s"] += time.perf_counter() - t
        rewards = np.array([r[2] for r in res], np.float64)
        self.last_rewards = rewards             # the last rollout's, row by row (tests, debugging)
        lengths = [len(r[1]) for r in res]
        w["gen_tokens"] += sum(lengths)
        w["rewards"] += rewards.tolist()
        w["lengths"] += lengths
        w["stopped"] += sum(r[4] == "stop" for r in res)
        w["n"] += len(res)
        b = pack_rows(res, d["seq_len"] + 1, self.pad_id)
        if g["mask_truncated"]:     # cut at max_tokens: no loss (the group's advantages still count it)
            b["loss_mask"] = b["loss_mask"] * np.array([r[4] == "stop" for r in res], np.float32)[:, None]
        b["advantages"] = group_advantages(rewards.reshape(-1, G), g["scale_rewards"]).reshape(-1)
        A, B = d["grad_accum"], d["batch_size"]
        b = {key: v.reshape(A, B, *v.shape[1:]) for key, v in b.items()}
        old, ref = [], []
        for a in range(A):
            mb = {key: jnp.asarray(v[a]) for key, v in b.items()}
            old.append(np.asarray(_logps(self.cfg, False)(params, mb)))
            if g["kl_beta"] > 0:
                ref.append(np.asarray(_logps(self.cfg, True)(params, mb)) if self.ref_params is None
                           else np.asarray(_logps(self.cfg, False)(self.ref_params, mb)))
        b["old_logp"] = np.stack(old).astype(np.float32)
        if ref:
            b["ref_logp"] = np.stack(ref).astype(np.float32)
        return b

    def window(self, seconds: float) -> dict:
        """Rollout metrics since the last call, `seconds` the wall time they span."""
        w = self._window
        if not w["n"]:
            return {}
        r = np.array(w["rewards"])
        update_s = max(seconds - w["rollout_s"], 1e-9)
        out = {"reward_mean": float(r.mean()), "reward_std": float(r.std()),
               "response_length": float(np.mean(w["lengths"])), "stop_fraction": w["stopped"] / w["n"],
               "rollout_tokens_per_s": w["gen_tokens"] / max(w["rollout_s"], 1e-9),
               "update_tokens_per_s": w["update_tokens"] / update_s, "rollout_s": w["rollout_s"]}
        self._window = {"rollout_s": 0.0, "gen_tokens": 0, "update_tokens": 0, "rewards": [], "lengths": [],
                        "stopped": 0, "n": 0}
        return out


class Evaluator:
    """`evaluate(params)` -> {'eval_reward' (mean summed reward), 'eval_solved' (the fraction
    whose every reward is >= 1: each built-in at its maximum), 'eval_length', 'eval_prompts'}
    of one greedy completion per held-out prompt."""

    def __init__(self, tc: dict, ds: PromptSet, tok):
        self.tc, self.ds, self.tok = tc, ds, tok
        self.rewards = Rewards(tc["grpo"]["rewards"], tc["grpo"]["reward_weights"])
        self.cfg = self.scope = None
        # the training rollouts' slot count, so both share one compiled engine step
        d = tc["data"]
        self.slots = min(tc["grpo"]["rollout_slots"], d["batch_size"] * d["grad_accum"])

    def __call__(self, params) -> dict:
        g = self.tc["grpo"]
        res = rollout(self.cfg, params, self.ds, np.arange(self.ds.n_rows), self.tok, self.rewards,
                      max_tokens=g["max_tokens"], max_len=self.tc["data"]["seq_len"], temperature=0.0, top_p=1.0,
                      seeds=[0] * self.ds.n_rows, slots=self.slots, scope=self.scope)
        return {"eval_reward": float(np.mean([r[2] for r in res])),
                "eval_solved": float(np.mean([all(x >= 1.0 for x in r[3]) for r in res])),
                "eval_length": float(np.mean([len(r[1]) for r in res])), "eval_prompts": len(res)}
