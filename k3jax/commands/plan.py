"""`k3jax plan CONFIG --mesh MESH`: per-device memory on a slice, and whether it fits."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json

from k3jax.commands import add_expert_format, number


def add_trained_flags(p):
    """What a train step trains: LoRA over a frozen base and freeze globs (plan and compile)."""
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train with LoRA adapters of this rank over a frozen base (0: full fine-tuning)")
    p.add_argument("--lora-expert-rank", type=number(int, 1), default=None, help="rank of the routed-expert adapters")
    p.add_argument("--lora-expert-mode", choices=["per_expert", "shared_a"], default="per_expert")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="GLOB",
                   help="LoRA target globs (default: k3jax.lora.DEFAULT_TARGETS)")
    p.add_argument("--lora-optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--freeze", nargs="+", default=(), metavar="GLOB",
                   help="optimizer.freeze globs: frozen params have no gradients or optimizer state")
    p.add_argument("--qat", action="store_true",
                   help="quantization-aware fine-tuning (train config `qat: true`): the forward sees the "
                        "weights as the export stores them")


def add_objective_flags(p):
    """The train config's objective and what it keeps beside the step (plan and compile)."""
    from k3jax.config import OBJECTIVES
    from k3jax.train.config import DEFAULTS
    p.add_argument("--objective", choices=OBJECTIVES, default="sft",
                   help="train: the objective (dpo adds the reference's log-probs; grpo the rollout's "
                        "caches and log-probs, and with --kl-beta and no LoRA a copy of the params; "
                        "`k3jax compile` also compiles grpo's rollout steps, a prompt chunk and a decode token)")
    p.add_argument("--rollout-slots", type=number(int, 1), default=None, metavar="N",
                   help="grpo: sequences the rollout engine holds at once (grpo.rollout_slots; default train's: "
                        f"{DEFAULTS['grpo']['rollout_slots']}, at most the step's completions)")
    p.add_argument("--kl-beta", type=number(float, 0), default=0.0,
                   help="grpo: grpo.kl_beta (> 0 without LoRA keeps the initial params as the reference)")


def add_grad_accum(p):
    p.add_argument("--grad-accum", type=int, default=None, metavar="A",
                   help="train: run the --batch sequences as A microbatches of batch / A (data.grad_accum; "
                        "default: the fewest whose plan fits, printed)")


def add_memory_flags(p):
    """The runtime settings the planner chooses for a train step where they are not given
    (plan and compile)."""
    p.add_argument("--ep-buffer-mib", type=number(float, 0), default=None,
                   help="runtime.ep_buffer_mib ('ep' exchanges run in chunks above it; train default: the "
                        "largest of 1024, 512, 256 that fits, printed)")
    p.add_argument("--optimizer-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="runtime.optimizer_offload: the optimizer state in host memory between updates "
                        "(train default: only where nothing fits without it, printed)")


def given_runtime(args) -> dict:
    """The runtime settings the command line gave (the others are the planner's to choose)."""
    return {k: v for k, v in (("ep_buffer_mib", args.ep_buffer_mib),
                              ("optimizer_offload", args.optimizer_offload)) if v is not None}


def choose(args, text, preset_name: str, opt, total_params: int, also_given: dict | None = None):
    """(model config, plan options, {setting: value} chosen, the preset's runtime settings
    taken): a train step's grad_accum, ep_buffer_mib and optimizer_offload where the command
    line gave none (`plan_choices.choose_settings`), under the runtime settings of the layout `k3jax
    train` runs that microbatch on (`mesh.preset_for`), which can differ from the full
    batch's. `also_given`: runtime keys set elsewhere (a config's train section, overrides),
    which the preset does not override either."""
    from k3jax.mesh import load_preset, preset_for, preset_runtime
    from k3jax.plan_choices import choose_settings
    given = given_runtime(args)
    given_names = set(given) | ({"grad_accum"} if opt.grad_accum is not None else set())
    chosen, micro, opt_chosen = {}, opt.batch, opt
    for _ in range(2):   # the chosen microbatch can change the layout, and so its settings
        layout = preset_for(preset_name, opt.mode, micro, opt.devices)
        from_preset = preset_runtime(layout, {**(also_given or {}), **given})
        cfg = text.with_runtime(**runtime_values(from_preset), **given)
        if opt.mode != "train":
            break
        cfg, o, chosen = choose_settings(cfg, load_preset(preset_name), opt, total_params, given_names)
        opt_chosen = o
        if o.batch and o.grad_accum and o.batch // o.grad_accum == micro:
            break
        micro = o.batch // o.grad_accum if o.batch and o.grad_accum else micro
    return cfg, (opt_chosen if opt.mode == "train" else opt), chosen, from_preset


