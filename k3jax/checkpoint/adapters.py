"""LoRA adapters out of k3jax: a PEFT directory servers load, or folded into the base.

`adapter_tensors` names every adapter after the release's own modules, with PEFT's
`base_model.model.` prefix, `lora_A.weight` [r, in] and `lora_B.weight` [out, r] per
module. Routed experts come out per expert
(`...block_sparse_moe.experts.{e}.w1.lora_A.weight`, ...): the release stores its experts
as separate per-expert linears (`experts.{e}.w{1,2,3}`), so this is what PEFT itself
writes for Moonshot's modules, and the 2-D per-expert MoE LoRA layout vLLM's
`FusedMoEWithLoRA` and SGLang's MoE LoRA read for such checkpoints (their stacked 3-D
layout is for bases whose experts are one fused parameter). A shared A ('shared_a') is
written into every expert's lora_A. The router biases Quantile Balancing kept updating
(unless the run froze the router) travel as PEFT `modules_to_save` of each layer's gate,
with the gate's weight: PEFT >= 0.15 loads such a module whole.

Who loads it: a K3 checkpoint has one transformers implementation, Moonshot's modules, whose
names these are. A `kimi_linear` checkpoint loads as transformers' own KimiLinear (>= 5.17),
which renames and fuses modules: `block_sparse_moe` -> `mlp`, `self_attn.f_{a,b}_proj` ->
`self_attn.forget_gate.*`, per-expert w1/w3 and w2 -> one `experts.gate_up_proj` and one
`experts.down_proj` parameter. PEFT (>= 0.20 with transformers 5.24) converts the LoRA
tensors of the release's names onto those itself (it reads transformers' own checkpoint
conversion), so they keep the names above; what it does not convert is the config's
targeting and the `modules_to_save` tensors, so for that layout the config targets
transformers' modules as well (`target_parameters` for the fused experts, whose rank is per
expert: 2r for gate_up, the w1 and w3 adapters side by side) and the router goes under
transformers' `mlp.gate`.

Scales: each module's alpha/r is folded into its lora_B and the config says
`lora_alpha = r`, so every consumer applies the intended product, whatever it assumes
about per-module ranks (`rank_pattern` / `alpha_pattern` give the experts' own rank).

`merged_weight` folds W + (alpha/r)·A·B for one checkpoint tensor; `RequantError` keeps
the statistics of re-quantizing merged experts to MXFP4 (how far the stored bytes are
from the merged values, relative to the values and to the adapters' own update).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from k3jax.checkpoint.names import hf_prefixes, layer_location
from k3jax.config import ConfigError, LoraSpec, ModelConfig, is_expert_target

PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def module_name(cfg: ModelConfig, layout: str, layer: int, target: str, dense_mlp_name: str = "mlp") -> str:
    """The release's module name of a target inside decoder layer `layer`."""
    pre, _ = hf_prefixes(layout)
    parts = target.split("/")
    if parts[0] == "mlp":
        parts[0] = dense_mlp_name
    return f"{pre}layers.{layer}." + ".".join(parts)


def adapter_tensors(cfg: ModelConfig, spec: LoraSpec, adapters, layout: str = "k3", dense_mlp_name: str = "mlp"):
    """Yield (name, array) of every adapter tensor, layer by layer. `adapters` has `.paths`
    (the leaf paths of params['lora']) and `.get(path, index)`, the leaf at `path` sliced at
    the stacked `index`, as numpy; only one layer's adapters are read at a time."""
    for layer in range(cfg.num_hidden_layers):
        loc, idx = layer_location(cfg, layer)
        for target in sorted(spec.targets):
            path = loc + tuple(target.split("/"))
            if path + ("lora_a",) not in adapters.paths:   # this layer's kind has no such module
                continue
            a = np.asarray(adapters.get(path + ("lora_a",), idx), np.float32)
            b = np.asarray(adapters.get(path + ("lora_b",), idx), np.float32) * spec.scale_of(target)
            name = module_name(cfg, layout, layer, target, dense_mlp_name)
            if not is_expert_target(target):
                yield f"{PEFT_PREFIX}{name}.lora_A.weight", np.ascontiguousarray(a.T)
                yield f"{PEFT_PREFIX}{name}.lora_B.weight", np.ascontiguousarray(b.T)
                continue
            base, w = name.rsplit(".", 1)
            for e in range(b.shape[0]):
                a_e = a if a.ndim == 2 else a[e]
                yield f"{PEFT_PREFIX}{base}.experts.{e}.{w}.lora_A.weight", np.ascontiguousarray(a_e.T)
                yield f"{PEFT_PREFIX}{base}.experts.{e}.{w}.lora_B.weight", np.ascontiguousarray(b[e].T)


