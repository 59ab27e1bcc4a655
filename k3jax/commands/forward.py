"""`k3jax forward [CONFIG | MODEL_DIR]`: one forward pass with timings, the quickest smoke test.

A config (preset name, YAML, config.json) runs on random-init params; a model directory (HF
checkpoint, `k3jax convert` output, training run or its checkpoints/N) runs on its params,
restored onto the mesh when one is given."""
from __future__ import annotations

import contextlib
import time

from k3jax.config import KDA_IMPLS, MOE_DISPATCHES
from k3jax.commands import add_expert_format, number


def register(sub):
    p = sub.add_parser("forward", help="forward pass with timings: random init, or a model directory's params")
    p.add_argument("config", nargs="?", default="toy",
                   help="preset / YAML / config.json (random init), or a model directory (its params)")
    p.add_argument("--batch", type=number(int, 1), default=2)
    p.add_argument("--seq", type=number(int, 1), default=256)
    p.add_argument("--repeats", type=number(int, 1), default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kda-impl", default="auto", choices=KDA_IMPLS)
    p.add_argument("--moe-dispatch", default="auto", choices=MOE_DISPATCHES,
                   help="default 'auto': 'ep' on a mesh whose expert axis is > 1, else 'ragged'")
    add_expert_format(p, "held")
    p.add_argument("--mesh", default=None,
                   help="mesh preset (configs/meshes/*.yaml) or YAML path: params are initialised "
                        "sharded over it and the batch is split by its rules")
    p.set_defaults(fn=run)


def run(args) -> int:
    import jax
    import numpy as np

    from k3jax.layout import layer_plan
    from k3jax.model import forward

    mesh = rules = None
    if args.mesh is not None:
        from k3jax.mesh import batch_sharding, fit_spec, load_mesh, use_mesh
        mesh, rules = load_mesh(args.mesh)
    dispatch = args.moe_dispatch
    cfg, params, load_s = _cfg_and_params(args, mesh, rules)
    plan = layer_plan(cfg)
    where = (f"mesh {dict(mesh.shape)}" if mesh is not None
             else f"devices: {jax.devices()[0].platform} x{jax.device_count()}")
    print(f"config {args.config}: {cfg.num_hidden_layers} layers ({cfg.layer_kinds.count('kda')} KDA, "
          f"{cfg.layer_kinds.count('mla')} MLA), {len(plan.head)} unrolled + {plan.n_groups} scanned groups "
          f"of {plan.group_size} + {len(plan.tail)} unrolled; {where}; moe dispatch "
          f"{_effective_dispatch(cfg, mesh, rules)}", flush=True)
    if dispatch == "ep" and (mesh is None or mesh.shape["expert"] == 1):
        print("note: 'ep' without a mesh expert axis > 1 runs as 'ragged'", flush=True)
    tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.seq), dtype=np.int32)
    with contextlib.ExitStack() as stack:
        t = time.perf_counter()
        if mesh is not None:
            stack.enter_context(use_mesh(mesh, rules))
        if params is None:
            params = jax.block_until_ready(_random_params(cfg, args.seed, mesh, rules))
        if mesh is not None:
            # a batch smaller than the batch axes stays replicated along the axes it cannot fill
            spec = fit_spec(tokens.shape, batch_sharding(mesh, rules).spec, dict(mesh.shape))
            tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, spec))
        n = sum(x.size for x in jax.tree.leaves(params))
        if load_s is not None:
            print(f"loaded {args.config}: {n:,d} params in {load_s:.1f} s", flush=True)
        else:
            print(f"init: {n:,d} params in {time.perf_counter() - t:.1f} s", flush=True)
        t = time.perf_counter()
        logits = jax.block_until_ready(forward(cfg, params, tokens))
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.repeats):
            logits = jax.block_until_ready(forward(cfg, params, tokens))
        step = (time.perf_counter() - t) / max(args.repeats, 1)
    print(f"forward [{args.batch}x{args.seq}]: compile+run {first:.1f} s, then {step * 1e3:.1f} ms "
          f"({args.batch * args.seq / step:,.0f} tokens/s); logits {tuple(logits.shape)}, "
          f"finite={bool(np.isfinite(np.asarray(logits)).all())}")
    return 0


def _cfg_and_params(args, mesh, rules):
    """(config, params, seconds it took to load them) of a model directory, its params
    restored onto the mesh when there is one; (config, None, None) for a config, whose
    params `run` initialises under the mesh."""
    from k3jax.checkpoint.load import is_model_dir, load_model_dir
    from k3jax.config import load
    runtime = {"kda_impl": args.kda_impl, "moe_dispatch": args.moe_dispatch, "expert_format": args.expert_format}
    if not is_model_dir(args.config):
        return load(args.config, **runtime), None, None
    from k3jax.model import param_shardings
    shardings = None if mesh is None else (lambda c: param_shardings(c, mesh, rules))
    t = time.perf_counter()
    k3, params = load_model_dir(args.config, runtime, shardings)
    return k3.text, params, time.perf_counter() - t


def _random_params(cfg, seed: int, mesh, rules):
    """Random-init params, sharded over the mesh when there is one (under its `use_mesh`)."""
    import jax

    from k3jax.model import init_params, init_params_sharded
    key = jax.random.PRNGKey(seed)
    return init_params(cfg, key) if mesh is None else init_params_sharded(cfg, key, mesh, rules)


def _effective_dispatch(cfg, mesh, rules) -> str:
    """`describe_dispatch` under this mesh (or none)."""
    from k3jax.mesh import use_mesh
    from k3jax.ops.moe_dispatch import describe_dispatch
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(use_mesh(mesh, rules))
        return describe_dispatch(cfg)
