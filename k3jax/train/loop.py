"""The run: config → run dir → params → (resume) → steps with logging and checkpoints → sample.

Run directory `{output_dir}/{run_name}`, a local path or a URL such as gs://bucket/runs
(rundir.py): `config.yaml` (resolved model + train config), `checkpoints/` (Orbax, async,
`keep` newest), `metrics.jsonl` (one object per logged step).

Failure handling: SIGTERM (preemption) finishes the current step, saves, and returns 0; a
non-finite loss or gradient norm stops *before* that update is checkpointed, so the newest
checkpoint is the last good state (return code 3). `kill -9` loses at most the steps since
the last checkpoint: a rerun resumes from it and, since batches depend only on (seed, step)
and the step is deterministic, logs the same losses; metrics.jsonl lines past the resumed
step are dropped first so the file reads as one run.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from k3jax.config import CONFIG_DIR, load_k3
from k3jax.train import config as tconf, rundir
from k3jax.train.data import PackedDataset, read_documents


def measured_peak_flops(n: int = 1024, repeats: int = 3) -> float:
    """This machine's dense fp32 matmul FLOP/s (the MFU denominator when none is configured)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        f(a).block_until_ready()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t)


def flops_per_token(params, k_over_e: float) -> float:
    """6·(activated params) per token for forward+backward: every weight except the
    embedding lookup, routed experts at k/E. Attention-score FLOPs are left out, so MFU here
    is a slight under-estimate."""
    total = 0.0
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", k)) for k in p]
        if keys[0] == "embed_tokens":
            continue
        total += x.size * (k_over_e if keys[-1] in ("w1", "w2", "w3") else 1.0)
    return 6.0 * total


