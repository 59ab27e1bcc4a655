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
"""
from __future__ import annotations

import gc
import math
import os
import re
import resource
import time

from k3jax.aot import depth as depth_mod, hlo
from k3jax.aot.programs import Program, serve_programs, train_program, with_cache

MEMORY_TERMS = ("arguments", "outputs", "temporaries", "generated_code", "aliases")
_XLA_NAMES = {"arguments": "argument_size_in_bytes", "outputs": "output_size_in_bytes",
              "temporaries": "temp_size_in_bytes", "generated_code": "generated_code_size_in_bytes",
              "aliases": "alias_size_in_bytes"}
OVERLAP = ("estimated = max(compute, memory) + collective (compute overlaps HBM traffic, collectives "
           "overlap nothing); overlapped = max(compute, memory, collective)")


class DoesNotFit(RuntimeError):
    """XLA refused the program: it needs more device memory than there is."""


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


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
        yield "train", measure(train_program(k3, preset, devices, opt, overrides), log)[0]
        return
    runtime = (overrides or {}).get("runtime")
    pre, ext = serve_programs(k3, preset, devices, opt, runtime, new_tokens=1 if mode == "decode" else None)
    fig, compiled = measure(pre, log)
    yield "prefill_first", fig
    ext = with_cache(ext, compiled)
    del compiled
    gc.collect()
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
        gc.collect()
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