def setting_text(key: str, value) -> str:
    """A chosen setting as the train key that gives it."""
    if key == "grad_accum":
        return f"data.grad_accum={value}"
    return f"runtime.{key}={str(value).lower() if isinstance(value, bool) else f'{value:g}'}"


def register(sub):
    p = sub.add_parser("plan", help="per-device memory for params, optimizer, activations, caches")
    p.add_argument("config", help="preset name (k3, kimi_linear_48b, toy), YAML preset, config.json or a model "
                                     "directory (checkpoint, training run)")
    p.add_argument("--mesh", required=True, help="mesh preset in configs/meshes/ or a YAML path")
    p.add_argument("--mode", choices=["train", "infer"], default="train")
    p.add_argument("--hbm-gib", type=float, default=None, help="per-device memory (default: the preset's)")
    p.add_argument("--batch", type=int, default=None, help="global sequences (default: one per batch shard)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (the cache length in infer mode)")
    add_grad_accum(p)
    p.add_argument("--remat", choices=["none", "dots", "full"], default="full")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="muon",
                   help="the matrices' optimizer state: muon (what k3jax train runs: one fp32 momentum) "
                        "or adamw (fp32 m and v, for comparison); vectors take AdamW either way")
    p.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    add_expert_format(p, "planned")
    p.add_argument("--devices", type=int, default=None, help="device count, for presets with a -1 axis")
    p.add_argument("--ep-capacity", type=float, default=0.0,
                   help="ep_capacity_factor of the run (0: dropless, buffers sized for the worst case)")
    add_trained_flags(p)
    add_objective_flags(p)
    add_memory_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(fn=run)


@functools.lru_cache(maxsize=4)
def _total_params(config: str) -> int:
    from k3jax.checkpoint.load import load_any_config
    from k3jax.param_count import count_params
    k3 = load_any_config(config)
    return count_params(k3.text, k3.layout)["total"]


def _gib(n) -> str:
    return f"{n / (1 << 30):10.2f} GiB"


def plan_options(args, **given):
    """PlanOptions from the flags `plan` and `compile` share; `given` the rest (mode, devices,
    ...), as each command takes them."""
    from k3jax.plan import PlanOptions
    return PlanOptions(batch=args.batch, grad_accum=args.grad_accum, seq=args.seq, remat=args.remat,
                       optimizer=args.optimizer, param_dtype=args.param_dtype,
                       expert_format=args.expert_format, hbm_gib=args.hbm_gib,
                       ep_capacity_factor=args.ep_capacity, lora_rank=args.lora_rank,
                       lora_expert_rank=args.lora_expert_rank, lora_expert_mode=args.lora_expert_mode,
                       lora_targets=tuple(args.lora_targets) if args.lora_targets else None,
                       lora_optimizer=args.lora_optimizer, freeze=tuple(args.freeze), objective=args.objective,
                       rollout_slots=args.rollout_slots, kl_beta=args.kl_beta, qat=args.qat, **given)