class _Progress:
    """A one-line progress bar on stderr for process 0 when it is a terminal."""
    def __init__(self, total: int):
        self.total, self.on = total, jax.process_index() == 0 and sys.stderr.isatty()

    def update(self, step: int, loss: float):
        if self.on:
            done = int(30 * step / self.total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{self.total} loss {loss:.4f}")
            sys.stderr.flush()

    def close(self):
        if self.on:
            sys.stderr.write("\n")


def _initial_params(cfg, tc, key, mesh=None):
    """Params from `init_from` or a fresh init; with a mesh they are born sharded (restored
    shard by shard, or initialised under jit with out-shardings), never whole on one host."""
    shardings = None
    if mesh is not None:
        from k3jax import sharding
        shardings = lambda c: sharding.param_shardings(c, *mesh)  # noqa: E731
    if tc["init_from"]:
        from k3jax.checkpoint.load import load_model_dir   # another module's loader; lazy
        k3, params = load_model_dir(tc["init_from"], runtime=tc["runtime"], shardings=shardings)
        if k3.text.replace(runtime=cfg.runtime) != cfg:
            raise ValueError(f"init_from {tc['init_from']}: its model config differs from the run's config")
        return params
    if mesh is not None:
        return sharding.init_params_sharded(cfg, key, *mesh)
    from k3jax.model import init_params
    return init_params(cfg, key)


def optimizer_shardings(tx, abstract_params):
    """The optimizer state's shardings: those XLA derives from the params' through the
    optimizer's own reshapes (Muon's block views), read off a compiled update, so no
    per-optimizer table has to be kept in step with the optimizer. `abstract_params`:
    ShapeDtypeStructs carrying the params' shardings."""
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731  (init_state's rule)
    return jax.jit(lambda p: tx.update(f32(p), tx.init(f32(p)), p)[1]).lower(abstract_params).compile().output_shardings


def sharded_train_step(mesh, abstract_params, tx, train_step, batch_sharding, opt_shardings=None):
    """(TrainState of shardings, the step jitted with that state's shardings pinned in and out).

    Pinned so the step compiles once: left to propagation, the first call sees the state as
    created and later calls see what the step returned, which differ (the optimizer state
    would even start replicated: its zeros carry no sharding of their own). `k3jax compile`
    lowers this same function for TPU topologies and GPU meshes."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.train.step import TrainState
    replicated = NamedSharding(mesh[0], P())
    param_sh = jax.tree.map(lambda x: x.sharding, abstract_params)
    opt_sh = optimizer_shardings(tx, abstract_params) if opt_shardings is None else opt_shardings
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh)

    def sharded_train_step(state, batch):
        return train_step(state, batch)
    step = jax.jit(sharded_train_step, in_shardings=(state_sh, batch_sharding),
                   out_shardings=(state_sh, replicated), donate_argnums=(0,))
    return state_sh, step


def _sharded_state_and_step(mesh, params, tx, train_step, batch_sharding):
    """(TrainState born sharded, the step jitted with its shardings: `sharded_train_step`)."""
    from k3jax.train.step import TrainState
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731  (init_state's rule)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    state_sh, step = sharded_train_step(mesh, abstract, tx, train_step, batch_sharding)
    state = jax.jit(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(f32(p))),
                    out_shardings=state_sh)(params)
    return state, step


def accum_batch_sharding(mesh):
    """Sharding of the step's [grad_accum, batch, length] inputs under (mesh, rules)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax import sharding
    return NamedSharding(mesh[0], P(None, *sharding.batch_sharding(*mesh).spec))


def run_model_config(k3, tc: dict, mesh=None):
    """The model config a run trains: the train config's runtime options, and 'ep' expert
    dispatch when the mesh has an expert axis (experts live on it)."""
    cfg = k3.text.with_runtime(**tc["runtime"])
    if mesh is not None and dict(mesh[0].shape).get("expert", 1) > 1:
        cfg = cfg.with_runtime(moe_dispatch="ep")
    return cfg


def _barrier(name: str):
    """Every process waits here at the coordinator (no device collective). A process's first
    collective over a new group of devices gives its peers only 30 s to join on CPU (gloo),
    less than the skew that compiling the step or initialising can leave between processes."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed   # jax has no public barrier on the coordinator's client
    distributed.global_state.client.wait_at_barrier(f"k3jax_{name}", 60 * 60 * 1000)


def _data_path(path: str) -> str:
    """Relative dataset paths resolve against the working directory, then the repo root
    (so `k3jax train configs/toy.yaml` finds the shipped corpus from anywhere); URLs as given."""
    if rundir.is_url(path) or os.path.isabs(path) or os.path.exists(path):
        return path
    in_repo = os.path.join(os.path.dirname(CONFIG_DIR), path)
    return in_repo if os.path.exists(in_repo) else path


def run(config_path: str, overrides: list[str] | None = None, log=print, mesh: str | None = None) -> int:
    """Train from a YAML preset. `mesh`: a preset of configs/meshes (or a YAML path): params,
    optimizer state and batches are sharded over it and 'ep' expert dispatch is used where
    its expert axis is > 1; without one, everything runs on the default device."""
    if mesh is None:
        return _run(config_path, overrides, log, None)
    from k3jax import sharding
    m, rules = sharding.load_mesh(mesh)
    with sharding.use_mesh(m, rules):
        return _run(config_path, overrides, log, (m, rules))


def _run(config_path: str, overrides, log, mesh) -> int:
    import orbax.checkpoint as ocp

    from k3jax.tokenizer import tokenizer_for
    from k3jax.train import muon, step as tstep

    k3 = load_k3(config_path)
    tc = tconf.resolve(k3.train, tconf.parse_overrides(overrides or []))
    main = jax.process_index() == 0       # multi-host: one process logs and writes run files
    log = log if main else (lambda *_: None)
    cfg = run_model_config(k3, tc, mesh)
    run_dir = rundir.run_dir(tc["output_dir"], tc["run_name"])
    rundir.make_dirs(run_dir)
    if main:
        rundir.write_text(f"{run_dir}/config.yaml", yaml.safe_dump({**k3.to_hf(), "train": tc}, sort_keys=False))

    d = tc["data"]
    tok = tokenizer_for(cfg, d["tokenizer"], d["bpe_file"], d["pattern"])
    ds = PackedDataset(read_documents(_data_path(d["path"]), d["text_key"]), tok, d["seq_len"], cfg.pad_token_id)
    log(f"data: {ds.n_tokens:,d} tokens in {ds.n_rows} packed rows of {d['seq_len']}; "
        f"{d['batch_size']}x{d['grad_accum']} rows per step")

    t0 = time.perf_counter()
    params = _initial_params(cfg, tc, jax.random.PRNGKey(tc["seed"]), mesh)
    tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], tc["steps"])
    train_step = tstep.make_train_step(cfg, tc, tx, groups)
    if mesh is None:
        state = tstep.init_state(params, tx)
        place_batch = lambda b: b  # noqa: E731
    else:
        rows = accum_batch_sharding(mesh)  # [accum, B, T]
        # every process computes the same global batch from (seed, step) and hands over
        # only the slices its own devices hold
        place_batch = lambda b: {k: jax.make_array_from_callback(v.shape, rows, lambda i, v=v: v[i])  # noqa: E731
                                 for k, v in b.items()}
        state, train_step = _sharded_state_and_step(mesh, params, tx, train_step, rows)
        del params
        log(f"mesh {dict(mesh[0].shape)} over {jax.process_count()} process(es); "
            f"moe dispatch {cfg.runtime.moe_dispatch}")

    _barrier("initialised")   # Orbax's first directory sync is a device collective
    opts = ocp.CheckpointManagerOptions(max_to_keep=tc["keep"], enable_async_checkpointing=tc["async_checkpoint"])
    mgr = ocp.CheckpointManager(f"{run_dir}/checkpoints", options=opts)
    latest = mgr.latest_step()
    if latest is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = mgr.restore(latest, args=ocp.args.StandardRestore(abstract))
        log(f"resumed from step {latest} ({run_dir}/checkpoints)")
    start = int(state.step)
    if start >= tc["steps"]:
        log(f"{run_dir} already holds step {start} >= steps={tc['steps']}: nothing to do "
            f"(pass a new run_name= or a larger steps=)")
    log(f"init {time.perf_counter() - t0:.1f} s; training steps {start}..{tc['steps']} in {run_dir}")
    precompiled = mesh is not None and start < tc["steps"]
    if precompiled:
        # compiled ahead of the loop: with the shardings pinned this is the one compile, and a
        # batch or state that did not match it would be an error rather than a recompile
        t = time.perf_counter()
        batch0 = ds.batch(tc["seed"], start, d["batch_size"], d["grad_accum"])
        train_step = train_step.lower(state, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows)
                                              for k, v in batch0.items()}).compile()
        log(f"compiled the train step in {time.perf_counter() - t:.1f} s")
        _barrier("compiled")

    stop = {"sigterm": False}
    prev = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))
    tokens_per_step = d["batch_size"] * d["grad_accum"] * d["seq_len"]
    fpt = flops_per_token(state.params, (cfg.num_experts_per_token or 1) / (cfg.num_experts or 1))
    peak = float(tc["peak_tflops"]) * 1e12 if tc["peak_tflops"] else measured_peak_flops()
    bar = _Progress(tc["steps"])
    rc, last_loss, t_log, steps_since = 0, None, time.perf_counter(), 0
    first_loss = None
    try:
        with rundir.MetricsLog(f"{run_dir}/metrics.jsonl", keep_through=start, enabled=main) as mf:
            for s in range(start, tc["steps"]):
                batch = place_batch(ds.batch(tc["seed"], s, d["batch_size"], d["grad_accum"]))
                state, m = train_step(state, batch)
                loss, gnorm = float(m["loss"]), float(m["grad_norm"])
                steps_since += 1
                step = s + 1
                if not (math.isfinite(loss) and math.isfinite(gnorm)):
                    log(f"step {step}: non-finite loss {loss} / grad norm {gnorm}; stopping. "
                        f"Last good checkpoint: step {mgr.latest_step()}")
                    mf.write({"step": step, "loss": None, "nonfinite": True})
                    rc = 3
                    break
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                bar.update(step, loss)
                if step % tc["log_every"] == 0 or step == tc["steps"] or step == start + 1:
                    dt = time.perf_counter() - t_log
                    tps = tokens_per_step * steps_since / dt
                    rec = {"step": step, "loss": loss, "grad_norm": gnorm, "tokens_per_s": tps,
                           "tflops_per_device": tps * fpt / jax.device_count() / 1e12,
                           "mfu": tps * fpt / jax.device_count() / peak}
                    if "load_max" in m:
                        rec["load_max"], rec["load_min"] = float(m["load_max"]), float(m["load_min"])
                        rec["load_per_layer"] = {p: np.asarray(v).round(3).tolist() for p, v in m["load"].items()}
                    if "ep_dropped" in m:
                        rec["ep_dropped"] = float(m["ep_dropped"])
                    mf.write(rec)
                    bal = (f" | experts max/min load {rec['load_max']:.2f}/{rec['load_min']:.2f}"
                           if "load_max" in rec else "")
                    bal += f" | ep dropped {100 * rec['ep_dropped']:.2f}%" if "ep_dropped" in rec else ""
                    bar.close() if bar.on else None
                    note = " (includes compile)" if step == start + 1 and not precompiled else ""
                    log(f"step {step:5d} | loss {loss:.4f} | {tps:,.0f} tok/s | {rec['tflops_per_device']:.4f} "
                        f"TFLOP/s/dev | MFU {rec['mfu']:.3f}{bal}{note}")
                    t_log, steps_since = time.perf_counter(), 0
                if step % tc["ckpt_every"] == 0 or step == tc["steps"] or stop["sigterm"]:
                    mgr.save(step, args=ocp.args.StandardSave(state))
                if stop["sigterm"]:
                    log(f"SIGTERM: saved step {step}; exiting cleanly")
                    break
    finally:
        mgr.wait_until_finished()
        mgr.close()
        signal.signal(signal.SIGTERM, prev)
        bar.close()
    if rc == 0 and not stop["sigterm"] and last_loss is not None:
        log(f"done: loss {first_loss:.4f} -> {last_loss:.4f} "
            f"({100 * (1 - last_loss / first_loss):.1f}% lower) in {time.perf_counter() - t0:.0f} s")
        if tc["sample_tokens"] and jax.process_count() > 1:
            log("sample: skipped (the end-of-run sample runs single-process only)")
        elif tc["sample_tokens"]:
            from k3jax.train.sample import generate
            text = generate(cfg, state.params, tok, tc["sample_prompt"], tc["sample_tokens"])
            log(f"sample: {text!r}")
    return rc
