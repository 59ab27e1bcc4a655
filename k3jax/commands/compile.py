"""`k3jax compile CONFIG --mesh PRESET --topology TOPO`: the real step compiled ahead of
time for a TPU topology, XLA's memory and cost beside the planner's (k3jax.aot).

Runs in the `[tpu]` environment (libtpu holds the TPU compiler; see README). Exits 1 when
the step does not fit in HBM, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from k3jax.commands.plan import add_grad_accum, add_objective_flags, add_trained_flags
from k3jax.commands import add_expert_format, number


ESTIMATE = """\
estimate (per device; k3jax.aot.report):
  compute    = matmul FLOPs (every loop iteration) / peak FLOP/s
  memory     = HBM bytes (every loop iteration) / HBM bandwidth
  collective = bytes each chip sends in collectives / its ICI bandwidth
  estimated_step_s = max(compute, memory) + collective   (overlapped_s = max of the three)
  estimated_mfu = model FLOPs per step / (devices x peak FLOP/s x estimated_step_s), model
    FLOPs = 6 x activated params per trained token (a frozen base's weights 4 per value under
    LoRA), 2 x activated params per token served
  costliest: the five top-level HLO instructions with the largest share of that estimate
  by_scope: the same summed by where instructions come from (forward / backward / other,
    the model's scopes as their op_name gives them), the eight largest
K3JAX_HLO_DIR=DIR keeps each compiled program's optimised HLO text there, to read offline
(scripts/hlo_collectives.py: its collectives by where they come from)."""


def register(sub):
    p = sub.add_parser("compile", help="compile the train / prefill / decode step for a TPU topology ahead of time",
                       epilog=ESTIMATE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="preset name (k3, kimi_linear_48b, toy), YAML preset or config.json")
    p.add_argument("overrides", nargs="*", help="train: keys as for `k3jax train`, e.g. runtime.kda_impl=pallas")
    p.add_argument("--mesh", required=True, help="mesh preset in configs/meshes/ or a YAML path")
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5p:8x8x8 (512 chips), v5p:4x4x8, v6e:16x16")
    p.add_argument("--mode", choices=["train", "prefill", "decode"], default="train",
                   help="train step; prefill: one chunk of a long prompt on full caches; decode: one token")
    p.add_argument("--hbm-gib", type=float, default=None, help="per-device memory (default: the preset's)")
    p.add_argument("--batch", type=int, default=None, help="global sequences (default: one per batch shard)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (serving: the caches' length)")
    add_grad_accum(p)
    p.add_argument("--remat", choices=["none", "dots", "full"], default="full")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="muon")
    p.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    add_expert_format(p, "planned")
    p.add_argument("--ep-capacity", type=float, default=0.0, help="ep_capacity_factor (0: dropless)")
    p.add_argument("--ep-buffer-mib", type=number(float, 0), default=None,
                   help="RuntimeOptions.ep_buffer_mib ('ep' exchanges run in chunks above it)")
    add_trained_flags(p)
    add_objective_flags(p)
    p.add_argument("--prefill-chunk", type=number(int, 1), default=2048, help="prefill: tokens per device per chunk")
    p.add_argument("--depths", type=number(int, 1), nargs=2, metavar=("N1", "N2"), default=None,
                   help="compile at these scanned-group counts and extrapolate to full depth "
                        "(default: compile full depth)")
    p.add_argument("--peak-tflops", type=number(float, 0, low_open=True), default=None, help="override the chip's bf16 peak")
    p.add_argument("--hbm-gbps", type=number(float, 0, low_open=True), default=None, help="override the chip's HBM bandwidth (GB/s)")
    p.add_argument("--ici-gbps", type=number(float, 0, low_open=True), default=None, help="override the chip's one-way ICI bandwidth (GB/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(fn=run)


def _chip(args):
    import dataclasses

    from k3jax.aot.chips import Chip, chip_for
    chip = chip_for(args.topology)
    if chip is None:
        if None in (args.peak_tflops, args.hbm_gbps, args.ici_gbps):
            from k3jax.aot.chips import CHIPS
            from k3jax.config import ConfigError
            raise ConfigError(f"--topology {args.topology}: no published figures here for chip "
                              f"{args.topology.split(':')[0]!r} (known: {', '.join(CHIPS)}); give --peak-tflops, "
                              f"--hbm-gbps and --ici-gbps for another")
        chip = Chip(args.topology.split(":")[0], 0, 0, 0, 0, "command line")
    over = {k: v for k, v in (("peak_flops", args.peak_tflops and args.peak_tflops * 1e12),
                              ("hbm_bandwidth", args.hbm_gbps and args.hbm_gbps * 1e9),
                              ("ici_bandwidth", args.ici_gbps and args.ici_gbps * 1e9)) if v}
    return dataclasses.replace(chip, **over) if over else chip


def _model_figures(cfg, mode: str, batch: int, tokens: int) -> dict:
    """Model FLOPs per step (the CLI's MFU numerator: `flops_per_token`, a frozen base's
    weights at 4 per value under LoRA) and the weights a decode step needs."""
    import math

    import jax
    from flax import linen as nn

    from k3jax.config import expert_role
    from k3jax.model import abstract_variables
    from k3jax.train.loop import flops_per_token
    from k3jax.train.muon import param_groups
    boxed = abstract_variables(cfg)
    params = jax.tree.map(lambda x: x.value, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    k, E = cfg.num_experts_per_token or 1, cfg.num_experts or 1
    per_token = flops_per_token(params, k / E, param_groups(cfg, params), k)
    if mode != "train":
        per_token = flops_per_token(params, k / E, None, k) / 3   # forward only: 2 per weight value
    dense = expert = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(p, "key", p)) for p in path]
        b = math.prod(x.shape) * x.dtype.itemsize
        if expert_role(keys):
            expert += b
        elif keys[0] != "embed_tokens":
            dense += b
    needed = dense + expert * min(E, batch * k) / E     # each chosen expert read once per step
    return {"model_flops_per_step": per_token * tokens, "dense_weight_bytes": dense,
            "routed_expert_bytes": expert, "active_weight_bytes_per_step": needed}


def run(args) -> int:
    import dataclasses
    import os

    import jax

    from k3jax.aot.chips import host_environment
    host_environment("tpu")   # before any backend starts; jax read JAX_PLATFORMS at import
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

    from k3jax.aot import report
    from k3jax.aot.chips import topology_devices
    from k3jax.config import load_k3
    from k3jax.param_count import count_params
    from k3jax.plan import PlanOptions, choose_grad_accum, plan
    from k3jax.commands.plan import runtime_values
    from k3jax.mesh import describe_runtime, preset_runtime
    from k3jax.sharding import load_preset, preset_for
    from k3jax.train.config import parse_overrides, resolve

    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    k3 = load_k3(args.config)
    devices = topology_devices(args.topology)      # its form and libtpu first: the fix they name
    chip = _chip(args)
    opt = PlanOptions(mode="train" if args.mode == "train" else "infer", batch=args.batch,
                      grad_accum=args.grad_accum, seq=args.seq,
                      remat=args.remat, optimizer=args.optimizer, param_dtype=args.param_dtype,
                      expert_format=args.expert_format, devices=len(devices), hbm_gib=args.hbm_gib,
                      ep_capacity_factor=args.ep_capacity, prefill_chunk=args.prefill_chunk,
                      lora_rank=args.lora_rank, lora_expert_rank=args.lora_expert_rank,
                      lora_expert_mode=args.lora_expert_mode,
                      lora_targets=tuple(args.lora_targets) if args.lora_targets else None,
                      lora_optimizer=args.lora_optimizer, freeze=tuple(args.freeze), objective=args.objective,
                      rollout_slots=args.rollout_slots, kl_beta=args.kl_beta)
    # training runs the layout `k3jax train --mesh` picks (a train or context preset)
    total_params = count_params(k3.text, k3.layout)["total"]
    if args.mode == "train":   # the planner's microbatch count where none is given
        opt = dataclasses.replace(opt, grad_accum=choose_grad_accum(k3.text, load_preset(args.mesh), opt,
                                                                    total_params))
    micro = opt.batch // opt.grad_accum if opt.batch and opt.grad_accum else opt.batch
    preset = (preset_for(args.mesh, "train", micro, len(devices)) if args.mode == "train"
              else load_preset(args.mesh))
    overrides = parse_overrides(args.overrides or [])
    resolve(k3.train, overrides)   # train's own schema: an unknown key or a bad value is one line
    if args.ep_buffer_mib is not None:
        overrides.setdefault("runtime", {})["ep_buffer_mib"] = args.ep_buffer_mib
    # the preset's runtime settings where neither a flag nor an override gives one, as train
    from_preset = preset_runtime(preset, {**(k3.train or {}).get("runtime", {}), **overrides.get("runtime", {})})
    if from_preset:
        overrides.setdefault("runtime", {}).update(runtime_values(from_preset))
        log(describe_runtime(preset.name, from_preset))
    if "ep_buffer_mib" in overrides.get("runtime", {}):
        k3 = dataclasses.replace(k3, text=k3.text.with_runtime(ep_buffer_mib=overrides["runtime"]["ep_buffer_mib"]))
    # before the compile: the planner's checks (the batch's placement on the mesh) fail fast
    pl = plan(k3.text, preset, opt, total_params)
    log(f"{args.config} {args.mode} on {preset.name} over {args.topology} ({len(devices)} {chip.name} chips)"
        + (f", {opt.grad_accum} microbatches of {pl['microbatch']}" + (" (the planner's choice)"
           if args.grad_accum is None else "") if opt.mode == "train" and opt.grad_accum > 1 else ""))
    out = {"config": args.config, "mesh": preset.name, "topology": args.topology, "devices": len(devices),
           "mode": args.mode, "chip": chip.name, "runtime_from_preset": from_preset}
    hbm = report.hbm_limit(preset, opt, chip)
    try:
        res = report.compile_figures(k3, args.mesh, devices, opt, args.mode, overrides, args.depths, log)
    except report.DoesNotFit as e:
        need = report.oom_bytes(str(e))
        out.update(fits=False, total_per_device_bytes=need, hbm_bytes=hbm, error=str(e).splitlines()[0][:500])
        print(json.dumps(out) if args.json else f"fits: NO — XLA: {out['error']}")
        return 1

    from k3jax.aot.programs import default_batch, prefill_tokens
    fig = res["programs"][args.mode]
    batch = default_batch(preset, opt, len(devices))
    new = {"train": args.seq, "decode": 1}.get(args.mode) or prefill_tokens(preset, opt, batch, len(devices))
    from k3jax.plan import run_config
    cfg = run_config(k3.text.with_runtime(dtype=args.param_dtype), opt)
    model = _model_figures(cfg, args.mode, batch, batch * new)
    est = report.roofline(fig, chip, model["model_flops_per_step"], len(devices))
    total = fig["memory"]["total"]
    out.update({
        "fits": bool(hbm is not None and total <= hbm), "hbm_bytes": hbm,
        "total_per_device_bytes": total, "memory": fig["memory"],
        "plan_total_bytes": pl["bytes_per_device"]["total"],
        "plan_vs_xla": report.relative(pl["bytes_per_device"]["total"], total),
        "plan": pl["bytes_per_device"], "plan_terms": report.planner_terms(pl, args.mode),
        "flops_per_step": fig["flops"], "bytes_accessed_per_step": fig["bytes_accessed"],
        "xla_cost_analysis": {"flops": fig["xla_flops"], "bytes accessed": fig["xla_bytes_accessed"]},
        "matmul_flops_per_step": fig["matmul_flops"], "hbm_bytes_per_step": fig["hbm_bytes"],
        "collective_bytes_per_step": fig["collectives"],
        "compile_s": sum(f["compile_s"] for f in res["programs"].values()),
        "lower_s": sum(f["lower_s"] for f in res["programs"].values()),
        "compile_cpu_s": sum(f["cpu_s"] for f in res["programs"].values()),
        "peak_rss_gib": report.peak_rss_gb(),
        **est, "model_flops_per_step": model["model_flops_per_step"],
        "layers_compiled": res["layers_compiled"], "extrapolated": res["extrapolated"],
        "batch": batch, "grad_accum": pl["grad_accum"], "microbatch": pl["microbatch"], "seq": args.seq, "new_tokens_per_sequence": new, "loops_unread": fig["loops_unread"],
        "programs": {n: {"compile_s": f["compile_s"], "memory_total": f["memory"]["total"]}
                     for n, f in res["programs"].items()},
    })
    if args.mode == "decode":
        out["decode"] = {"hbm_bytes_all_devices": fig["hbm_bytes"] * len(devices),
                         "per_token": fig["hbm_bytes"] * len(devices) / batch,
                         "active_weight_bytes_per_step": model["active_weight_bytes_per_step"],
                         "all_weight_bytes": model["dense_weight_bytes"] + model["routed_expert_bytes"]}
    print(json.dumps(out, default=report.safe) if args.json else _text(out))
    return 0 if out["fits"] else 1


def _text(o: dict) -> str:
    g = lambda n: f"{n / 2**30:9.2f} GiB" if n is not None else "        ?"  # noqa: E731
    accum = f" ({o['grad_accum']} microbatches of {o['microbatch']})" if o.get("grad_accum", 1) > 1 else ""
    lines = [f"{o['config']} {o['mode']} on {o['mesh']} ({o['devices']} x {o['chip']}), batch {o['batch']}{accum} x "
             f"{o['new_tokens_per_sequence']} new tokens (seq {o['seq']}); layers compiled "
             f"{o['layers_compiled']}{' (extrapolated to full depth)' if o['extrapolated'] else ''}",
             "XLA memory per device:"]
    lines += [f"  {k:<15}{g(v)}" for k, v in o["memory"].items()]
    diff = o["plan_vs_xla"]
    lines.append(f"planner total    {g(o['plan_total_bytes'])}  ({'+' if diff >= 0 else ''}{100 * diff:.1f} % vs XLA)")
    lines += [f"  planner {k:<9}{g(v)}  vs XLA {g(o['memory'][k])}" for k, v in o["plan_terms"].items()]
    lines.append(f"HBM {g(o['hbm_bytes']).strip()}: fits {'yes' if o['fits'] else 'NO'}")
    xa = o["xla_cost_analysis"]
    lines.append(f"FLOPs per step per device {o['flops_per_step']:.4g} (XLA's cost analysis, loop bodies once: "
                 f"{xa['flops']:.4g}); bytes accessed {o['bytes_accessed_per_step']:.4g} ({xa['bytes accessed']:.4g}); "
                 f"HBM traffic {o['hbm_bytes_per_step']:.4g}")
    lines.append("collective bytes sent per device: " + ", ".join(f"{k} {v / 2**20:.1f} MiB"
                                                                    for k, v in o["collective_bytes_per_step"].items()))
    lines.append(f"compile {o['compile_s']:.0f} s (lowering {o['lower_s']:.0f} s, CPU {o['compile_cpu_s']:.0f} s), "
                 f"peak RSS {o['peak_rss_gib']:.1f} GiB")
    lines.append(f"estimate on {o['chip']}: compute {1e3 * o['compute_s']:.1f} ms, memory {1e3 * o['memory_s']:.1f} ms, "
                 f"collectives {1e3 * o['collective_s']:.1f} ms -> step {1e3 * o['estimated_step_s']:.1f} ms "
                 f"(overlapped {1e3 * o['overlapped_s']:.1f} ms), MFU {100 * o['estimated_mfu']:.1f} %")
    lines.append(f"  ({o['overlap']})")
    lines += [f"  {100 * c['share']:5.1f} %  {c['opcode']:<18} {c['instruction']}" for c in o["costliest"]]
    lines.append("  by part of the model:")
    lines += [f"  {100 * c['share']:5.1f} %  {c['scope']}" for c in o["by_scope"]]
    if "decode" in o:
        d = o["decode"]
        lines.append(f"decode: HBM bytes per step over all devices {g(d['hbm_bytes_all_devices']).strip()} "
                     f"({g(d['per_token']).strip()} per token); weights a step needs "
                     f"{g(d['active_weight_bytes_per_step']).strip()} of {g(d['all_weight_bytes']).strip()}")
    return "\n".join(lines)