def run(args) -> int:
    from k3jax.checkpoint.load import load_any_config
    from k3jax.mesh import load_preset
    from k3jax.plan import plan
    from k3jax.plan_choices import fit_suggestions

    k3 = load_any_config(args.config)
    opt = plan_options(args, mode=args.mode, devices=args.devices)
    text, opt, chosen, from_preset = choose(args, k3.text, args.mesh, opt, _total_params(args.config))
    if opt.mode == "train" and opt.grad_accum is None:
        opt = dataclasses.replace(opt, grad_accum=1)
    preset = load_preset(args.mesh)
    out = plan(text, preset, opt, _total_params(args.config))
    out["runtime_from_preset"] = from_preset
    out["chosen"] = chosen
    out["would_fit_with"] = ([] if out["fits"] or out["hbm_bytes"] is None
                             else fit_suggestions(text, preset, opt, _total_params(args.config)))
    if args.json:
        print(json.dumps(out))
    else:
        _print_plan(args, out, chosen)
    return 0


def _print_plan(args, out: dict, chosen: dict) -> None:
    """`plan`'s report as lines; `chosen`: the settings the planner picked."""
    from k3jax.mesh import describe_runtime
    from k3jax.plan_choices import CHOICE_MARGIN
    shape = " x ".join(f"{a} {s}" for a, s in out["mesh_shape"].items()) or "1 device"
    print(f"{args.config} on {out['mesh']} ({shape}; {out['devices']} devices), {args.mode}: "
          f"batch {out['batch']} x {out['seq']} tokens, remat {out['remat']}, {out['optimizer']}, "
          f"experts {out['expert_format']}" + (f", LoRA rank {out['lora_rank']}" if out["lora_rank"] else "")
          + (f", objective {out['objective']}" if out["objective"] != "sft" else ""))
    if out["grad_accum"] > 1 or "grad_accum" in chosen:
        print(f"  as {out['grad_accum']} microbatch{'es' if out['grad_accum'] > 1 else ''} of {out['microbatch']} "
              f"(data.batch_size={out['microbatch']}, data.grad_accum={out['grad_accum']}"
              + ("; chosen: the fewest that fit)" if "grad_accum" in chosen else ")"))
    picked = [setting_text(k, v) for k, v in chosen.items() if k != "grad_accum"]
    if picked:
        print(f"  chosen: {', '.join(picked)} (the fastest that fits within {CHOICE_MARGIN:.0%} of HBM; "
              f"a flag sets it)")
    print(f"params {out['params']:,d}; MLA cache {out['mla_cache_values_per_token']:,d} values/token; "
          f"KDA state {out['kda_state_values_per_sequence']:,d} values/sequence")
    for k, v in out["bytes_per_device"].items():
        print(f"  {k:<12}{_gib(v)}")
    for k, v in out["host_bytes_per_device"].items():
        print(f"  {k:<12}{_gib(v)} in host memory (runtime.optimizer_offload)")
    for group, d in out["detail"].items():
        print(f"  {group}: " + ", ".join(f"{k} {v / (1 << 30):.2f}" for k, v in d.items()) + " GiB")
    if "rollout_total" in out["detail"].get("objective", {}):
        o = out["detail"]["objective"]
        print(f"  rollout (between updates: params, optimizer state, reference, caches): "
              f"{o['rollout_total'] / (1 << 30):.2f} GiB; the total is the larger of it and the update's")
    if out["runtime_from_preset"]:
        print(describe_runtime(out["mesh"], out["runtime_from_preset"])
              + " (the preset's settings; a flag or runtime.KEY= in train changes them)")
    if out["hbm_bytes"] is None:
        print("fits: unknown (give --hbm-gib)")
        return
    print(f"fits: {'yes' if out['fits'] else 'NO'} (HBM {_gib(out['hbm_bytes']).strip()} per device)")
    if not out["fits"]:
        print("  would fit with: " + ("; or ".join(out["would_fit_with"]) if out["would_fit_with"] else
                                      "nothing the planner varies (exchange buffer, remat, optimizer, expert "
                                      "LoRA rank, microbatches); more devices (a larger mesh) or fewer tokens a step"))


def runtime_values(settings: dict) -> dict:
    """A preset's runtime settings checked by train's own schema (a typo in a preset is one
    line naming the key), as RuntimeOptions takes them."""
    from k3jax.train.config import resolve
    checked = resolve({"runtime": settings})["runtime"]
    return {k: checked[k] for k in settings}
