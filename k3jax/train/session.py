"""The steps of one run, between a built state and the report (loop.py builds the one and
writes the other): the checkpoint manager and the resume from its newest checkpoint
(`restore`), the step compiled ahead of the loop (`precompile`), and the step loop with its
metrics lines and checkpoints (`run_steps`), which ends a run cut short by a full disk as
`Loop.failure` once Orbax has finished or failed its saves.

`RunContext` is what every step reads, built once per run; `Loop` is what the steps change.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from k3jax.checkpoint.dirs import RUN_CHECKPOINTS, RUN_CONFIG, RUN_METRICS
from k3jax.distributed import barrier
from k3jax.train import objectives, preemption, rundir


@dataclass(frozen=True)
class RunContext:
    """What every step of a run reads; loop.py builds it once the data is open."""
    k3: Any                     # the K3Config loaded from config_path
    cfg: Any                    # the model config trained (loop.run_model_config)
    tc: dict                    # the resolved train config
    run_dir: str
    config_path: str
    main: bool                  # process 0: it logs and writes the run files
    say: Callable               # what every process reports (its preemption save)
    log: Callable               # process 0's log; a no-op on the others
    mesh: tuple | None          # (Mesh, rules), or None: everything on the default device
    batches: Any                # the objective's batch source (objectives.make_batches)
    tok: Any                    # the tokenizer
    evaluate: Callable | None   # params -> eval metrics (objectives.evaluator), or None


@dataclass(frozen=True)
class Stepper:
    """The train step and what feeds it."""
    train_step: Callable        # (state, batch) -> (state, metrics); donates the state
    place_batch: Callable       # a host batch -> the step's input arrays
    groups: Any                 # the optimizer's param groups (muon.build_optimizer)
    spec: dict | None = None    # with a mesh: objectives.batch_spec, {key: (shape, dtype)}
    rows: dict | None = None    # with a mesh: the sharding of each key (loop.accum_batch_shardings)


class Progress:
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


@dataclass
class Meter:
    """Throughput since the last logged step, and what turns it into FLOP/s and MFU."""
    tokens_per_step: int
    fpt: float                  # training FLOPs per token (flops.flops_per_token)
    peak: float                 # one device's peak FLOP/s: peak_tflops, or measured
    t_log: float = field(default_factory=time.perf_counter)   # from when it is made
    steps_since: int = 0


class StorageFailure(Exception):
    """A run-file or checkpoint write that failed for lack of disk (rundir.is_storage_error)."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(what)
        self.what, self.error = what, error