ROUTER_BIAS = ("block_sparse_moe", "e_score_correction_bias")
ROUTER_WEIGHT = ("block_sparse_moe", "gate")
# The gate module PEFT wraps (`modules_to_save`), named as the model that loads the adapter
# names it (module docstring): Moonshot's modules for K3, transformers' KimiLinear otherwise.
ROUTER_MODULES = {"k3": "block_sparse_moe.gate", "kimi_linear": "mlp.gate"}
# transformers' KimiLinear: each routed-expert weight's fused parameter, and the modules it
# moved (the release's name -> its own), for the config's targeting
_FUSED_EXPERTS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
_MOVED = {"f_a_proj": "forget_gate", "f_b_proj": "forget_gate"}


def router_tensors(cfg: ModelConfig, trained, gate_weight, layout: str = "k3"):
    """Yield (name, array) of the router each MoE layer ended the run with, in PEFT's
    `modules_to_save` form: the gate module's tensors under their own names (PEFT saves
    `<module>.modules_to_save.<adapter>.x` as `<module>.x` and loads it back onto its copy).
    PEFT >= 0.15 loads such a module whole, so both of its tensors go in: the bias Quantile
    Balancing re-solved (`trained`: a `.paths` / `.get` reader, as in `adapter_tensors`, over
    the run's saved non-adapter params) and the weight, which LoRA keeps frozen:
    `gate_weight(layer)` gives it [experts, hidden] as the base stores it, so the copy PEFT
    puts in is the base's own. Layers whose bias the run did not save (a frozen router) are
    left out: the base's module is then the run's."""
    pre, _ = hf_prefixes(layout)
    for layer in range(cfg.num_hidden_layers):
        loc, idx = layer_location(cfg, layer)
        if loc + ROUTER_BIAS in trained.paths:
            name = f"{PEFT_PREFIX}{pre}layers.{layer}.{ROUTER_MODULES[layout]}"
            yield f"{name}.weight", np.ascontiguousarray(gate_weight(layer))
            yield f"{name}.e_score_correction_bias", np.asarray(trained.get(loc + ROUTER_BIAS, idx), np.float32)


def adapter_config(cfg: ModelConfig, spec: LoraSpec, base_model: str = "",
                   modules_to_save: list[str] | None = None, layout: str = "k3") -> dict:
    """PEFT's adapter_config.json for `spec` (scales folded into lora_B: lora_alpha = r)."""
    leaves = sorted({t.split("/")[-1] for t in spec.targets})
    experts = sorted(t.split("/")[-1] for t in spec.targets if is_expert_target(t))
    er = spec.rank_of("block_sparse_moe/w1")
    moved = _MOVED if layout == "kimi_linear" else {}
    alts = [rf"layers\.\d+\.{_path_regex(t, moved)}" for t in sorted(spec.targets) if not is_expert_target(t)]
    if experts:
        alts.append(rf"layers\.\d+\.block_sparse_moe\.experts\.\d+\.({'|'.join(experts)})")
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
           "r": spec.rank, "lora_alpha": spec.rank, "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
           "init_lora_weights": True, "modules_to_save": modules_to_save or None,
           # a regex over module names (PEFT full-matches a string target_modules)
           "target_modules": rf".*\.({'|'.join(alts)})",
           "k3jax": {"targets": sorted(spec.targets), "module_leaves": leaves, "rank": spec.rank,
                     "alpha": spec.alpha, "expert_rank": er,
                     "expert_mode": spec.expert_mode, "scales_folded_into_lora_B": True}}
    ranks = {}
    if experts and er != spec.rank:
        ranks[rf".*\.block_sparse_moe\.experts\.\d+\.({'|'.join(experts)})"] = er
    if experts and layout == "kimi_linear":
        if ("w1" in experts) != ("w3" in experts):
            # PEFT fuses the two adapters into gate_up_proj's and cannot with one missing
            raise ConfigError(f"LoRA targets {sorted(spec.targets)}: transformers' KimiLinear fuses w1 and w3 "
                              "into one parameter, so its PEFT adapter needs both or neither")
        fused = sorted({_FUSED_EXPERTS[w] for w in experts})
        # PEFT matches a target parameter by the end of its name (no regex)
        out["target_parameters"] = [f"mlp.experts.{p}" for p in fused]
        for p in fused:    # per expert; w1's and w3's adapters side by side in gate_up_proj's
            ranks[rf".*\.mlp\.experts\.{p}"] = 2 * er if p == "gate_up_proj" else er
    if ranks:
        out["rank_pattern"], out["alpha_pattern"] = ranks, dict(ranks)
    return out


