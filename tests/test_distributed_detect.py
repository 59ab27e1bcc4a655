"""`--distributed auto` detection, one environment per test: the variables each launcher sets
(taken from the launchers' documentation: SLURM's srun(1) output environment, Open MPI's
mpirun(1), GKE's TPU webhook / xpk's JobSet, the Cloud TPU VM metadata server) and, for TPU
VMs, a stubbed metadata lookup. Expected values are written out by hand from those
descriptions."""
import pytest

from k3jax import distributed
from k3jax.config import ConfigError
from k3jax.distributed import Launch, detect


def no_tpu():
    return False


def run_detect(env, metadata=None):
    """detect() on exactly `env`; a TPU only where metadata is given."""
    if metadata is None:
        return detect(env, has_tpu=no_tpu, metadata=lambda key: pytest.fail(f"metadata {key} queried"))
    return detect(env, has_tpu=lambda: True, metadata=lambda key: metadata.get(key))


def test_single_process_without_a_launcher():
    assert run_detect({"HOME": "/root", "PATH": "/usr/bin"}) is None
    # one srun task, one mpirun rank, a one-host GKE slice: nothing to join
    assert run_detect({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) is None
    assert run_detect({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    assert run_detect({"TPU_WORKER_HOSTNAMES": "t-0", "TPU_WORKER_ID": "0"}) is None


def test_explicit_env_launch():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.5:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert run_detect(env) == Launch("explicit", "10.0.0.5:1234", 4, 3, None)
    assert run_detect({**env, "JAX_LOCAL_DEVICE_IDS": "2,3"}).local_device_ids == (2, 3)
    # jax is told everything and detects nothing itself
    kw = run_detect(env).initialize_kwargs()
    assert kw["cluster_detection_method"] == "deactivate" and kw["num_processes"] == 4
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
        run_detect({**env, "JAX_PROCESS_ID": "x"})
    with pytest.raises(ConfigError, match="not in 0..3"):
        run_detect({**env, "JAX_PROCESS_ID": "4"})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES"):
        run_detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.5:1234"})


def slurm(procid, localid, nodeid, ntasks, per_node, **extra):
    return {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[007-010,012],big01",
            "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_STEP_TASKS_PER_NODE": per_node,
            **extra}


def test_slurm_one_task_per_gpu():
    # 5 nodes x 8 tasks; the task is rank 8*2+5 on node 2; all 8 GPUs of the node visible
    env = slurm(21, 5, 2, 40, "8(x5)", SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    # port: 123456 % 4096 + 61440 = 576 + 61440 (the rule jax's own SLURM detection uses)
    assert run_detect(env) == Launch("slurm", "gpu007:62016", 40, 21, (5,))


def test_slurm_one_task_per_node_drives_every_gpu():
    # jax's SLURM detection would give this process local_device_ids=[0]: 1 GPU of 8
    env = slurm(3, 0, 3, 5, "1(x5)", SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    launch = run_detect(env)
    assert launch == Launch("slurm", "gpu007:62016", 5, 3, None)
    assert launch.initialize_kwargs()["local_device_ids"] is None


def test_slurm_blocks_of_gpus_and_bound_gpus():
    # 2 tasks per node sharing 8 GPUs: 4 consecutive each
    assert run_detect(slurm(3, 1, 1, 4, "2(x2)", SLURM_GPUS_ON_NODE="8")).local_device_ids == (4, 5, 6, 7)
    # srun --gpus-per-task=1: each task already sees only its own GPU
    assert run_detect(slurm(3, 1, 1, 4, "2(x2)", CUDA_VISIBLE_DEVICES="1")).local_device_ids is None
    # uneven nodes ('3,2'): the second node's tasks
    assert run_detect(slurm(4, 1, 1, 5, "3,2", SLURM_GPUS_ON_NODE="4")).local_device_ids == (2, 3)
    with pytest.raises(ConfigError, match="cannot split its 8 GPUs"):
        run_detect(slurm(0, 0, 0, 6, "3(x2)", SLURM_GPUS_ON_NODE="8"))
    # an explicit override wins
    assert run_detect(slurm(0, 0, 0, 4, "2(x2)", SLURM_GPUS_ON_NODE="8",
                            JAX_LOCAL_DEVICE_IDS="6,7")).local_device_ids == (6, 7)
    # a coordinator port / address the user chose
    assert run_detect(slurm(0, 0, 0, 4, "2(x2)", JAX_COORDINATOR_PORT="5000")).coordinator_address == "gpu007:5000"


def test_slurm_batch_script_without_srun_is_refused():
    env = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_NODELIST": "n[1-2]"}
    with pytest.raises(ConfigError, match="srun"):
        run_detect(env)


def test_slurm_host_lists():
    assert distributed.first_slurm_host("node001") == "node001"
    assert distributed.first_slurm_host("a1,b2") == "a1"
    assert distributed.first_slurm_host("gpu-h200-[0003-0010],x") == "gpu-h200-0003"
    assert distributed.first_slurm_host("n[5,7-9]") == "n5"
    assert [distributed.slurm_tasks_on_node("8(x3),4", i) for i in range(4)] == [8, 8, 8, 4]


def test_open_mpi():
    base = {"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    # Open MPI 4: the launcher's address; port from the job id: 1531576320 // 4096 = 373920,
    # % 4096 = 1184, + 61440
    env = {**base, "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    assert run_detect(env) == Launch("ompi", "10.96.0.1:62624", 16, 9, (1,))
    one_per_node = {**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert run_detect(one_per_node).local_device_ids is None
    # Open MPI 5 exports no launcher address: a clear error, or the user's
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS"):
        run_detect(base)
    assert run_detect({**base, "JAX_COORDINATOR_ADDRESS": "h0:7000"}).coordinator_address == "h0:7000"


def test_gke_xpk_tpu_single_and_multislice():
    hosts = ",".join(f"k3-job-0-{i}.k3-job" for i in range(4))
    env = {"TPU_WORKER_HOSTNAMES": hosts, "TPU_WORKER_ID": "2"}
    assert run_detect(env) == Launch("gke-tpu", "k3-job-0-0.k3-job:8482", 4, 2, None)
    # multislice (xpk --num-slices 2): slice 1's worker 2 is process 4 + 2; the coordinator is
    # megascale's (slice 0 worker 0), on jax's TPU port
    multi = {**env, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
             "MEGASCALE_COORDINATOR_ADDRESS": "k3-job-0-0.k3-job:8080"}
    assert run_detect(multi) == Launch("gke-tpu", "k3-job-0-0.k3-job:8482", 8, 6, None)
    # two single-host slices are still two processes
    assert run_detect({"TPU_WORKER_HOSTNAMES": "h0", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
                       "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "h0"}).num_processes == 2


def test_xpk_gpu_workload():
    # what xpk's JobSet sets on A3/A4 GPU node pools: one process per node, all its GPUs
    env = {"JAX_COORDINATOR_ADDRESS": "k3-sft-slice-job-0-0.k3-sft", "JAX_COORDINATOR_PORT": "6002",
           "NNODES": "32", "NODE_RANK": "7", "GPUS_PER_NODE": "8"}
    assert run_detect(env) == Launch("xpk-gpu", "k3-sft-slice-job-0-0.k3-sft:6002", 32, 7, None)


def test_tpu_vm_pod_from_metadata():
    meta = {"worker-network-endpoints": "10.1.0.2,10.1.0.3,10.1.0.4,10.1.0.5", "agent-worker-number": "3",
            "tpu-env": "ACCELERATOR_TYPE: 'v5p-32'\nWORKER_ID: '3'\n"}
    assert run_detect({}, meta) == Launch("tpu-vm", "10.1.0.2:8482", 4, 3, None)
    # the older 'name:id:ip' endpoint format
    old = {**meta, "worker-network-endpoints": "w0:0:10.1.0.2,w1:1:10.1.0.3"}
    assert run_detect({}, {**old, "agent-worker-number": "1"}) == Launch("tpu-vm", "10.1.0.2:8482", 2, 1, None)
    # queued-resources multislice: the slice layout is in tpu-env
    ms = {**meta, "tpu-env": "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\n"
                             "MEGASCALE_COORDINATOR_ADDRESS: '10.9.0.2:8080'\n"}
    assert run_detect({}, ms) == Launch("tpu-vm", "10.9.0.2:8482", 8, 7, None)
    # a single-host TPU VM (v5p-8): one process, nothing to join
    assert run_detect({}, {"worker-network-endpoints": "10.1.0.2", "agent-worker-number": "0"}) is None
    # no TPU on the bus: the metadata server is never asked
    assert run_detect({}) is None


def test_on_and_off_modes(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    assert distributed.initialize("off") is None
    assert distributed.initialize("auto") is None
    with pytest.raises(ConfigError, match="no multi-process launch"):
        distributed.initialize("on")


def _jax_detects(monkeypatch, env, metadata=None):
    """jax's own cluster detection on `env` (a second implementation): (coordinator, count, id)."""
    clusters = pytest.importorskip("jax._src.clusters")
    from jax._src.clusters import cloud_tpu_cluster, cluster
    for var in list(__import__("os").environ):
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    on_tpu = metadata is not None or "TPU_WORKER_HOSTNAMES" in env
    for mod in (cluster, cloud_tpu_cluster):
        monkeypatch.setattr(mod, "running_in_cloud_tpu_vm", on_tpu)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata",
                        lambda key: ((metadata or {}).get(key, ""), 200 if key in (metadata or {}) else 404))
    if not on_tpu:
        monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    got = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 5)
    return got[:3]


@pytest.mark.parametrize("case", ["slurm", "ompi", "gke", "gke-multislice", "tpu-vm"])
def test_agrees_with_jax_where_jax_is_right(monkeypatch, case):
    """Coordinator, process count and id match jax's detection; only the local devices differ
    (jax pins every SLURM / Open MPI process to one GPU)."""
    hosts = ",".join(f"10.2.0.{i}" for i in range(2, 6))
    env, meta = {
        "slurm": (slurm(13, 5, 1, 16, "8(x2)", SLURM_GPUS_ON_NODE="8"), None),
        "ompi": ({"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}, None),
        "gke": ({"TPU_WORKER_HOSTNAMES": hosts, "TPU_WORKER_ID": "1"}, None),
        "gke-multislice": ({"TPU_WORKER_HOSTNAMES": hosts, "TPU_WORKER_ID": "3", "MEGASCALE_NUM_SLICES": "3",
                            "MEGASCALE_SLICE_ID": "2", "MEGASCALE_COORDINATOR_ADDRESS": "10.2.0.2:8080"}, None),
        "tpu-vm": ({}, {"worker-network-endpoints": hosts, "agent-worker-number": "2",
                        "tpu-env": "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\n"
                                   "MEGASCALE_COORDINATOR_ADDRESS: '10.2.0.2'\n"}),
    }[case]
    ours = run_detect(env, meta)
    assert (ours.coordinator_address, ours.num_processes, ours.process_id) == _jax_detects(monkeypatch, env, meta)
