"""The `train:` section of a YAML preset: schema, defaults and `key=value` overrides.

Top level: steps, seed, output_dir, run_name, init_from, log_every, ckpt_every, keep (Orbax
max_to_keep), async_checkpoint, peak_tflops (per device; null = measure a dense matmul at
start), sample_prompt, sample_tokens, qat (quantization-aware fine-tuning: the forward sees
every weight as `k3jax export` stores it, routed experts as MXFP4 of W + s·A·B, the rest
bf16, gradients straight through; k3jax/train/qat.py), objective ('sft': next-token loss on
data.path | 'dpo': preference pairs, k3jax/train/dpo.py | 'grpo': rollouts of prompts scored
by rewards, k3jax/train/grpo.py and rollouts.py), eval_every (steps between evaluations
on data.eval_path; 0 = at the end only; the run also evaluates before its first step).
  data:      path (.txt / .jsonl / folder, local or gs://), text_key, tokenizer ('auto' =
             tiktoken when bpe_file is set, else 'byte' | 'byte' | 'tiktoken'), bpe_file
             (tiktoken.model or the checkpoint folder holding it), pattern, seq_len,
             batch_size, grad_accum,
             loader ('memory': the corpus packed in host memory, batches a function of
             (seed, step) | 'grain': streamed, each process reading its share, the stream's
             state saved with each checkpoint: k3jax/train/stream.py), shuffle_window
             (grain: documents shuffled within windows of this many),
             format ('text': documents | 'chat': JSONL conversations, k3jax.chat.packing;
             chat is read by the memory loader),
             chat: train_on ('all' assistant turns | 'last'), thinking, thinking_effort
             ('low' | 'high' | 'max' | null), truncate (cut conversations longer than a row;
             false drops them), on_bad_record ('error': a record the checks refuse stops the
             run naming file:line and the field | 'skip': counted in the data summary),
             eval_path (held-out records in data.path's format, never trained on; objective
             dpo: preference pairs; grpo: prompts, greedy; evaluated every eval_every steps
             and at the end)
  grpo:      (objective grpo; data.path holds prompts {"messages", "answer", ...}; data.batch_size
             x grad_accum completions per step, a multiple of group_size) group_size (G),
             max_tokens (per completion; a row of seq_len + 1 holds prompt and completion),
             temperature, top_p, rollout_slots (the engine's), updates_per_batch (updates per
             rollout batch), clip_eps, clip_eps_high (DAPO's clip-higher; null = clip_eps),
             kl_beta (k3 KL to the reference; 0 = none), loss_agg ('sequence' | 'token': DAPO
             | 'constant': Dr. GRPO), scale_rewards (divide advantages by the group's std;
             false: Dr. GRPO), mask_truncated (DAPO's overlong filtering: a completion cut at
             max_tokens takes no loss, so a right answer that never ends its turn is not
             reinforced), rewards (built-ins exact_match | tool_call | format, or
             'module:function'), reward_weights (null = 1 each)
  dpo:       (objective dpo; data.format chat: the pairs render as chat) beta, loss ('sigmoid'
             = DPO | 'ipo' | 'simpo': length-normalised, reference-free, margin gamma),
             label_smoothing (cDPO's ε: the chance a pair's label is flipped; sigmoid and
             simpo), gamma (SimPO's target reward margin)
  optimizer: lr (Muon), adam_lr (null = lr; Moonlight's RMS matching lets them share one),
             warmup_steps, schedule ('cosine' | 'constant'), min_lr_ratio, weight_decay,
             b1, b2, eps, grad_clip, muon_beta, ns_steps, muon_rms (0.2),
             kv_b_mode ('split' | 'whole'), muon_scaling ('block' | 'full'),
             freeze (globs on param paths, e.g. '*/w[123]', or 're:REGEX')
  balance:   enabled, method ('auto' | 'exact' | 'hist'), bins, sweeps,
             exact_max_elements (auto picks exact while tokens·experts is at most this)
  runtime:   k3jax.config.RuntimeOptions, every field but lora and qat, with its defaults: dtype,
             param_dtype, remat ('none' | 'full' | 'dots'), kda_impl, kda_chunk_size,
             moe_dispatch ('auto' = 'ep' on a mesh with an expert axis), ep_exchange,
             ep_capacity_factor (0 = dropless 'ep'; e.g. 1.25 caps each device's received
             pairs at 1.25 × the mean and drops the overflow; see `k3jax plan --ep-capacity`),
             ep_first_round (dropless 'ep': the first round's buffer as × the mean, exact
             overflow windows after it only when needed; 0 = one worst-case round),
             ep_buffer_mib, attention_q_block, scan_layers, decode_attention ('auto' | 'xla' |
             'pallas': inference's attention over the MLA cache; auto = the kernel on TPU),
             expert_format ('bf16' | 'mxfp4': routed experts kept as the checkpoint's MXFP4, frozen),
             optimizer_offload (the optimizer state in host memory between updates)
  lora:      rank (0 = off), alpha, expert_rank, expert_mode ('per_expert' | 'shared_a'),
             targets (globs; null = k3jax.lora.DEFAULT_TARGETS), optimizer ('adamw' |
             'muon'), lr (see k3jax/lora.py)

Overrides: `steps=200`, `optimizer.lr=1e-3`, `data.path=my.jsonl`; values parse as YAML.

Validation is table-driven: `SCHEMA` has the shape of `DEFAULTS` and one rule per key (a
type, a range, the allowed values). Every problem of the whole config is reported at once,
in one line naming each key: unknown keys, booleans where numbers go, numbers out of range,
values outside an enum (listing the allowed ones), a run_name or output_dir that would
leave the output directory. Adding a key is one line in each table.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import re

import yaml

from k3jax.config import (DECODE_ATTENTIONS, DTYPES, EP_EXCHANGES, EXPERT_FORMATS, KDA_IMPLS, LORA_EXPERT_MODES,
                          MOE_DISPATCHES, OBJECTIVES, REMAT_POLICIES, ConfigError, RuntimeOptions)

SCHEDULES = ("cosine", "constant")
RUNTIME_DEFAULTS = {f.name: getattr(RuntimeOptions(), f.name) for f in dataclasses.fields(RuntimeOptions)
                    if f.name not in ("lora", "qat")}

DEFAULTS = {
    "steps": 100, "seed": 0, "output_dir": "runs", "run_name": "run", "init_from": None,
    "log_every": 10, "ckpt_every": 50, "keep": 3, "async_checkpoint": True, "peak_tflops": None,
    "sample_prompt": "The ", "sample_tokens": 48, "qat": False, "objective": "sft", "eval_every": 0,
    "data": {"path": "data/corpus.txt", "text_key": "text", "tokenizer": "auto", "bpe_file": None,
             "pattern": None, "seq_len": 128, "batch_size": 8, "grad_accum": 1,
             "loader": "memory", "shuffle_window": 1024, "format": "text",
             "chat": {"train_on": "all", "thinking": True, "thinking_effort": "max", "truncate": True,
                      "on_bad_record": "error"},
             "eval_path": None},
    "dpo": {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0, "gamma": 0.5},
    "grpo": {"group_size": 8, "max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "rollout_slots": 64,
             "updates_per_batch": 1, "clip_eps": 0.2, "clip_eps_high": None, "kl_beta": 0.0,
             "loss_agg": "sequence", "scale_rewards": True, "mask_truncated": False, "rewards": ["exact_match"],
             "reward_weights": None},
    "optimizer": {"lr": 0.02, "adam_lr": None, "warmup_steps": 10, "schedule": "cosine",
                  "min_lr_ratio": 0.1, "weight_decay": 0.1, "b1": 0.9, "b2": 0.95, "eps": 1e-8,
                  "grad_clip": 1.0, "muon_beta": 0.95, "ns_steps": 5, "muon_rms": 0.2,
                  "kv_b_mode": "split", "muon_scaling": "block", "freeze": []},
    "balance": {"enabled": True, "method": "auto", "bins": 1000, "sweeps": 6,
                "exact_max_elements": 1 << 22},
    # RuntimeOptions' own fields and defaults (every one but `lora`, its own section, and
    # `qat`, a top-level key)
    "runtime": RUNTIME_DEFAULTS,
    "lora": {"rank": 0, "alpha": None, "expert_rank": None, "expert_mode": "per_expert",
             "targets": None, "optimizer": "adamw", "lr": None},
}


# ---------------------------------------------------------------------------------------
# Rules: each takes (value, key) and returns the value (numbers given as YAML strings such
# as '1e-3' become floats) or raises _Bad with the reason.
# ---------------------------------------------------------------------------------------
class _Bad(Exception):
    pass


def _int(lo=None, hi=None):
    def rule(v, key):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Bad(f"expected an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _Bad(f"must be {_range(lo, hi)}, got {v!r}")
        return v
    return rule


def _float(lo=None, hi=None, *, above=None, below=None):
    """A number in [lo, hi] (and > above, < below): ints are accepted; YAML reads '1e-3'
    (no dot) as a string, which is accepted when it is a number."""
    def rule(v, key):
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise _Bad(f"expected a number, got {v!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Bad(f"expected a number, got {v!r}")
        v = float(v)
        if v != v or (lo is not None and v < lo) or (hi is not None and v > hi) \
                or (above is not None and v <= above) or (below is not None and v >= below):
            raise _Bad(f"must be {_range(lo, hi, above, below)}, got {v!r}")
        return v
    return rule


def _range(lo, hi, above=None, below=None) -> str:
    parts = ([f">= {lo}"] if lo is not None else []) + ([f"> {above}"] if above is not None else []) \
        + ([f"<= {hi}"] if hi is not None else []) + ([f"< {below}"] if below is not None else [])
    return " and ".join(parts)


def _bool(v, key):
    if not isinstance(v, bool):
        raise _Bad(f"expected true or false, got {v!r}")
    return v


def _str(nonempty=True):
    def rule(v, key):
        if not isinstance(v, str) or (nonempty and not v):
            raise _Bad(f"expected a {'non-empty ' if nonempty else ''}string, got {v!r}")
        return v
    return rule


def _one_of(*allowed):
    def rule(v, key):
        if v not in allowed:
            raise _Bad(f"{v!r} is not one of {', '.join(map(repr, allowed))}")
        return v
    rule.allowed = allowed
    return rule


def _optional(inner):
    def rule(v, key):
        return None if v is None else inner(v, key)
    return rule


def _list_of(inner):
    def rule(v, key):
        if not isinstance(v, list):
            raise _Bad(f"expected a list, got {v!r}")
        return [inner(x, key) for x in v]
    return rule


def _run_name(v, key):
    """A plain directory name: `{output_dir}/{run_name}` must stay inside output_dir."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._+-]*", v) or v in (".", ".."):
        raise _Bad(f"must be a plain name (letters, digits, '._+-', not starting with '.' or '-'), got {v!r}")
    return v


