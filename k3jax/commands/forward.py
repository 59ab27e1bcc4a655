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

    from k3jax.checkpoint.load import is_model_dir, load_model_dir
    from k3jax.config import load
    from k3jax.layout import layer_plan
    from k3jax.model import forward, init_params

    mesh = rules = None
    if args.mesh is not None:
        from k3jax import sharding
        mesh, rules = sharding.load_mesh(args.mesh)
    dispatch = args.moe_dispatch
    from_dir = is_model_dir(args.config)
    runtime = {"kda_impl": args.kda_impl, "moe_dispatch": dispatch, "expert_format": args.expert_format}
    if from_dir:
        shardings = None if mesh is None else (lambda c: sharding.param_shardings(c, mesh, rules))
        t = time.perf_counter()
        k3, params = load_model_dir(args.config, runtime, shardings)
        cfg, load_s = k3.text, time.perf_counter() - t
    else:
        cfg = load(args.config, **runtime)
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
            stack.enter_context(sharding.use_mesh(mesh, rules))
        if not from_dir and mesh is None:
            params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(args.seed)))
        elif not from_dir:
            params = jax.block_until_ready(sharding.init_params_sharded(cfg, jax.random.PRNGKey(args.seed), mesh, rules))
        if mesh is not None:
            # a batch smaller than the batch axes stays replicated along the axes it cannot fill
            spec = sharding.fit_spec(tokens.shape, sharding.batch_sharding(mesh, rules).spec, dict(mesh.shape))
            tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, spec))
        n = sum(x.size for x in jax.tree.leaves(params))
        if from_dir:
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


def _effective_dispatch(cfg, mesh, rules) -> str:
    """`describe_dispatch` under this mesh (or none)."""
    from k3jax import sharding
    from k3jax.ops.moe_dispatch import describe_dispatch
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(sharding.use_mesh(mesh, rules))
        return describe_dispatch(cfg)
