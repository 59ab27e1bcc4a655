"""One `k3jax compile`: build, lower and compile the programs, read XLA's analyses, set
them beside the planner's figures, and estimate the step time and MFU.

Step-time model (per device; every device runs the same SPMD program):
  compute    = matmul FLOPs (loop-corrected) / peak FLOP/s
  memory     = HBM bytes (loop-corrected, on-chip buffers excluded) / HBM bandwidth
  collective = bytes each chip sends in collectives / one-way ICI bandwidth of all its links
  estimated  = max(compute, memory) + collective: compute overlaps its own HBM traffic (a
               roofline), collectives overlap nothing — a pessimistic bound for XLA's
               asynchronous collectives; `overlapped_s` = max of the three is the optimistic one.
MFU is the CLI's own definition (`k3jax.train.loop.flops_per_token`: 6 × activated params
per token for training, a third of that per token served) over devices × peak × estimate.

`assemble` sets it all out as the one object `k3jax compile --json` prints, `text` as the
lines it prints without.
"""
from __future__ import annotations

import gc
import math
import os
import re
import resource
import time

from k3jax.aot import depth as depth_mod, hlo
from k3jax.aot.programs import (Program, default_batch, device_bytes, prefill_tokens, rollout_programs, serve_programs,
                                train_program, with_cache)

MEMORY_TERMS = ("arguments", "outputs", "temporaries", "generated_code", "aliases")
_XLA_NAMES = {"arguments": "argument_size_in_bytes", "outputs": "output_size_in_bytes",
              "temporaries": "temp_size_in_bytes", "generated_code": "generated_code_size_in_bytes",
              "aliases": "alias_size_in_bytes",
              # what sits in the host's memory (runtime.optimizer_offload): not in `total`
              "host_arguments": "host_argument_size_in_bytes", "host_outputs": "host_output_size_in_bytes",
              "host_temporaries": "host_temp_size_in_bytes", "host_aliases": "host_alias_size_in_bytes"}
OVERLAP = ("estimated = max(compute, memory) + collective (compute overlaps HBM traffic, collectives "
           "overlap nothing); overlapped = max(compute, memory, collective)")


class DoesNotFit(RuntimeError):
    """XLA refused the program: it needs more device memory than there is."""


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def rss_gb() -> float:
    """The resident set now (peak_rss_gb is the high-water mark)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return float("nan")


def release() -> None:
    """Drop what one K3 compile leaves behind before the next: JAX's trace and lowering
    caches and, on glibc, the freed heap malloc keeps (a K3 compile peaks at ~21 GiB on a
    24 GiB host, so a second one beside the first's leftovers is killed)."""
    import ctypes
    import jax
    gc.collect()
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def memory_terms(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, v, 0) or 0) for k, v in _XLA_NAMES.items()}
    # what the executable holds at its peak: inputs and outputs (donated ones once), its
    # temporaries and its code
    out["total"] = out["arguments"] + out["outputs"] - out["aliases"] + out["temporaries"] + out["generated_code"]
    return out


def measure(prog: Program, log=print) -> tuple[dict, object]:
    """Lower and compile one program; (figures, compiled)."""
    t0, c0 = time.perf_counter(), _cpu_s()
    lowered = prog.lower()
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 — XLA's out-of-memory is an ordinary exception
        if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
            raise DoesNotFit(str(e)[:2000]) from None
        raise
    t2 = time.perf_counter()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    text = compiled.as_text()
    if os.environ.get("K3JAX_HLO_DIR"):      # keep the optimised HLO for reading offline
        os.makedirs(os.environ["K3JAX_HLO_DIR"], exist_ok=True)
        path = os.path.join(os.environ["K3JAX_HLO_DIR"], f"{prog.mode}-{prog.cfg.num_hidden_layers}-layers.hlo")
        with open(path, "w") as f:
            f.write(text)
        log(f"  {prog.mode}: optimised HLO in {path}")
    totals = hlo.analyse(text)
    flops, bytes_ = hlo.loop_corrected(float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), totals)
    fig = {"memory": memory_terms(compiled),
           "xla_flops": float(cost.get("flops", 0.0)), "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
           "flops": flops, "bytes_accessed": bytes_, "matmul_flops": totals.flops, "hbm_bytes": totals.hbm_bytes,
           "collectives": dict(totals.collectives), "loops_unread": len(totals.unknown_loops),
           "instructions": dict(totals.instructions),
           "lower_s": t1 - t0, "compile_s": t2 - t1, "cpu_s": _cpu_s() - c0}
    log(f"  {prog.mode}: lowered in {fig['lower_s']:.0f} s, compiled in {fig['compile_s']:.0f} s "
        f"(CPU {fig['cpu_s']:.0f} s), peak RSS {peak_rss_gb():.1f} GiB")
    return fig, compiled


