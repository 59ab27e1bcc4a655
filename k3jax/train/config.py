"""The `train:` section of a YAML preset: schema, defaults and `key=value` overrides.

Top level: steps, seed, output_dir, run_name, init_from, log_every, ckpt_every, keep (Orbax
max_to_keep), async_checkpoint, peak_tflops (per device; null = measure a dense matmul at
start), sample_prompt, sample_tokens.
  data:      path (.txt / .jsonl / folder), text_key, tokenizer ('auto' = tiktoken when
             bpe_file is set, else 'byte' | 'byte' | 'tiktoken'), bpe_file (tiktoken.model or
             the checkpoint folder holding it), pattern, seq_len, batch_size, grad_accum,
             format ('text': documents | 'chat': JSONL conversations, k3jax.chat.packing),
             chat: train_on ('all' assistant turns | 'last'), thinking, thinking_effort
             ('low' | 'high' | 'max' | null), truncate (cut conversations longer than a row;
             false drops them)
  optimizer: lr (Muon), adam_lr (null = lr; Moonlight's RMS matching lets them share one),
             warmup_steps, schedule ('cosine' | 'constant'), min_lr_ratio, weight_decay,
             b1, b2, eps, grad_clip, muon_beta, ns_steps, muon_rms (0.2),
             kv_b_mode ('split' | 'whole'), muon_scaling ('block' | 'full'),
             freeze (globs on param paths, e.g. '*/w[123]', or 're:REGEX')
  balance:   enabled, method ('auto' | 'exact' | 'hist'), bins, sweeps,
             exact_max_elements (auto picks exact while tokens·experts is at most this)
  runtime:   dtype, param_dtype, remat ('none' | 'full' | 'dots'), kda_impl, moe_dispatch,
             ep_capacity_factor (0 = dropless 'ep'; e.g. 1.25 caps each device's received
             pairs at 1.25 × the mean and drops the overflow; see `k3jax plan --ep-capacity`),
             expert_format ('bf16' | 'mxfp4': routed experts kept as the checkpoint's MXFP4, frozen)
  lora:      rank (0 = off), alpha, expert_rank, expert_mode ('per_expert' | 'shared_a'),
             targets (globs; null = k3jax.lora.DEFAULT_TARGETS), optimizer ('adamw' |
             'muon'), lr (see k3jax/lora.py)

Overrides: `steps=200`, `optimizer.lr=1e-3`, `data.path=my.jsonl`; values parse as YAML.
Unknown keys are errors that name the key.
"""
from __future__ import annotations

import copy

import yaml

from k3jax.config import ConfigError

DEFAULTS = {
    "steps": 100, "seed": 0, "output_dir": "runs", "run_name": "run", "init_from": None,
    "log_every": 10, "ckpt_every": 50, "keep": 3, "async_checkpoint": True, "peak_tflops": None,
    "sample_prompt": "The ", "sample_tokens": 48,
    "data": {"path": "data/corpus.txt", "text_key": "text", "tokenizer": "auto", "bpe_file": None,
             "pattern": None, "seq_len": 128, "batch_size": 8, "grad_accum": 1, "format": "text",
             "chat": {"train_on": "all", "thinking": True, "thinking_effort": "max", "truncate": True}},
    "optimizer": {"lr": 0.02, "adam_lr": None, "warmup_steps": 10, "schedule": "cosine",
                  "min_lr_ratio": 0.1, "weight_decay": 0.1, "b1": 0.9, "b2": 0.95, "eps": 1e-8,
                  "grad_clip": 1.0, "muon_beta": 0.95, "ns_steps": 5, "muon_rms": 0.2,
                  "kv_b_mode": "split", "muon_scaling": "block", "freeze": []},
    "balance": {"enabled": True, "method": "auto", "bins": 1000, "sweeps": 6,
                "exact_max_elements": 1 << 22},
    "runtime": {"dtype": "float32", "param_dtype": "float32", "remat": "none",
                "kda_impl": "chunk", "moe_dispatch": "ragged", "ep_capacity_factor": 0.0,
                "expert_format": "bf16"},
    "lora": {"rank": 0, "alpha": None, "expert_rank": None, "expert_mode": "per_expert",
             "targets": None, "optimizer": "adamw", "lr": None},
}


def _merge(base: dict, over: dict, where: str = "train") -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key not in base:
            raise ConfigError(f"config key {where}.{key!r}: unknown key (known: {sorted(base)})")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where}.{key}: expected a mapping, got {value!r}")
            out[key] = _merge(base[key], value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def parse_overrides(items: list[str]) -> dict:
    """['a=1', 'optimizer.lr=3e-3'] → nested dict with YAML-parsed values."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def resolve(section: dict, overrides: dict | None = None) -> dict:
    cfg = _merge(_merge(DEFAULTS, section or {}), overrides or {})
    for key in ("steps", "log_every", "ckpt_every", "keep"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"config key train.{key}: must be a positive integer ({cfg[key]!r})")
    for key in ("seq_len", "batch_size", "grad_accum"):
        if not isinstance(cfg["data"][key], int) or cfg["data"][key] < 1:
            raise ConfigError(f"config key train.data.{key}: must be a positive integer ({cfg['data'][key]!r})")
    chat = cfg["data"]["chat"]
    for key, value, allowed in (("format", cfg["data"]["format"], ("text", "chat")),
                                ("chat.train_on", chat["train_on"], ("all", "last")),
                                ("chat.thinking_effort", chat["thinking_effort"], ("low", "high", "max", None))):
        if value not in allowed:
            raise ConfigError(f"config key train.data.{key}: {value!r} (expected one of {list(allowed)})")
    if cfg["balance"]["method"] not in ("auto", "exact", "hist"):
        raise ConfigError(f"config key train.balance.method: {cfg['balance']['method']!r}")
    if not cfg["run_name"] or "/" in str(cfg["run_name"]):
        raise ConfigError(f"config key train.run_name: must be a plain name ({cfg['run_name']!r})")
    return cfg
