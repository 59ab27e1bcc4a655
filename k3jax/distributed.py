"""Which multi-process launch started this process, and joining it (`--distributed`).

`detect(env)` reads the launcher's own description of the job and returns a `Launch`
(coordinator, process count, this process's id, the local devices it drives) or None for a
single process. Each launcher is recognised by what it alone sets, first match wins:

  explicit   JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (any hosts,
             several local processes as in the tests; JAX_LOCAL_DEVICE_IDS optional)
  slurm      an srun step (SLURM_STEP_NODELIST) with several tasks: one per GPU, one per
             node driving every GPU it sees, or k GPUs each
  ompi       Open MPI's mpirun (OMPI_COMM_WORLD_*); Open MPI 5 exports no launcher address,
             so there JAX_COORDINATOR_ADDRESS is needed
  xpk-gpu    xpk's GPU workloads: JAX_COORDINATOR_ADDRESS (+ _PORT), NNODES, NODE_RANK,
             one process per node driving its GPUS_PER_NODE
  gke-tpu    GKE / xpk TPU pods: TPU_WORKER_HOSTNAMES (or TPU_PROCESS_ADDRESSES) and
             TPU_WORKER_ID, multislice through MEGASCALE_NUM_SLICES / _SLICE_ID /
             _COORDINATOR_ADDRESS
  tpu-vm     a Cloud TPU VM slice (gcloud ... tpu-vm create or queued resources): a Google
             TPU on the PCI bus, the worker list and this worker's number from the GCE
             metadata server (multislice: its tpu-env attribute)

`initialize(mode)` hands jax every value explicitly with its own cluster detection off:
jax's SLURM and Open MPI detection would pin each process to one GPU
(local_device_ids=[local rank]), which breaks one task per node; every other value is what
jax's detection would have found.
"""
from __future__ import annotations

import glob
import os
import re
import urllib.request
from dataclasses import dataclass
from typing import Callable, Mapping

from k3jax.config import ConfigError

TPU_COORDINATOR_PORT = 8482          # jax's choice for Cloud TPU; JAX_COORDINATOR_PORT overrides
# Hosts of a pod start seconds to minutes apart (image pulls, mounts); jax's 300 s default
# is short for a large xpk workload.
INIT_TIMEOUT_S = 900
_GOOGLE_PCI_VENDOR = "0x1ae0"
_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


@dataclass(frozen=True)
class Launch:
    kind: str                                  # explicit | xpk-gpu | slurm | ompi | gke-tpu | tpu-vm
    coordinator_address: str                   # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None   # None: every device this process sees

    def initialize_kwargs(self) -> dict:
        return {"coordinator_address": self.coordinator_address, "num_processes": self.num_processes,
                "process_id": self.process_id, "cluster_detection_method": "deactivate",
                "local_device_ids": None if self.local_device_ids is None else list(self.local_device_ids),
                "initialization_timeout": INIT_TIMEOUT_S}

    def describe(self) -> str:
        ids = self.local_device_ids
        devices = "all local devices" if ids is None else f"local devices {list(ids)}"
        return (f"{self.kind} launch: process {self.process_id} of {self.num_processes}, "
                f"coordinator {self.coordinator_address}, {devices}")


def _int(env: Mapping, var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ConfigError(f"{var}={env[var]!r} is not an integer") from None


def _check_id(kind: str, n: int, i: int) -> None:
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"{kind} launch: process id {i} is not in 0..{n - 1}")


def _port(env: Mapping, default: int | str) -> str:
    return str(env.get("JAX_COORDINATOR_PORT") or default)


def _with_port(address: str, env: Mapping, default_port) -> str:
    """host[:port] → host:port: a bare host (or IPv6 address) gets JAX_COORDINATOR_PORT or the default."""
    if re.fullmatch(r"[^:\[\]]+:\d+|\[[^\]]+\]:\d+", address):
        return address
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    return f"{address}:{_port(env, default_port)}"


def _local_devices(env: Mapping, kind: str, local_rank: int, local_size: int,
                   visible: int | None) -> tuple[int, ...] | None:
    """The local device indices that process `local_rank` of the `local_size` on this host drives.

    JAX_LOCAL_DEVICE_IDS wins. A lone process on its host, or one the launcher already
    bound to a single GPU (`visible` ≤ 1), drives everything it sees; processes sharing the
    host's `visible` GPUs take equal consecutive blocks of them (one each when there are as
    many processes as GPUs)."""
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        try:
            return tuple(int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(","))
        except ValueError:
            raise ConfigError(f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r}: "
                              f"expected comma-separated integers") from None
    if local_size <= 1:
        return None
    if visible is None:              # no GPU count to go by: one device each, as jax assumes
        return (local_rank,)
    if visible <= 1:                 # the launcher bound one GPU to each process already
        return None
    if visible % local_size:
        raise ConfigError(f"{kind} launch: {local_size} processes on this host cannot split its "
                          f"{visible} GPUs evenly; launch one process per GPU or per node, or set "
                          f"JAX_LOCAL_DEVICE_IDS for each process")
    k = visible // local_size
    return tuple(range(local_rank * k, (local_rank + 1) * k))