def _programs(k3, preset, devices, opt, mode, overrides, log):
    """Yield (name, figures) for each program of a mode, compiled in order."""
    if mode == "train":
        prog = train_program(k3, preset, devices, opt, overrides)
        yield "train", measure(prog, log)[0]
        if opt.objective == "grpo":
            # beside the rollout stay the optimizer state and (KL without LoRA) the reference copy
            params = prog.args[0].params
            beside = device_bytes(prog.args[0].opt_state) + (
                device_bytes(params) if prog.tc["grpo"]["kl_beta"] > 0 and prog.cfg.runtime.lora is None else 0)
            for ro in rollout_programs(prog):
                release()
                log(f"  resident before {ro.mode}: {rss_gb():.1f} GiB")
                fig = measure(ro, log)[0]
                yield ro.mode, {**fig, "beside_bytes": beside, "tokens": ro.tokens, "batch": ro.batch}
        return
    runtime = (overrides or {}).get("runtime")
    pre, ext = serve_programs(k3, preset, devices, opt, runtime, new_tokens=1 if mode == "decode" else None)
    fig, compiled = measure(pre, log)
    yield "prefill_first", fig
    ext = with_cache(ext, compiled)
    del compiled
    release()
    yield mode, measure(ext, log)[0]


def _flat(fig: dict) -> dict:
    out = {k: v for k, v in fig.items() if isinstance(v, (int, float))}
    out.update({f"memory.{k}": v for k, v in fig["memory"].items()})
    out.update({f"collectives.{k}": v for k, v in fig["collectives"].items()})
    return out


def _unflat(flat: dict, like: dict) -> dict:
    out = {k: flat[k] for k in like if isinstance(like[k], (int, float)) and k in flat}
    out["memory"] = {k: flat[f"memory.{k}"] for k in like["memory"]}
    out["collectives"] = {k: flat.get(f"collectives.{k}", 0.0) for k in like["collectives"]}
    return out


def compile_figures(k3, preset: str, devices, opt, mode: str, overrides=None, depths=None, log=print) -> dict:
    """{program name: figures} at full depth, measured (depths=None) or extrapolated from
    two reduced depths (group counts `depths`), plus what was compiled."""
    import dataclasses
    full = depth_mod.group_count(k3.text)
    if depths is None:
        log(f"compiling {k3.text.num_hidden_layers} layers ({full} repeated layer groups)")
        figs = dict(_programs(k3, preset, devices, opt, mode, overrides, log))
        return {"programs": figs, "layers_compiled": [k3.text.num_hidden_layers], "extrapolated": False}
    runs = {}
    for n in depths:
        cfg = depth_mod.reduced(k3.text, n)
        log(f"compiling {cfg.num_hidden_layers} layers ({n} of {full} repeated layer groups)")
        runs[n] = dict(_programs(dataclasses.replace(k3, text=cfg), preset, devices, opt, mode, overrides, log))
        release()
    (n1, f1), (n2, f2) = runs.items()
    figs = {}
    for name in f1:
        a, b = _flat(f1[name]), _flat(f2[name])
        keys = set(a) | set(b)
        a, b = ({k: a.get(k, 0.0) for k in keys}, {k: b.get(k, 0.0) for k in keys})
        est = depth_mod.extrapolate(n1, a, n2, b, full)
        for k in ("lower_s", "compile_s", "cpu_s", "loops_unread"):
            est[k] = a[k] + b[k]            # what it took, not a prediction
        figs[name] = _unflat(est, {**f2[name], "collectives": {**f1[name]["collectives"], **f2[name]["collectives"]}})
        figs[name]["instructions"] = f2[name]["instructions"]   # the deeper compile's, not extrapolated
    layers = [depth_mod.reduced(k3.text, n).num_hidden_layers for n in depths]
    return {"programs": figs, "layers_compiled": layers, "extrapolated": True}


def _seconds(v, chip) -> float:
    """One instruction's estimated time: the step's model applied to it alone."""
    _, flops, hbm, col = v[:4]
    return max(flops / chip.peak_flops, hbm / chip.hbm_bandwidth) + col / chip.ici_bandwidth


def costliest(instructions: dict, chip, n: int = 5) -> list[dict]:
    """The `n` top-level HLO instructions with the largest estimated time (the step's model
    per instruction: max(FLOPs / peak, HBM bytes / bandwidth) + collective bytes / ICI), and
    their share of the sum: where the next bottleneck is."""
    seconds = lambda v: _seconds(v, chip)  # noqa: E731
    total = sum(seconds(v) for v in instructions.values()) or 1.0
    top = sorted(instructions.items(), key=lambda kv: -seconds(kv[1]))[:n]
    return [{"instruction": name, "opcode": v[0], "share": seconds(v) / total, "flops": v[1], "hbm_bytes": v[2],
             "collective_bytes": v[3]} for name, v in top]


