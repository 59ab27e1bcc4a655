"""`k3jax train CONFIG.yaml [key=value ...]`: fine-tuning / training (k3jax.train.loop)."""
from __future__ import annotations

import os


def register(sub):
    p = sub.add_parser("train", help="train or fine-tune from a YAML preset (see k3jax/train/config.py)",
                       epilog="exit codes: 0 done, 2 bad input, 3 non-finite loss, 42 preempted (SIGTERM to "
                              "any process: every process saved the same step; rerun the same command to "
                              "resume; xpk restarts on 42, launch/slurm_gpu.sbatch requeues)")
    p.add_argument("config", help="a YAML preset with a train: section, or a preset name")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. steps=200 optimizer.lr=1e-3 run_name=a")
    p.add_argument("--mesh", default=None,
                   help="mesh preset (configs/meshes/*.yaml) or YAML path: shard params, optimizer state "
                        "and batches over it; 'ep' expert dispatch where the expert axis is > 1")
    p.add_argument("--distributed", choices=["auto", "on", "off"], default="auto",
                   help="join a multi-process job (jax.distributed) before anything else: 'auto' when "
                        "the launch describes several processes (SLURM srun step, Open MPI mpirun, "
                        "GKE/xpk TPU pod incl. multislice, Cloud TPU VM pod slice, or "
                        "JAX_COORDINATOR_ADDRESS=HOST:PORT with JAX_NUM_PROCESSES and JAX_PROCESS_ID); "
                        "'on' fails when none is found; 'off' never (see k3jax/distributed.py)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (~/.cache/k3jax/xla)")
    p.set_defaults(fn=run)


def run(args) -> int:
    import jax

    from k3jax import distributed
    # Before anything touches a device: every host must join before the mesh is built.
    distributed.initialize(args.distributed, log=lambda s: print(s, flush=True))
    # Compiling the train step dominates a short CPU run; a rerun or resume reuses it.
    if not args.no_compile_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir",
                          os.environ.get("K3JAX_COMPILE_CACHE", os.path.expanduser("~/.cache/k3jax/xla")))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from k3jax.train.loop import run as train_run
    return train_run(args.config, args.overrides, log=lambda s: print(s, flush=True), mesh=args.mesh)