def _path_regex(target: str, moved: dict) -> str:
    """A target's module path as a regex over the loader's module names: the dense MLP and the
    MoE block under either name they go by, and a module `moved` under its new parent
    (optionally, so the release's name matches too)."""
    parts = target.split("/")
    head = "(mlp|block_sparse_moe)" if parts[0] in ("mlp", "block_sparse_moe") else re.escape(parts[0])
    tail = [re.escape(p) for p in parts[1:]]
    if tail and parts[-1] in moved:
        tail[-1] = rf"({re.escape(moved[parts[-1]])}\.)?{tail[-1]}"
    return "\\.".join([head] + tail)


def write_adapter(out_dir, cfg: ModelConfig, spec: LoraSpec, adapters, layout: str = "k3",
                  dense_mlp_name: str = "mlp", base_model: str = "", trained=None, gate_weight=None) -> dict:
    """adapter_config.json + adapter_model.safetensors in `out_dir` (written atomically by
    the safetensors writer; the directory must be new). `trained` reads the run's other
    saved params and `gate_weight` gives the base's router weights (`router_tensors`): the
    router goes in as `modules_to_save`, so that base + adapter is the model the run
    trained. Returns {'tensors', 'bytes', 'router_biases'}."""
    from k3jax.checkpoint.safetensors_io import write_safetensors
    tensors = dict(adapter_tensors(cfg, spec, adapters, layout, dense_mlp_name))
    router = dict(router_tensors(cfg, trained, gate_weight, layout)) if trained is not None else {}
    config = adapter_config(cfg, spec, base_model, [ROUTER_MODULES[layout]] if router else None, layout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    tensors.update(router)
    write_safetensors(out / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return {"tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values()),
            "router_biases": sum(n.endswith("_bias") for n in router)}


def delta(spec: LoraSpec, target: str, a: np.ndarray, b: np.ndarray, expert: int | None = None) -> np.ndarray:
    """(alpha/r)·A·B in the tree's [in, out] orientation, float64 (one expert's when given)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if expert is not None:
        a, b = (a if a.ndim == 2 else a[expert]), b[expert]
    return spec.scale_of(target) * (a @ b)


@dataclass
class RequantError:
    """Sums over re-quantized merged experts: |Q(W') - W'|², |W'|² and |ΔW|²."""
    err2: float = 0.0
    merged2: float = 0.0
    delta2: float = 0.0
    tensors: int = 0
    worst: list = field(default_factory=list)   # (relative error, name), the largest few

    def add(self, name: str, merged: np.ndarray, stored: np.ndarray, d: np.ndarray):
        e2 = float(np.sum((stored.astype(np.float64) - merged) ** 2))
        m2 = float(np.sum(merged ** 2))
        self.err2, self.merged2, self.delta2 = self.err2 + e2, self.merged2 + m2, self.delta2 + float(np.sum(d ** 2))
        self.tensors += 1
        self.worst = sorted(self.worst + [(np.sqrt(e2 / max(m2, 1e-300)), name)], reverse=True)[:3]

    @property
    def relative(self) -> float:
        """RMS re-quantization error over all merged experts, relative to their values."""
        return float(np.sqrt(self.err2 / self.merged2)) if self.merged2 else 0.0

    @property
    def of_update(self) -> float:
        """The same error relative to the adapters' update (> 1: MXFP4 cannot hold it)."""
        return float(np.sqrt(self.err2 / self.delta2)) if self.delta2 else 0.0

    def summary(self) -> dict:
        return {"experts_requantized": self.tensors, "relative_error": self.relative,
                "error_over_update": self.of_update,
                "worst": [{"tensor": n, "relative_error": float(r)} for r, n in self.worst]}