def by_scope(instructions: dict, chip, n: int = 8) -> list[dict]:
    """The instructions summed by where they come from (`hlo.scope`: forward / backward /
    other, and the model's scopes), the `n` largest by estimated time with their share:
    the bottleneck by part of the model when no single instruction stands out."""
    sums: dict = {}
    for v in instructions.values():
        key = v[4] if len(v) > 4 else "-"
        s = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        for j, x in enumerate((_seconds(v, chip), *v[1:4])):
            s[j] += x
    total = sum(s[0] for s in sums.values()) or 1.0
    top = sorted(sums.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"scope": k, "share": s[0] / total, "flops": s[1], "hbm_bytes": s[2], "collective_bytes": s[3]}
            for k, s in top]


def roofline(fig: dict, chip, model_flops: float, devices: int) -> dict:
    compute = fig["flops"] / chip.peak_flops
    memory = fig["hbm_bytes"] / chip.hbm_bandwidth
    collective = sum(fig["collectives"].values()) / chip.ici_bandwidth
    step = max(compute, memory) + collective
    return {"compute_s": compute, "memory_s": memory, "collective_s": collective, "estimated_step_s": step,
            "overlapped_s": max(compute, memory, collective),
            "estimated_mfu": model_flops / (devices * chip.peak_flops * step) if step else 0.0,
            "overlap": OVERLAP, "chip": chip.name, "costliest": costliest(fig.get("instructions", {}), chip),
            "by_scope": by_scope(fig.get("instructions", {}), chip)}


def oom_bytes(message: str) -> int | None:
    """The bytes an out-of-memory compile error says the program needs, when it says."""
    m = re.search(r"Used ([\d.]+)([GMK])(?:iB)? of ([\d.]+)([GMK])", message)
    if not m:
        return None
    scale = {"G": 2**30, "M": 2**20, "K": 2**10}
    return int(float(m.group(1)) * scale[m.group(2)])


def hbm_limit(preset, opt, chip) -> int | None:
    gib = opt.hbm_gib if opt.hbm_gib is not None else preset.hbm_gib or (chip.hbm_gib if chip else None)
    return int(gib * 2**30) if gib else None


def planner_terms(plan: dict, mode: str) -> dict:
    """The planner's figures paired with XLA's terms: what the step takes in (state or
    params and caches) against XLA's arguments, what it makes (gradients, activations)
    against XLA's temporaries."""
    b = plan["bytes_per_device"]
    if mode == "train":
        return {"arguments": b["params"] + b["optimizer"], "temporaries": b["grads"] + b["activations"]}
    return {"arguments": b["params"] + b["caches"], "temporaries": b["activations"]}


def relative(a: float, b: float) -> float | None:
    return (a - b) / b if b else None


