"""The same programs exported for CUDA (`jax.export`), on a machine without a GPU.

A GPU preset's mesh is laid over this host's CPU devices (as many as the preset has GPUs:
XLA_FLAGS=--xla_force_host_platform_device_count=N), the programs are traced with CUDA as
the target (`k3jax.ops.platform`: ragged all-to-all, accelerator-sized KDA blocks) and
lowered to StableHLO for CUDA with their shardings. What cannot be partitioned or lowered
for GPUs fails here. The optimizer state's shardings are read off an update compiled on the
CPU mesh: propagation does not depend on the backend.
"""
from __future__ import annotations

import contextlib
import os

import jax

from k3jax.aot.programs import Program


# Custom calls jax.export would refuse to serialize for lack of a compatibility promise.
# Nothing here is serialized for later; lowering is the check.
_UNSTABLE = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("ragged_all_to_all", "triton_kernel_call", "__gpu$xla.gpu.triton")]


@contextlib.contextmanager
def target(backend: str):
    """Trace for `backend` (K3JAX_TARGET_BACKEND) inside the block. jit caches traces by
    their arguments, not by what tracing read from the environment, so they are cleared on
    the way in and out: no trace made for one target is reused for another."""
    old = os.environ.get("K3JAX_TARGET_BACKEND")
    os.environ["K3JAX_TARGET_BACKEND"] = backend
    jax.clear_caches()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("K3JAX_TARGET_BACKEND", None)
        else:
            os.environ["K3JAX_TARGET_BACKEND"] = old
        jax.clear_caches()


def _pinned(prog: Program):
    """The program's function with its arguments' shardings as in_shardings. The serving
    steps are jitted without any (their inputs bring them), and an export records only
    declared shardings; the wrapper adds nothing else (the step is inlined)."""
    if prog.mode == "train":       # sharded_train_step declares its own
        return prog.fn
    arrays = [i for i, a in enumerate(prog.args)
              if a is not None and jax.tree.leaves(a)
              and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(a))]
    static = tuple(i for i in range(len(prog.args)) if i not in arrays)
    shardings = tuple(jax.tree.map(lambda x: x.sharding, prog.args[i]) for i in arrays)
    fn = prog.fn
    return jax.jit(lambda *a: fn(*a), static_argnums=static, in_shardings=shardings)


def export(prog: Program, platform: str = "cuda"):
    """`jax.export.Exported` of the program for `platform`, traced for it."""
    from k3jax.mesh import use_mesh
    with target("gpu" if platform in ("cuda", "rocm") else platform), use_mesh(prog.mesh, prog.rules):
        return jax.export.export(_pinned(prog), platforms=(platform,), disabled_checks=_UNSTABLE)(*prog.args)
