"""The run: config → run dir → params → (resume) → steps with logging and checkpoints → sample
(the resume and the steps: session.py).

Run directory `{output_dir}/{run_name}`, a local path or a URL such as gs://bucket/runs
(rundir.py): `config.yaml` (resolved model + train config), `checkpoints/` (Orbax, async,
`keep` newest), `metrics.jsonl` (one object per logged step), `run.lock` while it runs,
`data_state/N/` (a streamed loader's per-process position at checkpoint N).

Guarding the directory: the config is validated as a whole before anything is read; a
second run on a live directory is refused naming the holder (rundir.RunLock); resuming
checkpoints with another model, data stream, seed or (cosine schedule) steps is refused
naming the keys; config.yaml is written with the first checkpoint this run saves, so it
always describes the checkpoints; a write that fails for lack of disk stops the run at once
with one message naming the last good checkpoint.

Failure handling: SIGTERM (preemption) to any process: all processes train on to the step
they agree on (preemption.py), save it together and return PREEMPTED (42), a code
schedulers restart a job on. A non-finite loss or gradient norm stops *before* that update
is checkpointed, so the newest checkpoint is the last good state (return code 3). `kill -9`
loses at most the steps since the last checkpoint: a rerun resumes from it and, since
batches depend only on (seed, step) (or, streamed, on the position saved with the
checkpoint) and the step is deterministic, logs the same losses; metrics.jsonl lines past
the resumed step are dropped first so the file reads as one run.
"""
from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp

from k3jax.checkpoint.dirs import RUN_CHECKPOINTS, checkpoint_steps
from k3jax.config import CONFIG_DIR, ConfigError, load_k3
from k3jax.errors import RunDirError
from k3jax.train import config as tconf, objectives, preemption, rundir, session
from k3jax.train.flops import flops_per_token, measured_peak_flops  # noqa: F401  (imported from here too)
from k3jax.train.session import RunContext


def _initial_params(cfg, tc, key, mesh=None, vision=None):
    """Params from `init_from` or a fresh init; with a mesh they are born sharded (restored
    shard by shard, or initialised under jit with out-shardings), never whole on one host.
    `vision` (a VisionConfig, for data with images): the vision tower's params under 'vision'.
    With LoRA, fresh adapters (their own random stream) join a loaded base."""
    from k3jax.model import LORA_KEY, init_params
    params = _base_params(cfg, tc, key, mesh, vision)
    if cfg.runtime.lora is not None and LORA_KEY not in params:
        out = None
        if mesh is not None:
            from k3jax.model import param_shardings
            out = param_shardings(cfg, *mesh)[LORA_KEY]
        params[LORA_KEY] = jax.jit(lambda k: init_params(cfg, k)[LORA_KEY], out_shardings=out)(key)
    return params


def _base_params(cfg, tc, key, mesh=None, vision=None):
    if vision is not None:
        return _multimodal_params(cfg, tc, key, mesh, vision)
    shardings = None
    if mesh is not None:
        from k3jax.model import init_params_sharded, param_shardings
        shardings = lambda c: param_shardings(c, *mesh)  # noqa: E731
    if tc["init_from"]:
        from k3jax.checkpoint.load import load_model_dir   # another module's loader; lazy
        k3, params = load_model_dir(tc["init_from"], runtime=tc["runtime"], shardings=shardings)
        if k3.text.replace(runtime=cfg.runtime) != cfg:
            raise ConfigError(f"init_from {tc['init_from']}: its model config differs from the run's config")
        return params
    if mesh is not None:
        return init_params_sharded(cfg, key, *mesh)
    from k3jax.model import init_params
    return init_params(cfg, key)


def _multimodal_params(cfg, tc, key, mesh, vision):
    if mesh is not None:
        raise ConfigError("training on images runs on one device for now: drop --mesh, or the images from the data")
    if tc["init_from"]:
        from k3jax.checkpoint.load import load_model_dir
        k3, params = load_model_dir(tc["init_from"], runtime=tc["runtime"], vision=True)
        if "vision" not in params:
            raise ConfigError(f"init_from {tc['init_from']}: the data holds images but the checkpoint has no vision "
                              f"tower weights")
        return params
    # random text params plus random vision params under `vision`
    from k3jax.layers.common import param_dtype
    from k3jax.layers.vision import init_vision_params
    from k3jax.model import init_params
    from k3jax.model.multimodal import VISION_KEY
    text_key, vision_key = jax.random.split(key)
    return {**init_params(cfg, text_key), VISION_KEY: init_vision_params(vision, vision_key, param_dtype(cfg))}