def _visible_gpus(env: Mapping) -> int | None:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() not in ("", "NoDevFiles"):
        return len([x for x in cvd.split(",") if x.strip()])
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    return None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[003-010,017],login2' → 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r}: not a host list")
    return m.group(1) + (m.group(2) or "")


def slurm_tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """Tasks on node `node_index` from SLURM's compressed list: '8(x3),4' → [8, 8, 8, 4]."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}: cannot parse {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_index] if 0 <= node_index < len(counts) else max(counts)


def _slurm(env: Mapping) -> Launch | None:
    if "SLURM_JOB_ID" not in env:
        return None
    n = _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else \
        _int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else 1
    if "SLURM_STEP_NODELIST" not in env:
        if n > 1:   # the batch script itself: one process, while the job holds n tasks' worth
            raise ConfigError(f"SLURM job {env['SLURM_JOB_ID']} has {n} tasks but this process is not in "
                              f"an srun step: start `k3jax train` with srun (launch/slurm_gpu.sbatch), "
                              f"or pass --distributed off to train on this node alone")
        return None
    if n <= 1:
        return None
    i = _int(env, "SLURM_PROCID")
    _check_id("slurm", n, i)
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    local_size = slurm_tasks_on_node(per_node, node)
    # jax's rule for the port: a job-id-derived one in the ephemeral range, the same on
    # every task without any exchange
    port = int(env["SLURM_JOB_ID"]) % 4096 + 61440 if env["SLURM_JOB_ID"].isdigit() else 61440
    coord = env.get("JAX_COORDINATOR_ADDRESS") or first_slurm_host(env["SLURM_STEP_NODELIST"])
    return Launch("slurm", _with_port(coord, env, port), n, i,
                  _local_devices(env, "slurm", local_rank, local_size, _visible_gpus(env)))


def _ompi(env: Mapping) -> Launch | None:
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    n = _int(env, "OMPI_COMM_WORLD_SIZE")
    if n <= 1:
        return None
    i = _int(env, "OMPI_COMM_WORLD_RANK")
    _check_id("ompi", n, i)
    coord = env.get("JAX_COORDINATOR_ADDRESS")
    uri = env.get("OMPI_MCA_orte_hnp_uri")       # Open MPI 4: 'JOBID.0;tcp://IP,IP:PORT'
    if not coord and uri:
        m = re.search(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)", uri)
        if not m:
            raise ConfigError(f"OMPI_MCA_orte_hnp_uri={uri!r}: no launcher address in it; "
                              f"set JAX_COORDINATOR_ADDRESS=HOST:PORT (HOST runs rank 0)")
        jobid = uri.split(".", 1)[0]
        port = (int(jobid) // 4096) % 4096 + 61440 if jobid.isdigit() else 61440
        coord = _with_port(m.group(1) or f"[{m.group(2)}]", env, port)
    if not coord:
        raise ConfigError("Open MPI launch without OMPI_MCA_orte_hnp_uri (Open MPI 5 exports no "
                          "launcher address): set JAX_COORDINATOR_ADDRESS=HOST:PORT on every rank, "
                          "HOST being rank 0's host (mpirun -x JAX_COORDINATOR_ADDRESS=...)")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else 1
    return Launch("ompi", _with_port(coord, env, 61440), n, i,
                  _local_devices(env, "ompi", local_rank, local_size, _visible_gpus(env)))


def _tpu_launch(kind: str, env: Mapping, get: Callable[[str], str | None], hosts: list[str],
                worker: int) -> Launch | None:
    """Slices × hosts processes; process id = worker + slice id × hosts (jax's numbering)."""
    slices = int(get("MEGASCALE_NUM_SLICES") or 1)
    slice_id = int(get("MEGASCALE_SLICE_ID") or 0)
    n = len(hosts) * slices
    if n <= 1:
        return None
    i = worker + slice_id * len(hosts)
    _check_id(kind, n, i)
    coord = env.get("JAX_COORDINATOR_ADDRESS") or get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0]
    if not env.get("JAX_COORDINATOR_ADDRESS"):
        coord = coord.rsplit(":", 1)[0] if coord.count(":") == 1 else coord   # drop megascale's port
    return Launch(kind, _with_port(coord, env, TPU_COORDINATOR_PORT), n, i, None)


def _gke_tpu(env: Mapping) -> Launch | None:
    names = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if not names:
        return None
    hosts = [h.strip() for h in names.split(",") if h.strip()]
    worker = _int(env, "TPU_WORKER_ID") if env.get("TPU_WORKER_ID", "") != "" else 0
    return _tpu_launch("gke-tpu", env, env.get, hosts, worker)