def _io(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:   # noqa: BLE001  (only the disk's errors are turned into a failure)
        if rundir.is_storage_error(e):
            raise StorageFailure(what, e) from e
        raise


@dataclass
class Loop:
    """What the steps change, and what loop.py reports when they end."""
    mgr: Any                    # the Orbax CheckpointManager
    stepper: Stepper
    state: Any                  # the TrainState: each step donates it and returns the next
    start: int                  # the step resumed from (0 for a new run)
    precompiled: bool
    watch: preemption.PreemptionWatch
    meter: Meter
    bar: Progress
    step: int = 0               # the last step taken; `start` before the first
    rc: int = 0                 # 0, 3 (non-finite), preemption.PREEMPTED
    first_loss: float | None = None
    last_loss: float | None = None
    failure: StorageFailure | None = None
    issued: list = field(default_factory=list)   # the steps whose checkpoints went to Orbax, in order
    config_written: bool = False


def restore(ctx: RunContext, state, groups):
    """(the checkpoint manager, `state` resumed from its newest checkpoint, with the data
    loader's position saved beside it, where there is one)."""
    import orbax.checkpoint as ocp

    from k3jax.train import step as tstep
    tc, run_dir = ctx.tc, ctx.run_dir
    if ctx.main:   # under the lock, before any process saves
        rundir.remove_unfinished_checkpoints(f"{run_dir}/{RUN_CHECKPOINTS}", ctx.log)
    barrier("initialised")   # Orbax's first directory sync is a device collective
    opts = ocp.CheckpointManagerOptions(max_to_keep=tc["keep"], enable_async_checkpointing=tc["async_checkpoint"])
    mgr = ocp.CheckpointManager(f"{run_dir}/{RUN_CHECKPOINTS}", options=opts)
    objectives.prepare(ctx.cfg, tc, state.params, ctx.batches, ctx.evaluate, ctx.log, ctx.mesh)   # with the initial params
    latest = mgr.latest_step()
    if latest is not None:
        # only what a checkpoint holds (a LoRA run: its adapters and router biases, step.checkpoint_view)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tstep.checkpoint_view(state, groups))
        state = tstep.from_checkpoint_view(state, mgr.restore(latest, args=ocp.args.StandardRestore(abstract)),
                                           groups)
        if ctx.batches.state() is not None:
            ctx.batches.restore(rundir.read_data_state(run_dir, latest, jax.process_index()))
        ctx.log(f"resumed from step {latest} ({run_dir}/checkpoints)")
    return mgr, state


def precompile(ctx: RunContext, stepper: Stepper, state, start: int) -> tuple[Stepper, bool]:
    """(`stepper` with its step compiled, True) under a mesh with steps left to take;
    (`stepper`, False) otherwise: the first step compiles it."""
    if ctx.mesh is None or start >= ctx.tc["steps"]:
        return stepper, False
    # compiled ahead of the loop: with the shardings pinned this is the one compile, and a
    # batch or state that did not match it would be an error rather than a recompile
    t = time.perf_counter()
    train_step = stepper.train_step.lower(state, {k: jax.ShapeDtypeStruct(shape, dtype, sharding=stepper.rows[k])
                                                  for k, (shape, dtype) in stepper.spec.items()}).compile()
    ctx.log(f"compiled the train step in {time.perf_counter() - t:.1f} s")
    barrier("compiled")   # the first step's collectives start together (distributed.initialize)
    return dataclasses.replace(stepper, train_step=train_step), True


def run_steps(ctx: RunContext, lp: Loop) -> None:
    """The steps from `lp.start` to steps=, in `lp`. A write that fails for lack of disk ends
    them as `lp.failure`, once Orbax has finished (or failed) the saves still in flight."""
    if ctx.evaluate is not None and lp.start < ctx.tc["steps"]:
        ctx.log(f"eval before step {lp.start + 1}:{objectives.describe(ctx.evaluate(lp.state.params))[2:]}")
    handled = False
    quiet = rundir.OrbaxErrorLog()
    rundir.silence_abandoned_writes()
    try:
        with quiet, rundir.MetricsLog(f"{ctx.run_dir}/{RUN_METRICS}", keep_through=lp.start, enabled=ctx.main,
                                      log=ctx.log) as mf:
            _steps(ctx, lp, mf)
        handled = True
    except StorageFailure as f:
        lp.failure, handled = f, True
    finally:
        with quiet:
            try:
                lp.mgr.wait_until_finished()     # raises what the last async save hit
                lp.mgr.close()
            except Exception as e:            # noqa: BLE001
                if handled and lp.failure is None and rundir.is_storage_error(e):
                    lp.failure = StorageFailure("checkpoint", e)
                elif handled and lp.failure is None:
                    raise
        lp.watch.close()
        lp.bar.close()


def _steps(ctx: RunContext, lp: Loop, mf) -> None:
    """Train, log, checkpoint; stop at a non-finite loss or gradient norm before that update
    is checkpointed (rc 3), or at the step a SIGTERM resolved to, saved (rc PREEMPTED)."""
    tc = ctx.tc
    for s in range(lp.start, tc["steps"]):
        _io("checkpoint", lp.mgr.check_for_errors)    # an async save that failed stops the run here
        batch = lp.stepper.place_batch(objectives.batch_for(ctx.batches, s, lp.state.params))
        lp.state, m = lp.stepper.train_step(lp.state, batch)
        loss, gnorm = float(m["loss"]), float(m["grad_norm"])
        lp.meter.steps_since += 1
        lp.step = step = s + 1
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            ctx.log(f"step {step}: non-finite loss {loss} / grad norm {gnorm}; stopping. "
                    f"Last good checkpoint: step {lp.mgr.latest_step()}")
            _io(RUN_METRICS, mf.write, {"step": step, "loss": None, "nonfinite": True})
            lp.rc = 3
            return
        lp.first_loss = loss if lp.first_loss is None else lp.first_loss
        lp.last_loss = loss
        lp.bar.update(step, loss)
        evaluating = ctx.evaluate is not None and objectives.eval_due(tc, step)
        if step % tc["log_every"] == 0 or step == tc["steps"] or step == lp.start + 1 or evaluating:
            _log_step(ctx, lp, mf, m, evaluating)
        preempted = lp.watch.reached(step)   # every step, on every process
        if step % tc["ckpt_every"] == 0 or step == tc["steps"] or preempted:
            _save(ctx, lp, step)
        if preempted:
            lp.rc = preemption.PREEMPTED
            return


def _log_step(ctx: RunContext, lp: Loop, mf, m: dict, evaluating: bool) -> None:
    """The step just taken, `lp.step`: its metrics.jsonl record (throughput since the last
    logged step, the objective's metrics, the eval's, expert load) and its log line."""
    step, meter = lp.step, lp.meter
    loss, gnorm = lp.last_loss, float(m["grad_norm"])
    dt = time.perf_counter() - meter.t_log
    tps = meter.tokens_per_step * meter.steps_since / dt
    rec = {"step": step, "loss": loss, "grad_norm": gnorm, "tokens_per_s": tps,
           "tflops_per_device": tps * meter.fpt / jax.device_count() / 1e12,
           "mfu": tps * meter.fpt / jax.device_count() / meter.peak, **objectives.step_metrics(m, ctx.batches, dt),
           **(ctx.evaluate(lp.state.params) if evaluating else {})}
    if "load_max" in m:
        rec["load_max"], rec["load_min"] = float(m["load_max"]), float(m["load_min"])
        rec["load_per_layer"] = {p: np.asarray(v).round(3).tolist() for p, v in m["load"].items()}
    if "ep_dropped" in m:
        rec["ep_dropped"] = float(m["ep_dropped"])
    _io(RUN_METRICS, mf.write, rec)
    bal = (f" | experts max/min load {rec['load_max']:.2f}/{rec['load_min']:.2f}"
           if "load_max" in rec else "")
    bal += f" | ep dropped {100 * rec['ep_dropped']:.2f}%" if "ep_dropped" in rec else ""
    lp.bar.close() if lp.bar.on else None
    note = " (includes compile)" if step == lp.start + 1 and not lp.precompiled else ""
    ctx.log(f"step {step:5d} | loss {loss:.4f} | {tps:,.0f} tok/s | {rec['tflops_per_device']:.4f} "
            f"TFLOP/s/dev | MFU {rec['mfu']:.3f}{bal}{objectives.describe(rec)}{note}")
    meter.t_log, meter.steps_since = time.perf_counter(), 0


def _save(ctx: RunContext, lp: Loop, step: int) -> None:
    """Checkpoint `lp.state` as `step` (asynchronously where async_checkpoint is set)."""
    import orbax.checkpoint as ocp

    from k3jax.train import step as tstep
    # config.yaml describes the checkpoints: written with the first one this run makes,
    # never for a run that saves nothing (refused, nothing to do, a non-finite probe)
    if ctx.main and not lp.config_written:
        _io(RUN_CONFIG, rundir.write_run_config, ctx.run_dir, ctx.k3, ctx.tc)
        lp.config_written = True
    data_state = ctx.batches.state()
    if data_state is not None:   # before the checkpoint: a checkpoint never lacks it
        _io("data state", rundir.write_data_state, ctx.run_dir, step, jax.process_index(), data_state)
    lp.issued.append(step)
    _io("checkpoint", lp.mgr.save, step, args=ocp.args.StandardSave(tstep.checkpoint_view(lp.state, lp.stepper.groups)))
    if data_state is not None and ctx.main:
        rundir.prune_data_state(ctx.run_dir, set(lp.mgr.all_steps()) | {step})