def optimizer_shardings(tx, abstract_params, groups):
    """The optimizer state's shardings: those XLA derives from the params' through the
    optimizer's own reshapes (Muon's block views), read off a compiled update, so no
    per-optimizer table has to be kept in step with the optimizer. `abstract_params`:
    ShapeDtypeStructs carrying the params' shardings; the state covers the trained ones."""
    from k3jax.train.muon import trained_mask
    from k3jax.train.step import opt_init, split_trained
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731  (init_state's rule)

    def first_update(p):
        t = split_trained(p, trained_mask(groups))[0]
        return tx.update(f32(t), opt_init(tx, p, groups), t)[1]
    return jax.jit(first_update).lower(abstract_params).compile().output_shardings


def sharded_train_step(mesh, abstract_params, tx, groups, train_step, batch_sharding, opt_shardings=None,
                       offload: bool = False):
    """(TrainState of shardings, the step jitted with that state's shardings pinned in and out).
    `offload` (runtime.optimizer_offload): the optimizer state's in the host's pinned memory.

    Pinned so the step compiles once: left to propagation, the first call sees the state as
    created and later calls see what the step returned, which differ (the optimizer state
    would even start replicated: its zeros carry no sharding of their own). `k3jax compile`
    lowers this same function for TPU topologies and GPU meshes."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.train.step import TrainState
    replicated = NamedSharding(mesh[0], P())
    param_sh = jax.tree.map(lambda x: x.sharding, abstract_params)
    opt_sh = optimizer_shardings(tx, abstract_params, groups) if opt_shardings is None else opt_shardings
    if offload:
        from k3jax.train.offload import host_shardings
        opt_sh = host_shardings(opt_sh)
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh)

    def sharded_train_step(state, batch):
        return train_step(state, batch)
    step = jax.jit(sharded_train_step, in_shardings=(state_sh, batch_sharding),
                   out_shardings=(state_sh, replicated), donate_argnums=(0,))
    return state_sh, step


def _sharded_state_and_step(mesh, params, tx, groups, train_step, batch_sharding, offload: bool = False):
    """(TrainState born sharded, the step jitted with its shardings: `sharded_train_step`)."""
    from k3jax.train.step import TrainState, opt_init
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    state_sh, step = sharded_train_step(mesh, abstract, tx, groups, train_step, batch_sharding, offload=offload)
    state = jax.jit(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=opt_init(tx, p, groups)),
                    out_shardings=state_sh)(params)
    return state, step


def accum_batch_shardings(mesh, spec: dict) -> dict:
    """Sharding of each of the step's inputs under (mesh, rules), by key of `spec`
    (objectives.batch_spec): [grad_accum, batch, length] rows over the batch and length
    axes, and per-row values (GRPO's advantages, [grad_accum, batch]) over the batch axes."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.mesh import batch_sharding
    rows = (None, *batch_sharding(*mesh).spec)
    return {k: NamedSharding(mesh[0], P(*rows[:len(shape)])) for k, (shape, _) in spec.items()}


def run_model_config(k3, tc: dict):
    """The model config a run trains: the train config's runtime options and its `lora:`
    section ('auto' MoE dispatch picks 'ep' under a mesh with an expert axis), and `qat`."""
    return _with_lora(k3.text.with_runtime(**tc["runtime"], qat=bool(tc.get("qat"))), tc)


def _with_lora(cfg, tc):
    """`cfg` with the train config's `lora:` section resolved onto it (k3jax.lora)."""
    from k3jax import lora
    from k3jax.model import abstract_params
    spec = lora.resolve(tc["lora"], cfg, abstract_params(cfg)) if tc["lora"]["rank"] else None
    return cfg.with_runtime(lora=spec) if spec is not None else cfg


def _data_path(path: str) -> str:
    """Relative dataset paths resolve against the working directory, then the directory
    above the presets (the repository, or the installed package, which carries data/ as
    k3jax/data: setup.py), so `k3jax train toy` finds the shipped corpus from anywhere;
    URLs as given."""
    if rundir.is_url(path) or os.path.isabs(path) or os.path.exists(path):
        return path
    in_repo = os.path.join(os.path.dirname(CONFIG_DIR), path)
    return in_repo if os.path.exists(in_repo) else path


def _shown(path: str) -> str:
    """A path as the user would type it: relative when under the working directory."""
    if rundir.is_url(path):
        return path
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def next_commands(run_dir: str, k3, tc: dict, config_path: str) -> list[str]:
    """What to do with a finished run: every command that takes a model directory takes it."""
    import shlex
    run = shlex.quote(_shown(run_dir))
    out = shlex.quote(_shown(run_dir.rstrip("/") + "-hf"))
    quant = (k3.to_hf().get("text_config", {}).get("quantization_config")
             or k3.to_hf().get("quantization_config"))
    experts = "" if quant or not k3.text.num_experts else " --experts-bf16"
    prompt = shlex.quote(tc["sample_prompt"] or "Hello")
    lines = [f"k3jax generate {run} --prompt {prompt}                  # sample from the newest checkpoint",
             f"k3jax logits {run} --tokens IDS.npy --out LOGITS.npy   # fp32 logits of token ids"]
    if tc["lora"]["rank"]:
        adapter = shlex.quote(_shown(run_dir.rstrip("/") + "-adapter"))
        return lines + [f"k3jax export {run} {adapter} --adapter            # the adapters, a PEFT directory",
                        f"k3jax export {run} {out} --merge-lora{experts}   # folded into the base, released layout"]
    return lines + [f"k3jax export {run} {out}{experts}      # the released safetensors layout",
                    f"k3jax train {shlex.quote(config_path)} init_from={run} "
                    f"run_name={shlex.quote(str(tc['run_name']))}-2   # a new run from these weights"]


def run(config_path: str, overrides: list[str] | None = None, log=print, mesh: str | None = None) -> int:
    """Train from a YAML preset. `mesh`: a preset of configs/meshes (or a YAML path): params,
    optimizer state and batches are sharded over it and 'ep' expert dispatch is used where
    its expert axis is > 1; without one, everything runs on the default device."""
    if mesh is None:
        return _run(config_path, overrides, log, None)
    from k3jax.mesh import load_mesh, load_preset, preset_for, use_mesh
    from k3jax.mesh import describe_runtime, preset_runtime
    section = load_k3(config_path).train
    given = tconf.parse_overrides(overrides or [])
    batch = tconf.resolve(section, given)["data"]["batch_size"]
    preset = preset_for(mesh, "train", batch, jax.device_count())
    if preset.name != load_preset(mesh).name:
        log(f"mesh {mesh}: training on {preset.name} ({batch} sequences per step)")
    # the preset's runtime settings where the config and the overrides give none (as plan
    # and compile take them); they go into the run's config.yaml like any override
    from_preset = preset_runtime(preset, {**((section or {}).get("runtime") or {}), **given.get("runtime", {})})
    if from_preset:
        overrides = list(overrides or []) + [f"runtime.{k}={v}" for k, v in from_preset.items()]
        log(describe_runtime(preset.name, from_preset))
    m, rules = load_mesh(preset)
    with use_mesh(m, rules):
        return _run(config_path, overrides, log, (m, rules))


def _run(config_path: str, overrides, log, mesh) -> int:
    k3 = load_k3(config_path)
    tc = tconf.resolve(k3.train, tconf.parse_overrides(overrides or []))
    main = jax.process_index() == 0       # multi-host: one process logs and writes run files
    say = log                             # what every process reports (its preemption save)
    log = log if main else (lambda *_: None)
    cfg = run_model_config(k3, tc)
    run_dir = rundir.run_dir(tc["output_dir"], tc["run_name"])
    _preflight(cfg, tc)
    created = rundir.first_missing(run_dir)
    rundir.make_dirs(run_dir)
    try:
        return _run_in(k3, cfg, tc, run_dir, config_path, main, say, log, mesh)
    except BaseException:
        if created and main:
            rundir.remove_if_nothing_saved(run_dir, created, checkpoint_steps(f"{run_dir}/{RUN_CHECKPOINTS}"))
        raise


def _run_in(k3, cfg, tc, run_dir, config_path, main, say, log, mesh) -> int:
    saved = checkpoint_steps(f"{run_dir}/{RUN_CHECKPOINTS}")
    if saved:
        rundir.check_resume(run_dir, k3, tc, log)     # every process: they all refuse alike
    if saved and saved[-1] >= tc["steps"]:
        more = (" or rerun with a larger steps= (the constant schedule allows it)"
                if tc["optimizer"]["schedule"] == "constant" else "")
        log(f"{run_dir} already holds step {saved[-1]} >= steps={tc['steps']}: nothing to do. To train on, "
            f"start a new run from its weights: init_from={_shown(run_dir)} run_name=NEW steps=N{more}")
        _log_next(log, run_dir, k3, tc, config_path)
        return 0
    # one run per directory: process 0 holds the lock (the other processes write no run files)
    with rundir.RunLock(run_dir, log) if main else contextlib.nullcontext():
        # as early as possible: a SIGTERM from here on resolves to a step this run will reach
        preemption.begin(saved[-1] if saved else 0)
        return _train(k3, cfg, tc, run_dir, config_path, main, say, log, mesh)


def _preflight(cfg, tc) -> None:
    """Checks that need the model but no params: freeze patterns that match nothing, an
    init_from that is not a model directory. Before anything is read or written."""
    if tc["optimizer"]["freeze"]:
        from k3jax.model import param_shapes
        from k3jax.train.muon import path_str
        paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(param_shapes(cfg))]
        tconf.check_freeze(tc["optimizer"]["freeze"], paths)
    if tc["init_from"]:
        from k3jax.checkpoint.load import resolve
        resolve(tc["init_from"])
    if tc["data"]["loader"] == "grain":
        from k3jax.train.stream import require_grain
        require_grain()       # the extra's message before the run directory is touched


def _train(k3, cfg, tc, run_dir, config_path, main, say, log, mesh) -> int:
    from k3jax.tokenizer import tokenizer_for

    d = tc["data"]
    tok = tokenizer_for(k3, d["tokenizer"], d["bpe_file"], d["pattern"])
    # init_from, where given, is also the folder whose preprocessor_config.json sizes images
    batches = objectives.make_batches(tc, _data_path(d["path"]), tok, k3, jax.process_index(),
                                      jax.process_count(), media_dir=tc["init_from"])
    log(f"data: {batches.describe()}")
    try:
        evaluate = objectives.evaluator(cfg, tc, tok, k3, d["eval_path"] and _data_path(d["eval_path"]))
        if evaluate is not None:
            log(f"eval: {evaluate.ds.summary()} ({d['eval_path']})")
        return _train_on(RunContext(k3, cfg, tc, run_dir, config_path, main, say, log, mesh, batches, tok, evaluate))
    finally:
        batches.close()


def _train_on(ctx: RunContext) -> int:
    """Build the state, resume it, compile its step, train, report: the run's exit code."""
    cfg, tc, d = ctx.cfg, ctx.tc, ctx.tc["data"]
    t0 = time.perf_counter()
    state, stepper = _build_state(ctx)
    mgr, state = session.restore(ctx, state, stepper.groups)
    start = int(state.step)
    ctx.log(f"init {time.perf_counter() - t0:.1f} s; training steps {start}..{tc['steps']} in {ctx.run_dir}")
    stepper, precompiled = session.precompile(ctx, stepper, state, start)
    watch = preemption.PreemptionWatch()
    fpt = flops_per_token(state.params, (cfg.num_experts_per_token or 1) / (cfg.num_experts or 1), stepper.groups,
                          cfg.num_experts_per_token or 1)
    peak = float(tc["peak_tflops"]) * 1e12 if tc["peak_tflops"] else measured_peak_flops()
    meter = session.Meter(d["batch_size"] * d["grad_accum"] * d["seq_len"], fpt, peak)
    lp = session.Loop(mgr, stepper, state, start, precompiled, watch, meter, session.Progress(tc["steps"]), step=start)
    del state   # lp.state from here on: each step donates it and returns the next
    session.run_steps(ctx, lp)
    return _finish(ctx, lp, t0)


def _build_state(ctx: RunContext) -> tuple:
    """(the initial TrainState, its session.Stepper): params from init_from or fresh, the
    optimizer, the train step; under a mesh all born sharded and the step's shardings pinned."""
    from k3jax.train import muon, step as tstep
    cfg, tc, mesh, log = ctx.cfg, ctx.tc, ctx.mesh, ctx.log
    vision = ctx.k3.vision if ctx.batches.has_images else None   # chat data with images
    params = _initial_params(cfg, tc, jax.random.PRNGKey(tc["seed"]), mesh, vision)
    tx, groups = muon.build_optimizer(cfg, params, tc["optimizer"], tc["steps"],
                                      tc["lora"] if cfg.runtime.lora is not None else None)
    if cfg.runtime.lora is not None:
        n = sum(x.size for x in jax.tree.leaves(params["lora"]))
        log(f"lora: rank {cfg.runtime.lora.rank}, {len(cfg.runtime.lora.targets)} projections per layer kind, "
            f"{n:,d} adapter params trained; the base is frozen")
    train_step = tstep.make_train_step(cfg, tc, tx, groups, **({} if vision is None else {
        "vision": vision, "media_pad_id": ctx.tok.token_id("<|media_pad|>")}))
    if mesh is None:
        state = tstep.init_state(params, tx, groups)
        if cfg.runtime.optimizer_offload:   # where the step returns it, so it compiles once
            from k3jax.train.offload import to_host
            state = state.replace(opt_state=to_host(state.opt_state))
        return state, session.Stepper(train_step, lambda b: b, groups)
    spec = objectives.batch_spec(cfg, tc)
    rows = accum_batch_shardings(mesh, spec)  # {key: sharding of its [accum, B, T] or [accum, B]}
    if ctx.batches.local:   # a streamed loader gives each process the rows of its own devices
        place_batch = lambda b: {k: jax.make_array_from_process_local_data(rows[k], v, spec[k][0])  # noqa: E731
                                 for k, v in b.items()}
    else:               # every process computes the same global batch from (seed, step) and
        # hands over only the slices its own devices hold
        place_batch = lambda b: {k: jax.make_array_from_callback(v.shape, rows[k], lambda i, v=v: v[i])  # noqa: E731
                                 for k, v in b.items()}
    state, train_step = _sharded_state_and_step(mesh, params, tx, groups, train_step, rows,
                                                offload=cfg.runtime.optimizer_offload)
    del params
    from k3jax.ops.moe_dispatch import describe_dispatch   # run() holds the mesh as the context mesh
    log(f"mesh {dict(mesh[0].shape)} over {jax.process_count()} process(es); "
        f"moe dispatch {describe_dispatch(cfg)}")
    return state, session.Stepper(train_step, place_batch, groups, spec, rows)


def _finish(ctx: RunContext, lp: session.Loop, t0: float) -> int:
    """The run's last lines, as the steps ended: a full disk raised as RunDirError naming
    the last good checkpoint, the preempted save, or the losses, a sample and what to do next."""
    tc, log, run_dir, step = ctx.tc, ctx.log, ctx.run_dir, lp.step
    if lp.failure is not None:
        good = checkpoint_steps(f"{run_dir}/{RUN_CHECKPOINTS}")
        last = f"step {good[-1]} ({run_dir}/{RUN_CHECKPOINTS}/{good[-1]})" if good else "none"
        what = lp.failure.what
        if what == "checkpoint":   # an async save fails after the steps that follow it began
            lost = [x for x in lp.issued if x not in good]
            what = f"checkpoint of step {lost[0] if lost else step}"
        raise RunDirError(f"{run_dir}: writing the {what} failed ({rundir.storage_reason(lp.failure.error)}); "
                          f"training stopped at step {step}. Last good checkpoint: {last}. "
                          "Free space and rerun the same command to resume from it")
    if lp.rc == preemption.PREEMPTED:
        ctx.say(f"SIGTERM: saved step {step} (process {jax.process_index()} of {jax.process_count()}); "
                f"exit code {lp.rc}: rerun the same command to resume")
    if lp.rc == 0 and lp.last_loss is not None:
        first_loss, last_loss = lp.first_loss, lp.last_loss
        # GRPO's loss is ~0 each step by construction (group-normalised advantages, ratio 1
        # on a fresh rollout): a relative change says nothing; its progress is the reward
        change = ("" if objectives.is_grpo(tc) or first_loss <= 0 else
                  f" ({100 * (1 - last_loss / first_loss):.1f}% lower)")
        log(f"done: loss {first_loss:.4f} -> {last_loss:.4f}{change} in {time.perf_counter() - t0:.0f} s")
        _sample(ctx, lp.state.params)
    if lp.rc == 0:
        _log_next(log, run_dir, ctx.k3, tc, ctx.config_path)
    return lp.rc


def _sample(ctx: RunContext, params) -> None:
    """The end-of-run sample (sample_tokens=): a chat reply, or a continuation of the prompt."""
    tc, d, log = ctx.tc, ctx.tc["data"], ctx.log
    if tc["sample_tokens"] and jax.process_count() > 1:
        log("sample: skipped (the end-of-run sample runs single-process only)")
    elif tc["sample_tokens"] and d["format"] == "chat":
        from k3jax.infer.generator import sample_reply
        reply = sample_reply(ctx.cfg, params, ctx.tok, tc["sample_prompt"], tc["sample_tokens"],
                             thinking=d["chat"]["thinking"], thinking_effort=d["chat"]["thinking_effort"])
        log(f"sample reply to {tc['sample_prompt']!r}: {reply}")
    elif tc["sample_tokens"]:
        from k3jax.train.sample import generate
        text = generate(ctx.cfg, params, ctx.tok, tc["sample_prompt"], tc["sample_tokens"])
        log(f"sample: {text!r}")


def _log_next(log, run_dir, k3, tc, config_path):
    log("next (a run directory or its checkpoints/N works wherever a model directory does):")
    for line in next_commands(run_dir, k3, tc, config_path):
        log(f"  {line}")
