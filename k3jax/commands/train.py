"""`k3jax train CONFIG.yaml [key=value ...]`: fine-tuning / training (k3jax.train.loop)."""
from __future__ import annotations

import os


def register(sub):
    p = sub.add_parser("train", help="train or fine-tune from a YAML preset (see k3jax/train/config.py)")
    p.add_argument("config", help="a YAML preset with a train: section, or a preset name")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. steps=200 optimizer.lr=1e-3 run_name=a")
    p.add_argument("--mesh", default=None,
                   help="mesh preset (configs/meshes/*.yaml) or YAML path: shard params, optimizer state "
                        "and batches over it; 'ep' expert dispatch where the expert axis is > 1")
    p.add_argument("--distributed", choices=["auto", "on", "off"], default="auto",
                   help="call jax.distributed.initialize() first: 'auto' does so when a multi-host "
                        "launcher is detected (SLURM with several tasks, a TPU pod, or "
                        "JAX_COORDINATOR_ADDRESS set). Where jax cannot detect the cluster, set "
                        "JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (~/.cache/k3jax/xla)")
    p.set_defaults(fn=run)


def _multi_host_launch() -> bool:
    env = os.environ
    return bool(env.get("JAX_COORDINATOR_ADDRESS") or int(env.get("SLURM_NTASKS", "1")) > 1
                or len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1)


def _process_env() -> dict:
    """num_processes / process_id from JAX_NUM_PROCESSES / JAX_PROCESS_ID. jax reads only
    JAX_COORDINATOR_ADDRESS from the environment; these two complete a launch that no cluster
    manager describes (plain hosts, or several local processes as in the tests)."""
    from k3jax.config import ConfigError
    out = {}
    for var, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
        if os.environ.get(var, "") != "":
            try:
                out[key] = int(os.environ[var])
            except ValueError:
                raise ConfigError(f"{var}={os.environ[var]!r} is not an integer") from None
    return out


def run(args) -> int:
    import jax
    # Before anything touches a device: every host must join before the mesh is built.
    if args.distributed == "on" or (args.distributed == "auto" and _multi_host_launch()):
        jax.distributed.initialize(**_process_env())
    # Compiling the train step dominates a short CPU run; a rerun or resume reuses it.
    if not args.no_compile_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir",
                          os.environ.get("K3JAX_COMPILE_CACHE", os.path.expanduser("~/.cache/k3jax/xla")))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from k3jax.train.loop import run as train_run
    return train_run(args.config, args.overrides, log=lambda s: print(s, flush=True), mesh=args.mesh)