def safe(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def model_figures(cfg, mode: str, batch: int, tokens: int) -> dict:
    """Model FLOPs per step (the CLI's MFU numerator: `flops_per_token`, a frozen base's
    weights at 4 per value under LoRA) and the weights a decode step needs."""
    import jax

    from k3jax.config import expert_role
    from k3jax.model import param_shapes
    from k3jax.train.loop import flops_per_token
    from k3jax.train.muon import param_groups
    params = param_shapes(cfg, adapters=True)
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


def refused(head: dict, error: DoesNotFit, hbm: int | None) -> dict:
    """The report of a program XLA would not fit: what it says the program needs."""
    return {**head, "fits": False, "total_per_device_bytes": oom_bytes(str(error)), "hbm_bytes": hbm,
            "error": str(error).splitlines()[0][:500]}


def assemble(head: dict, res: dict, pl: dict, k3, preset, opt, chip, hbm: int | None) -> dict:
    """The report of one compile: `head` (what ran where: config, mesh, topology, devices,
    mode, chip, ...), then `compile_figures`' `res` of the mode's program beside the
    planner's `pl`, the roofline estimate and, decoding, the bytes a token reads."""
    from k3jax.plan import run_config
    mode, devices = head["mode"], head["devices"]
    fig = res["programs"][mode]
    batch = default_batch(preset, opt, devices)
    new = {"train": opt.seq, "decode": 1}.get(mode) or prefill_tokens(preset, opt, batch, devices)
    cfg = run_config(k3.text.with_runtime(dtype=opt.param_dtype), opt)
    model = model_figures(cfg, mode, batch, batch * new)
    est = roofline(fig, chip, model["model_flops_per_step"], devices)
    total = fig["memory"]["total"]
    out = {
        **head,
        "fits": bool(hbm is not None and total <= hbm), "hbm_bytes": hbm,
        "total_per_device_bytes": total, "memory": fig["memory"],
        "plan_total_bytes": pl["bytes_per_device"]["total"],
        "plan_vs_xla": relative(pl["bytes_per_device"]["total"], total),
        "plan": pl["bytes_per_device"], "plan_terms": planner_terms(pl, mode),
        "flops_per_step": fig["flops"], "bytes_accessed_per_step": fig["bytes_accessed"],
        "xla_cost_analysis": {"flops": fig["xla_flops"], "bytes accessed": fig["xla_bytes_accessed"]},
        "matmul_flops_per_step": fig["matmul_flops"], "hbm_bytes_per_step": fig["hbm_bytes"],
        "collective_bytes_per_step": fig["collectives"],
        "compile_s": sum(f["compile_s"] for f in res["programs"].values()),
        "lower_s": sum(f["lower_s"] for f in res["programs"].values()),
        "compile_cpu_s": sum(f["cpu_s"] for f in res["programs"].values()),
        "peak_rss_gib": peak_rss_gb(),
        **est, "model_flops_per_step": model["model_flops_per_step"],
        "layers_compiled": res["layers_compiled"], "extrapolated": res["extrapolated"],
        "batch": batch, "grad_accum": pl["grad_accum"], "microbatch": pl["microbatch"], "seq": opt.seq,
        "new_tokens_per_sequence": new, "loops_unread": fig["loops_unread"],
        "programs": {n: {"compile_s": f["compile_s"], "memory_total": f["memory"]["total"]}
                     for n, f in res["programs"].items()},
    }
    rollout = {n: f for n, f in res["programs"].items() if n.startswith("rollout_")}
    if rollout:
        out["rollout"] = rollout_report(rollout, pl, cfg, chip, devices, hbm)
        out["fits"] = out["fits"] and all(r["fits"] for r in out["rollout"].values() if isinstance(r, dict))
    if mode == "decode":
        out["decode"] = {"hbm_bytes_all_devices": fig["hbm_bytes"] * devices,
                         "per_token": fig["hbm_bytes"] * devices / batch,
                         "active_weight_bytes_per_step": model["active_weight_bytes_per_step"],
                         "all_weight_bytes": model["dense_weight_bytes"] + model["routed_expert_bytes"]}
    return out


def rollout_report(figs: dict, pl: dict, cfg, chip, devices: int, hbm: int | None) -> dict:
    """GRPO's rollout programs beside the update: each one's XLA memory plus what stays
    live beside it (optimizer state, a KL reference copy), against the planner's rollout
    total, and its estimated step (one prompt chunk or one decode token for every slot)."""
    out = {"plan_total_bytes": pl["detail"]["objective"]["rollout_total"]}
    for name, f in figs.items():
        total = f["memory"]["total"] + f["beside_bytes"]
        model = model_figures(cfg, "decode" if name == "rollout_decode" else "prefill", f["batch"], f["tokens"])
        est = roofline(f, chip, model["model_flops_per_step"], devices)
        out[name] = {"memory": f["memory"], "beside_bytes": f["beside_bytes"], "total_per_device_bytes": total,
                     "plan_vs_xla": relative(out["plan_total_bytes"], total),
                     "fits": bool(hbm is not None and total <= hbm), "slots": f["batch"],
                     "tokens_per_step": f["tokens"], "compile_s": f["compile_s"],
                     **{k: est[k] for k in ("compute_s", "memory_s", "collective_s", "estimated_step_s")},
                     "estimated_tokens_per_s": f["tokens"] / est["estimated_step_s"] if est["estimated_step_s"] else 0.0}
    return out


def text(o: dict) -> str:
    """`assemble`'s report as the lines `k3jax compile` prints."""
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
    for name, r in o.get("rollout", {}).items():
        if isinstance(r, dict):
            lines.append(f"{name}: {g(r['total_per_device_bytes']).strip()} per device with the optimizer state "
                         f"beside it (planner {g(o['rollout']['plan_total_bytes']).strip()}, "
                         f"{'+' if r['plan_vs_xla'] >= 0 else ''}{100 * r['plan_vs_xla']:.1f} %), fits "
                         f"{'yes' if r['fits'] else 'NO'}; {r['slots']} slots x {r['tokens_per_step'] // r['slots']} "
                         f"tokens: est. step {1e3 * r['estimated_step_s']:.1f} ms, "
                         f"{r['estimated_tokens_per_s']:,.0f} tokens/s")
    if "decode" in o:
        d = o["decode"]
        lines.append(f"decode: HBM bytes per step over all devices {g(d['hbm_bytes_all_devices']).strip()} "
                     f"({g(d['per_token']).strip()} per token); weights a step needs "
                     f"{g(d['active_weight_bytes_per_step']).strip()} of {g(d['all_weight_bytes']).strip()}")
    return "\n".join(lines)