def _output_dir(v, key):
    """A local path or a URL (gs://bucket/...), without '..' components that climb out of
    where it points."""
    if not isinstance(v, str) or not v.strip():
        raise _Bad(f"expected a path or URL, got {v!r}")
    path = v.split("://", 1)[1] if "://" in v else v
    if ".." in path.replace("\\", "/").split("/") or "\0" in v:
        raise _Bad(f"must not contain '..' components (give the directory as an absolute path), got {v!r}")
    if "://" in v and not path.strip("/"):
        raise _Bad(f"a URL needs a bucket, got {v!r}")
    return v


def _freeze_pattern(v, key):
    if not isinstance(v, str) or not v:
        raise _Bad(f"expected glob or 're:REGEX' strings, got {v!r}")
    if v.startswith("re:"):
        try:
            re.compile(v[3:])
        except re.error as e:
            raise _Bad(f"{v!r} is not a valid regular expression ({e})") from None
    return v


SCHEMA = {
    "steps": _int(1), "seed": _int(0), "output_dir": _output_dir, "run_name": _run_name,
    "init_from": _optional(_str()), "log_every": _int(1), "ckpt_every": _int(1), "keep": _int(1),
    "async_checkpoint": _bool, "peak_tflops": _optional(_float(above=0)),
    "sample_prompt": _str(nonempty=False), "sample_tokens": _int(0), "qat": _bool,
    "objective": _one_of(*OBJECTIVES), "eval_every": _int(0),
    "data": {"path": _str(), "text_key": _str(), "tokenizer": _one_of("auto", "byte", "tiktoken"),
             "bpe_file": _optional(_str()), "pattern": _optional(_str()), "seq_len": _int(2),
             "batch_size": _int(1), "grad_accum": _int(1), "loader": _one_of("memory", "grain"),
             "shuffle_window": _int(0), "format": _one_of("text", "chat"),
             "chat": {"train_on": _one_of("all", "last"), "thinking": _bool,
                      "thinking_effort": _one_of("low", "high", "max", None), "truncate": _bool,
                      "on_bad_record": _one_of("error", "skip")},
             "eval_path": _optional(_str())},
    "dpo": {"beta": _float(above=0), "loss": _one_of("sigmoid", "ipo", "simpo"),
            "label_smoothing": _float(0, below=0.5), "gamma": _float(0)},
    "grpo": {"group_size": _int(2), "max_tokens": _int(1), "temperature": _float(0), "top_p": _float(above=0, hi=1),
             "rollout_slots": _int(1), "updates_per_batch": _int(1), "clip_eps": _float(above=0, below=1),
             "clip_eps_high": _optional(_float(above=0)), "kl_beta": _float(0),
             "loss_agg": _one_of("sequence", "token", "constant"), "scale_rewards": _bool,
             "mask_truncated": _bool, "rewards": _list_of(_str()), "reward_weights": _optional(_list_of(_float()))},
    # lr 0 is allowed: a run that only measures (or only balances the router) updates nothing
    "optimizer": {"lr": _float(0), "adam_lr": _optional(_float(0)), "warmup_steps": _int(0),
                  "schedule": _one_of(*SCHEDULES), "min_lr_ratio": _float(0, 1), "weight_decay": _float(0),
                  "b1": _float(0, below=1), "b2": _float(0, below=1), "eps": _float(above=0),
                  "grad_clip": _float(0), "muon_beta": _float(0, below=1), "ns_steps": _int(1),
                  "muon_rms": _float(above=0), "kv_b_mode": _one_of("split", "whole"),
                  "muon_scaling": _one_of("block", "full"), "freeze": _list_of(_freeze_pattern)},
    "balance": {"enabled": _bool, "method": _one_of("auto", "exact", "hist"), "bins": _int(2),
                "sweeps": _int(1), "exact_max_elements": _int(1)},
    "runtime": {"dtype": _one_of(*DTYPES), "param_dtype": _one_of(*DTYPES), "remat": _one_of(*REMAT_POLICIES),
                "kda_impl": _one_of(*KDA_IMPLS), "kda_chunk_size": _int(1), "moe_dispatch": _one_of(*MOE_DISPATCHES),
                "ep_exchange": _one_of(*EP_EXCHANGES), "ep_capacity_factor": _float(0), "ep_first_round": _float(0),
                "ep_buffer_mib": _float(0), "attention_q_block": _int(0), "scan_layers": _bool,
                "expert_format": _one_of(*EXPERT_FORMATS), "decode_attention": _one_of(*DECODE_ATTENTIONS),
                "optimizer_offload": _bool},
    # k3jax.lora.resolve checks what needs the model (targets that match nothing, ...)
    "lora": {"rank": _int(0), "alpha": _optional(_float(above=0)), "expert_rank": _optional(_int(1)),
             "expert_mode": _one_of(*LORA_EXPERT_MODES), "targets": _optional(_list_of(_str())),
             "optimizer": _one_of("adamw", "muon"), "lr": _optional(_float(0))},
}