def tpu_present() -> bool:
    """A Google TPU on this machine's PCI bus (what Cloud TPU VMs expose)."""
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def gce_metadata(key: str, timeout: float = 10.0) -> str | None:
    """An instance attribute from the GCE metadata server, None where it has none."""
    req = urllib.request.Request(_METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise ConfigError(f"GCE metadata {key}: HTTP {e.code}") from None
    except OSError as e:
        raise ConfigError(f"this machine has a TPU but the GCE metadata server did not answer for "
                          f"{key!r} ({e}); set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
                          f"JAX_PROCESS_ID, or pass --distributed off") from None


def _tpu_env(text: str | None) -> dict:
    """The tpu-env attribute's "KEY: 'value'" lines."""
    out = {}
    for line in (text or "").splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip().strip("'\"")
    return out


def _tpu_vm(env: Mapping, has_tpu: Callable[[], bool], metadata: Callable[[str], str | None]) -> Launch | None:
    if env.get("TPU_SKIP_MDS_QUERY") is not None or not has_tpu():
        return None
    endpoints = metadata("worker-network-endpoints")
    worker = metadata("agent-worker-number")
    if not endpoints or worker is None:
        return None
    # entries are 'host' or, in the older format, 'name:id:ip'
    hosts = [e.split(":")[2] if e.count(":") == 2 else e for e in endpoints.strip().split(",") if e]
    tpu_env = _tpu_env(metadata("tpu-env"))
    get = lambda k: env.get(k) or tpu_env.get(k)  # noqa: E731  (the environment wins, as in jax)
    return _tpu_launch("tpu-vm", env, get, hosts, int(worker.strip()))


def _explicit(env: Mapping) -> Launch | None:
    if not (env.get("JAX_COORDINATOR_ADDRESS") and env.get("JAX_NUM_PROCESSES", "") != ""
            and env.get("JAX_PROCESS_ID", "") != ""):
        return None
    n, i = _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID")
    _check_id("explicit", n, i)
    return Launch("explicit", env["JAX_COORDINATOR_ADDRESS"], n, i, _local_devices(env, "explicit", 0, 1, None))


def _xpk_gpu(env: Mapping) -> Launch | None:
    if not (env.get("JAX_COORDINATOR_ADDRESS") and env.get("NNODES") and env.get("NODE_RANK", "") != ""):
        return None
    n, i = _int(env, "NNODES"), _int(env, "NODE_RANK")
    if n <= 1:
        return None
    _check_id("xpk-gpu", n, i)
    return Launch("xpk-gpu", _with_port(env["JAX_COORDINATOR_ADDRESS"], env, 6002), n, i,
                  _local_devices(env, "xpk-gpu", 0, 1, None))


def detect(env: Mapping | None = None, has_tpu: Callable[[], bool] = tpu_present,
           metadata: Callable[[str], str | None] = gce_metadata) -> Launch | None:
    """The multi-process launch described by `env` (default os.environ), or None."""
    env = os.environ if env is None else env
    for found in (_explicit(env), _xpk_gpu(env), _slurm(env), _ompi(env), _gke_tpu(env)):
        if found is not None:
            return found
    launch = _tpu_vm(env, has_tpu, metadata)
    if launch is None and env.get("JAX_COORDINATOR_ADDRESS"):
        raise ConfigError("JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES / JAX_PROCESS_ID are "
                          "not, and no SLURM, Open MPI or TPU pod describes the job: set both")
    return launch


def initialize(mode: str = "auto", log=print) -> Launch | None:
    """Join the job before anything touches a device. 'auto': when `detect` finds several
    processes; 'on': always (an error when nothing describes the job); 'off': never."""
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"--distributed {mode!r}: expected auto, on or off")
    if mode == "off":
        return None
    launch = detect()
    if launch is None:
        if mode == "on":
            raise ConfigError("--distributed on, but no multi-process launch was found: set "
                              "JAX_COORDINATOR_ADDRESS=HOST:PORT, JAX_NUM_PROCESSES and JAX_PROCESS_ID, "
                              "or start under SLURM (srun), Open MPI (mpirun), GKE/xpk or a TPU VM pod")
        return None
    import jax
    from jax.experimental import multihost_utils
    jax.distributed.initialize(**launch.initialize_kwargs())
    # The first collective over a group of processes waits only 30 s for its peers on CPU
    # (gloo's rendezvous); here, straight after the coordinator has released everybody
    # together, is the one point where that always holds. Later barriers over the same
    # processes (`barrier`, Orbax's) then wait as long as they need.
    multihost_utils.sync_global_devices("k3jax_joined")
    log(launch.describe())
    return launch


def barrier(name: str) -> None:
    """Every process waits here (a no-op for one process)."""
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"k3jax_{name}")
