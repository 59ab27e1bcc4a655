"""TPU topologies on a CPU host, and the per-chip figures the step-time estimate uses.

libtpu (the `[tpu]` environment) compiles for a TPU topology it is told about
(`jax.experimental.topologies`) without any TPU attached. On a host that is not a TPU VM it
first looks for TPU hosts; `host_environment` sets what keeps it from doing so, before JAX
starts a backend, and names the target for the code that picks forms by backend
(`k3jax.ops.platform`).
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

from k3jax.config import ConfigError


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float        # dense bf16 FLOP/s
    hbm_bandwidth: float     # bytes/s
    ici_bandwidth: float     # bytes/s one way per chip (half the bidirectional figure), all links
    hbm_gib: float
    source: str = "cloud.google.com/tpu/docs"


# Google Cloud's published per-chip figures (bidirectional ICI halved for one direction).
CHIPS = {
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 600e9, 95),
    "v5e": Chip("TPU v5e", 197e12, 819e9, 200e9, 16),
    "v6e": Chip("TPU v6e", 918e12, 1638e9, 400e9, 32),
}
_KINDS = {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e",
          "TPU v6e": "v6e"}


def chip_for(topology: str, device_kind: str = "") -> Chip | None:
    """The chip of a topology name ('v5p:8x8x8') or device kind ('TPU v5'); None if unknown."""
    gen = topology.split(":", 1)[0].lower().replace("litepod", "e")
    return CHIPS.get(gen) or CHIPS.get(_KINDS.get(device_kind, ""))


def host_environment(platform: str = "tpu") -> None:
    """Environment for compiling for `platform` on this host; call before JAX starts."""
    env = {"K3JAX_TARGET_BACKEND": platform}
    if platform == "tpu":
        # not a TPU VM: no TPU backend to start, no hosts to look for
        env.update(JAX_PLATFORMS="cpu", TPU_ACCELERATOR_TYPE="v5p-8", TPU_WORKER_HOSTNAMES="localhost",
                   # no chip to share: without this a second compile on the host stops at
                   # libtpu's lockfile ("Internal error when accessing libtpu multi-process lockfile")
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    for k, v in env.items():
        os.environ.setdefault(k, v)


_TOPOLOGY = re.compile(r"^[a-z0-9]+:\d+(x\d+){1,2}$")


def topology_devices(name: str):
    """The devices of a TPU topology such as 'v5p:8x8x8' (libtpu must be installed)."""
    if not _TOPOLOGY.match(name.lower()):
        raise ConfigError(f"--topology {name!r}: expected CHIP:AxBxC such as v5p:8x8x8 or v6e:16x16 "
                          f"(chips with figures here: {', '.join(CHIPS)})")
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError("k3jax compile needs the TPU compiler (libtpu), which this environment lacks: run it "
                          "in the [tpu] environment, a separate venv with `pip install -e \".[tpu]\"` (README)")
    try:
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:   # noqa: BLE001 — libtpu's errors name neither the cause nor the fix
        why = " ".join(str(e).split())[:200]
        fix = ("each dimension must be a multiple of a host's chips (v5p: 2x2x1), e.g. v5p:8x8x8"
               if chip_for(name) else f"name a TPU generation, e.g. {', '.join(c + ':8x8' for c in CHIPS)}")
        raise ConfigError(f"--topology {name!r}: libtpu cannot lay it out ({why}); {fix}") from None
    return list(topo.devices)