def _merge(base: dict, over: dict, where: str, problems: list) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key not in base:
            problems.append(f"train.{where}{key}: unknown key (known: {', '.join(sorted(base))})")
        elif isinstance(base[key], dict):
            if isinstance(value, dict):
                out[key] = _merge(base[key], value, f"{where}{key}.", problems)
            elif value is not None:   # an empty `optimizer:` section reads as null
                problems.append(f"train.{where}{key}: expected a mapping, got {value!r}")
        else:
            out[key] = value
    return out


def _check(cfg: dict, schema: dict, where: str, problems: list) -> None:
    for key, value in cfg.items():
        rule = schema.get(key)
        if isinstance(rule, dict):
            _check(value, rule, f"{where}{key}.", problems)
        elif rule is not None:   # a key without a rule is caught by the tests, not here
            try:
                cfg[key] = rule(value, f"{where}{key}")
            except _Bad as e:
                problems.append(f"train.{where}{key}: {e}")


def parse_overrides(items: list[str]) -> dict:
    """['a=1', 'optimizer.lr=3e-3'] → nested dict with YAML-parsed values."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            hint = ""
            if raw.lstrip()[:1] in "*&!%@`|>":   # YAML indicators: '*/w1' reads as an alias
                hint = f"; a text starting with {raw.lstrip()[0]!r} needs quotes: {key}='\"{raw}\"'"
                if key.strip().endswith("freeze"):
                    hint = f"; quote the glob and give a list: {key}='[\"{raw}\"]'"
            raise ConfigError(f"override {item!r}: not a YAML value ({' '.join(str(e).split())}){hint}") from None
        node = out
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is set twice")
        node[parts[-1]] = value
    return out


def resolve(section: dict, overrides: dict | None = None) -> dict:
    """DEFAULTS, then the preset's section, then overrides, validated as a whole: a
    ConfigError lists every problem (`; `-separated on one line)."""
    problems: list[str] = []
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"train: expected a mapping, got {section!r}")
    cfg = _merge(_merge(DEFAULTS, section or {}, "", problems), overrides or {}, "", problems)
    if not problems:
        _check(cfg, SCHEMA, "", problems)
    if not problems and cfg["data"]["format"] == "chat" and cfg["data"]["loader"] != "memory":
        problems.append(f"train.data.loader: {cfg['data']['loader']!r} streams text documents; "
                        "format 'chat' is read by the 'memory' loader")
    if not problems:
        problems += _objective_problems(cfg)
    if problems:
        raise ConfigError("config " + "; ".join(problems))
    return cfg


def _objective_problems(cfg: dict) -> list[str]:
    """Keys that only make sense together: DPO reads preference pairs rendered as chat."""
    out, d = [], cfg["data"]
    if cfg["objective"] == "dpo":
        if d["format"] != "chat":
            out.append(f"train.data.format: {d['format']!r}; objective 'dpo' reads preference pairs rendered in "
                       "the chat format: set data.format: chat")
        if cfg["dpo"]["loss"] == "ipo" and cfg["dpo"]["label_smoothing"]:
            out.append("train.dpo.label_smoothing: IPO has no label smoothing (it regresses the margin to "
                       "1/(2 beta)); set it to 0")
    elif cfg["objective"] == "grpo":
        g = cfg["grpo"]
        if d["format"] != "chat":
            out.append(f"train.data.format: {d['format']!r}; objective 'grpo' renders its prompts in the chat "
                       "format: set data.format: chat")
        if (d["batch_size"] * d["grad_accum"]) % g["group_size"]:
            out.append(f"train.data.batch_size: {d['batch_size']} x grad_accum {d['grad_accum']} completions per "
                       f"step is not a multiple of grpo.group_size {g['group_size']}")
        if g["max_tokens"] >= d["seq_len"]:
            out.append(f"train.grpo.max_tokens: {g['max_tokens']} leaves no room for a prompt in a row of "
                       f"data.seq_len {d['seq_len']}")
        if not g["rewards"]:
            out.append("train.grpo.rewards: name at least one reward")
        if g["reward_weights"] is not None and len(g["reward_weights"]) != len(g["rewards"]):
            out.append(f"train.grpo.reward_weights: {len(g['reward_weights'])} weights for "
                       f"{len(g['rewards'])} rewards")
    elif d["eval_path"] is not None:
        out.append(f"train.data.eval_path: evaluation runs with objective 'dpo' or 'grpo' only (objective is "
                   f"{cfg['objective']!r})")
    return out


def check_freeze(patterns, param_paths) -> None:
    """Every freeze pattern must match at least one param path ('layers_0/mlp/up_proj/kernel'
    style, as `muon.path_str` writes them): a typo would otherwise freeze nothing."""
    paths = list(param_paths)
    dead = [p for p in patterns
            if not any(re.search(p[3:], x) if p.startswith("re:") else fnmatch.fnmatchcase(x, p) for x in paths)]
    if dead:
        example = ", ".join(paths[:3])
        raise ConfigError(f"config train.optimizer.freeze: {dead} match no param (paths look like {example}, ...)")


# ---------------------------------------------------------------------------------------
# Resuming: what may not change between a run's checkpoints and the config resuming them
# ---------------------------------------------------------------------------------------
def _effective_data(d: dict) -> dict:
    """A data section as it reads the corpus: keys a saved run lacks take the default they
    had, tokenizer 'auto' becomes the one it picks, and the chat settings of a text run
    (unused) are left out."""
    d = {**DEFAULTS["data"], **d}
    d.pop("eval_path")      # held-out records: not the stream a run trains on
    if d["tokenizer"] == "auto":
        d["tokenizer"] = "tiktoken" if d["bpe_file"] else "byte"
    if d["format"] != "chat":
        d.pop("chat")
    return d


def resume_conflicts(saved: dict, new: dict) -> list[str]:
    """Keys of the train config whose change would make a resumed run something else:
    the data stream (data.*, seed), `steps`, over which the cosine schedule is laid out
    (a changed steps= would make the learning rate jump; only a run that is constant before
    and after may change it), and a LoRA run's adapters (lora.*) and base (init_from: its
    checkpoints hold only the adapters). Each entry reads 'key: old -> new'."""
    out = []
    a_data, b_data = _effective_data(saved.get("data", {})), _effective_data(new["data"])
    for key in sorted(set(a_data) | set(b_data)):
        a, b = a_data.get(key), b_data.get(key)
        if a != b:
            out.append(f"train.data.{key}: {a!r} -> {b!r}")
    if saved.get("seed") != new["seed"]:
        out.append(f"train.seed: {saved.get('seed')!r} -> {new['seed']!r}")
    schedules = {(saved.get("optimizer") or {}).get("schedule", "cosine"), new["optimizer"]["schedule"]}
    if saved.get("steps") != new["steps"] and schedules != {"constant"}:
        out.append(f"train.steps: {saved.get('steps')!r} -> {new['steps']!r} (the learning-rate schedule is "
                   f"laid out over steps: it would jump)")
    if saved.get("objective", "sft") != new["objective"]:
        out.append(f"train.objective: {saved.get('objective', 'sft')!r} -> {new['objective']!r}")
    if new["objective"] == "dpo":
        a_dpo = {**DEFAULTS["dpo"], **(saved.get("dpo") or {})}
        out += [f"train.dpo.{k}: {a_dpo.get(k)!r} -> {v!r}" for k, v in sorted(new["dpo"].items()) if a_dpo.get(k) != v]
    if new["objective"] == "grpo":
        a_g = {**DEFAULTS["grpo"], **(saved.get("grpo") or {})}
        out += [f"train.grpo.{k}: {a_g.get(k)!r} -> {v!r}" for k, v in sorted(new["grpo"].items()) if a_g.get(k) != v]
    a_lora, b_lora = {**DEFAULTS["lora"], **(saved.get("lora") or {})}, new["lora"]
    for key in sorted(b_lora):
        if a_lora.get(key) != b_lora[key]:
            out.append(f"train.lora.{key}: {a_lora.get(key)!r} -> {b_lora[key]!r}")
    if (a_lora["rank"] or b_lora["rank"]) and saved.get("init_from") != new["init_from"]:
        out.append(f"train.init_from: {saved.get('init_from')!r} -> {new['init_from']!r} (a LoRA run's base)")
    return out
