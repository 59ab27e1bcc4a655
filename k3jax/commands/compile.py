"""`k3jax compile CONFIG --mesh PRESET --topology TOPO`: the real step compiled ahead of
time for a TPU topology, XLA's memory and cost beside the planner's (k3jax.aot).

Runs in the `[tpu]` environment (libtpu holds the TPU compiler; see README). Exits 1 when
the step does not fit in HBM, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from k3jax.commands.plan import (add_grad_accum, add_memory_flags, add_objective_flags, add_trained_flags, choose,
                                 plan_options, runtime_values, setting_text)
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
    add_memory_flags(p)
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


def _options(args, k3, devices: int, log):
    """The plan options, mesh preset and train overrides of the step: the settings the
    command line leaves open chosen as `k3jax plan` chooses them (microbatches, exchange
    buffer, optimizer offload), the layout `k3jax train --mesh` picks for the microbatch
    (a train or context preset), the preset's runtime settings where nothing else gives
    one. (options, preset, total params, k3 with that runtime, overrides, {'runtime_from_preset':
    the preset's settings taken, 'chosen': the planner's choices})"""
    import dataclasses

    from k3jax.mesh import describe_runtime, load_preset, preset_for
    from k3jax.param_count import count_params
    from k3jax.train.config import parse_overrides, resolve
    overrides = parse_overrides(args.overrides or [])
    resolve(k3.train, overrides)   # train's own schema: an unknown key or a bad value is one line
    if overrides.get("qat") is True:     # `qat=true` as train takes it: the planner counts it too
        args.qat = True
    opt = plan_options(args, mode="train" if args.mode == "train" else "infer", devices=devices,
                       prefill_chunk=args.prefill_chunk)
    total_params = count_params(k3.text, k3.layout)["total"]
    # settings the config's train section or an override gives count as given
    from_train = {**(k3.train or {}).get("runtime", {}), **overrides.get("runtime", {})}
    for key in ("ep_buffer_mib", "optimizer_offload"):
        if getattr(args, key) is None and key in from_train:
            setattr(args, key, from_train[key])
    text, opt, chosen, from_preset = choose(args, k3.text, args.mesh, opt, total_params, from_train)
    if args.mode == "train" and opt.grad_accum is None:
        opt = dataclasses.replace(opt, grad_accum=1)
    runtime = overrides.setdefault("runtime", {})
    runtime.update(runtime_values(from_preset))
    runtime.update({k: getattr(text.runtime, k) for k in ("ep_buffer_mib", "optimizer_offload")
                    if args.mode == "train" or getattr(args, k) is not None})
    if chosen:
        log("the planner chose: " + ", ".join(setting_text(k, v) for k, v in chosen.items()))
    k3 = dataclasses.replace(k3, text=k3.text.with_runtime(ep_buffer_mib=text.runtime.ep_buffer_mib,
                                                           optimizer_offload=text.runtime.optimizer_offload))
    micro = opt.batch // opt.grad_accum if opt.batch and opt.grad_accum else opt.batch
    preset = (preset_for(args.mesh, "train", micro, devices) if args.mode == "train"
              else load_preset(args.mesh))
    if from_preset:
        log(describe_runtime(preset.name, from_preset))
    return opt, preset, total_params, k3, overrides, {"runtime_from_preset": from_preset, "chosen": chosen}


def run(args) -> int:
    import os

    import jax

    from k3jax.aot.chips import host_environment
    host_environment("tpu")   # before any backend starts; jax read JAX_PLATFORMS at import
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

    from k3jax.aot import report
    from k3jax.aot.chips import topology_devices
    from k3jax.config import load_k3
    from k3jax.plan import plan

    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    k3 = load_k3(args.config)
    devices = topology_devices(args.topology)      # its form and libtpu first: the fix they name
    chip = _chip(args)
    opt, preset, total_params, k3, overrides, taken = _options(args, k3, len(devices), log)
    # before the compile: the planner's checks (the batch's placement on the mesh) fail fast
    pl = plan(k3.text, preset, opt, total_params)
    log(f"{args.config} {args.mode} on {preset.name} over {args.topology} ({len(devices)} {chip.name} chips)"
        + (f", {opt.grad_accum} microbatches of {pl['microbatch']}" if opt.mode == "train" and opt.grad_accum > 1
           else ""))
    head = {"config": args.config, "mesh": preset.name, "topology": args.topology, "devices": len(devices),
            "mode": args.mode, "chip": chip.name, **taken}
    hbm = report.hbm_limit(preset, opt, chip)
    try:
        res = report.compile_figures(k3, args.mesh, devices, opt, args.mode, overrides, args.depths, log)
    except report.DoesNotFit as e:
        out = report.refused(head, e, hbm)
        print(json.dumps(out) if args.json else f"fits: NO — XLA: {out['error']}")
        return 1
    out = report.assemble(head, res, pl, k3, preset, opt, chip, hbm)
    print(json.dumps(out, default=report.safe) if args.json else report.text(out))
    return 0 if out["fits"] else 1
