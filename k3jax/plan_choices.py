"""The settings a train step should take where the user gave none, and the settings that would
make a plan that does not fit fit: searches over `k3jax.plan.plan`."""
from __future__ import annotations

import dataclasses

from k3jax.config import ConfigError, ModelConfig
from k3jax.mesh import MeshPreset
from k3jax.plan import GIB, PlanOptions, grad_accum_choices, places, plan

# Choosing settings, the planner keeps 10 % of HBM in hand: it is within 6 % of XLA on the
# full-K3 train steps it was checked against (docs/performance.md), under by up to 5 %
CHOICE_MARGIN = 0.9
EP_BUFFER_CHOICES = (512.0, 256.0)


def choose_settings(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, total_params: int,
                    given: set[str] = frozenset()) -> tuple[ModelConfig, PlanOptions, dict]:
    """For a train step, the settings the user did not give (`given`: 'grad_accum',
    'ep_buffer_mib', 'optimizer_offload') that fit within CHOICE_MARGIN of HBM and should run
    fastest: the fewest microbatches (each pays the ZeRO-3 gathers and the exchanges'
    latency again), then at that count the largest exchange buffer (smaller ones split the
    exchange into chunks that write and read their buffers again), then the optimizer state
    on the device before in host memory (two PCIe crossings a step); where none fits within
    the margin, the first that fits at all. (cfg, opt, {setting: value chosen}); unchanged
    where nothing fits, HBM is unknown, or the mode is infer."""
    hbm = opt.hbm_gib if opt.hbm_gib is not None else preset.hbm_gib
    if opt.mode != "train" or not hbm:
        return cfg, opt, {}
    rt = cfg.runtime
    accums = [opt.grad_accum] if "grad_accum" in given or not opt.batch else grad_accum_choices(opt.batch)
    eps = [rt.ep_buffer_mib] + ([] if "ep_buffer_mib" in given else
                                [m for m in EP_BUFFER_CHOICES if m < rt.ep_buffer_mib])
    offloads = [rt.optimizer_offload] if "optimizer_offload" in given else [False, True]
    for margin in (CHOICE_MARGIN, 1.0):   # without the margin only where nothing fits with it
        for a in accums:
            o = dataclasses.replace(opt, grad_accum=a or 1)
            if o.batch and not places(preset, o, o.batch // o.grad_accum):
                continue
            for off in offloads:
                for ep in eps:
                    c = cfg.with_runtime(ep_buffer_mib=ep, optimizer_offload=off)
                    try:
                        total = plan(c, preset, o, total_params)["bytes_per_device"]["total"]
                    except ConfigError:
                        continue
                    if total <= margin * hbm * GIB:
                        chosen = {k: v for k, v in (("grad_accum", o.grad_accum), ("ep_buffer_mib", ep),
                                                    ("optimizer_offload", off)) if k not in given}
                        return c, o, chosen
    return cfg, opt, {}


def fit_suggestions(cfg: ModelConfig, preset: MeshPreset, opt: PlanOptions, total_params: int) -> list[str]:
    """For a plan that does not fit: each single setting that would make it fit, as the plan
    flag and the train key that give it (the largest exchange buffer that fits, the cheapest
    change first). Empty when none does: the mesh is too small for this run."""
    tries = []
    for mib in (512, 256, 128, 64):
        if mib < cfg.runtime.ep_buffer_mib:
            tries.append((f"--ep-buffer-mib {mib} (train: runtime.ep_buffer_mib={mib})",
                          cfg.with_runtime(ep_buffer_mib=float(mib)), opt))
    if opt.mode == "train":
        if not cfg.runtime.optimizer_offload:
            tries.append(("--optimizer-offload (train: runtime.optimizer_offload=true)",
                          cfg.with_runtime(optimizer_offload=True), opt))
        if opt.remat != "full":
            tries.append(("--remat full (train: runtime.remat=full)", cfg, dataclasses.replace(opt, remat="full")))
        if opt.optimizer == "adamw" and not opt.lora_rank:
            tries.append(("--optimizer muon (one fp32 state per matrix instead of two)", cfg,
                          dataclasses.replace(opt, optimizer="muon")))
        if opt.lora_rank:
            rank = opt.lora_expert_rank or opt.lora_rank
            for r in (8, 4):
                if r < rank:
                    tries.append((f"--lora-expert-rank {r} (train: lora.expert_rank={r})", cfg,
                                  dataclasses.replace(opt, lora_expert_rank=r)))
        accum = opt.grad_accum or 1
        for a in grad_accum_choices(opt.batch or 0):
            if a > accum and places(preset, opt, opt.batch // a):
                tries.append((f"--grad-accum {a} (train: data.batch_size={opt.batch // a}, data.grad_accum={a})",
                              cfg, dataclasses.replace(opt, grad_accum=a)))

    def fits(c, o) -> bool:
        try:
            return plan(c, preset, o, total_params)["fits"]
        except ConfigError:    # a microbatch the mesh cannot place
            return False
    found, kinds = [], set()
    for flag, c, o in tries:
        kind = flag.split()[0]
        if kind not in kinds and fits(c, o):
            found.append(flag)
            kinds.add(kind)
    if found or not tries:
        return found
    # no one setting does: every kind's last (smallest) try together, if that fits
    last = {flag.split()[0]: (flag, c, o) for flag, c, o in tries}
    c, o = cfg, opt
    def changed(new, old):
        return {f.name: getattr(new, f.name) for f in dataclasses.fields(new)
                if getattr(new, f.name) != getattr(old, f.name)}
    for flag, ci, oi in last.values():
        c = c.with_runtime(**changed(ci.runtime, cfg.runtime))
        o = dataclasses.replace(o, **changed(oi, opt))
    if fits(c, o):
        return [" with ".join(flag for flag, _, _ in last.values())]
    return []
