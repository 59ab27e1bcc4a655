"""A training run is a model directory: every command that takes one takes the run directory
(its newest checkpoint) or one of its checkpoints/N, reading only the params.

One tiny run (one KDA + MoE layer, bf16 params, 4 steps, checkpoints at 2 and 4) is
trained once per module, by `k3jax train` as a user runs it; the reference for its params is Orbax's own restore of the whole saved TrainState,
and for its logits and samples `model.forward` / a greedy loop of full forwards on those."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from k3jax import cli
from k3jax.testing.variants import write_variant

from helpers import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = {"steps": 4, "log_every": 2, "ckpt_every": 2, "keep": 10, "sample_tokens": 0, "peak_tflops": 1.0,
         "data": {"path": os.path.join(ROOT, "data", "corpus.txt"), "seq_len": 32, "batch_size": 2},
         "optimizer": {"warmup_steps": 2}}


def train(cfg, *overrides, cache, timeout=600):
    """`k3jax train` in a subprocess; one XLA cache per test session, so one compile."""
    env = dict(os.environ, K3JAX_COMPILE_CACHE=str(cache), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    return subprocess.run([sys.executable, "-m", "k3jax.cli", "train", cfg, *overrides], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    cfg = write_variant(str(d / "tiny.yaml"), layers=("kda",), first_k_dense_replace=0, train=TRAIN)
    cache = tmp_path_factory.getbasetemp() / "xla"
    r = train(cfg, f"output_dir={d}", "run_name=r", "runtime.param_dtype=bfloat16", cache=cache)
    assert r.returncode == 0, r.stdout + r.stderr
    return SimpleNamespace(dir=d / "r", config=cfg, log=r.stdout.splitlines(), root=d, cache=cache)


def saved_params(run_dir, step):
    """The params of a checkpoint as Orbax itself restores the whole TrainState."""
    with ocp.StandardCheckpointer() as c:
        state = c.restore(os.path.join(run_dir, "checkpoints", str(step), "default"))
    return jax.tree.map(np.asarray, state["params"])


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_a_run_and_its_checkpoints_load_as_model_directories(run):
    from k3jax.mesh import load_mesh
    from k3jax.model import param_shardings
    from k3jax.checkpoint.load import load_model_dir, resolve
    from k3jax.errors import K3JaxError

    assert (resolve(run.dir).kind, resolve(run.dir).step) == ("run", 4)
    assert resolve(run.dir / "checkpoints").step == 4
    assert resolve(run.dir / "checkpoints" / "2").step == 2
    # a write in progress (Orbax's temporary name) is not a checkpoint
    (run.dir / "checkpoints" / "6.orbax-checkpoint-tmp-123").mkdir()
    try:
        assert resolve(run.dir).step == 4
        with pytest.raises(K3JaxError, match="not a checkpoint step"):
            resolve(run.dir / "checkpoints" / "6.orbax-checkpoint-tmp-123")
    finally:
        (run.dir / "checkpoints" / "6.orbax-checkpoint-tmp-123").rmdir()

    k3, params = load_model_dir(run.dir)                 # the run's own dtypes: bf16 matrices
    assert k3.text.runtime.param_dtype == "bfloat16"
    assert_trees_equal(params, saved_params(run.dir, 4))
    _, p2 = load_model_dir(run.dir / "checkpoints" / "2")
    assert_trees_equal(p2, saved_params(run.dir, 2))
    assert not np.array_equal(np.asarray(p2["embed_tokens"]["embedding"]),
                              np.asarray(params["embed_tokens"]["embedding"]))

    # restored straight onto a mesh: each leaf has the shardings the rules give it
    mesh, rules = load_mesh("data2_fsdp2_expert2")
    want = param_shardings(k3.text, mesh, rules)
    _, sharded = load_model_dir(run.dir, shardings=lambda c: param_shardings(c, mesh, rules))
    for x, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(want)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    assert_trees_equal(jax.tree.map(np.asarray, sharded), saved_params(run.dir, 4))


def reference_logits(run, tokens):
    from k3jax.checkpoint.load import load_config
    from k3jax.model import forward
    cfg = load_config(run.dir, {"param_dtype": "float32", "dtype": "float32"}).text
    p32 = jax.tree.map(lambda x: x.astype(np.float32), saved_params(run.dir, 4))
    return cfg, p32, np.asarray(forward(cfg, p32, tokens), np.float32)


@pytest.mark.slow
def test_logits_generate_and_export_of_a_run(run, tmp_path, capsys):
    from helpers import greedy_full_forward

    tokens = np.array([[256, 84, 104, 101, 32, 114, 105]], np.int32)
    np.save(tmp_path / "ids.npy", tokens)
    assert cli.main(["logits", str(run.dir), "--tokens", str(tmp_path / "ids.npy"),
                     "--out", str(tmp_path / "run.npy")]) == 0
    cfg, p32, ref = reference_logits(run, tokens)
    np.testing.assert_allclose(np.load(tmp_path / "run.npy"), ref, rtol=0, atol=1e-5)

    # export keeps every value: bf16 matrices as bf16, the release's fp32 tensors and the
    # model's fp32 norms as fp32; the exported directory gives the run's logits
    assert cli.main(["export", str(run.dir), str(tmp_path / "hf")]) == 2       # no MXFP4 config
    assert "--experts-bf16" in capsys.readouterr().err
    # --merge-lora on a run without LoRA says that first, whatever the expert format
    assert cli.main(["export", str(run.dir), str(tmp_path / "hf"), "--merge-lora"]) == 2
    assert "--merge-lora needs a LoRA run" in capsys.readouterr().err
    assert cli.main(["export", str(run.dir), str(tmp_path / "hf"), "--experts-bf16"]) == 0
    out = capsys.readouterr().out
    assert "from run" in out and "at step 4" in out and "no dtype casts" in out, out
    saved = saved_params(run.dir, 4)
    from k3jax.checkpoint.names import tensor_map
    from k3jax.checkpoint.safetensors_io import ShardedCheckpoint
    ckpt = ShardedCheckpoint(tmp_path / "hf")
    n_fp32 = 0
    for e in tensor_map(cfg, "k3"):
        leaf = saved
        for k in e.path:
            leaf = leaf[k]
        name = f"{e.hf}.weight" if e.is_expert else e.hf
        assert ckpt.info(name)[0] == {"bfloat16": "BF16", "float32": "F32"}[leaf.dtype.name], name
        n_fp32 += leaf.dtype == np.float32 and not e.hf.endswith(("A_log", "dt_bias", "conv1d.weight",
                                                                     "o_norm.weight", "e_score_correction_bias"))
    ckpt.close()
    assert f"kept fp32: {n_fp32} tensor(s)" in out, out
    assert cli.main(["logits", str(tmp_path / "hf"), "--tokens", str(tmp_path / "ids.npy"),
                     "--out", str(tmp_path / "hf.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "hf.npy"), np.load(tmp_path / "run.npy"), rtol=0, atol=1e-5)

    # greedy generation from the run continues as full forwards of the saved params do
    assert cli.main(["generate", str(run.dir), "--prompt", "The ", "--max-new-tokens", "3", "--no-eos-stop",
                     "--dtype", "float32", "--out", str(tmp_path / "gen.json")]) == 0
    got = json.loads((tmp_path / "gen.json").read_text())
    prompt = got["prompt_ids"][0]
    assert prompt == [256] + list(b"The ")
    assert got["generated_ids"][0] == greedy_full_forward(cfg, p32, prompt, 3, cfg.pad_token_id)


@pytest.mark.slow
def test_init_from_a_run_and_config_commands(run, capsys):
    from k3jax.config import load
    from k3jax.train import config as tconf
    from k3jax.train.loop import _initial_params

    tc = tconf.resolve({}, {"init_from": str(run.dir), "runtime": {"param_dtype": "bfloat16"}})
    cfg = load(run.config).with_runtime(**tc["runtime"])
    assert_trees_equal(jax.tree.map(np.asarray, _initial_params(cfg, tc, key=None)), saved_params(run.dir, 4))

    assert cli.main(["params", str(run.dir), "--json"]) == 0
    from_run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli.main(["params", run.config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == from_run

    assert cli.main(["plan", str(run.dir), "--mesh", "data8", "--hbm-gib", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["params"] == from_run["total"]
    assert cli.main(["forward", str(run.dir / "checkpoints" / "2"), "--batch", "1", "--seq", "8",
                     "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    n = sum(x.size for x in jax.tree.leaves(saved_params(run.dir, 2)))   # count_params adds K3's A_log padding
    assert f"loaded {run.dir / 'checkpoints' / '2'}: {n:,d} params" in out and "finite=True" in out

    # the main job's last lines say what to run next, on this run
    tail = "\n".join(run.log[-5:])
    for cmd in ("k3jax generate", "k3jax logits", "k3jax export", "init_from="):
        assert cmd in tail and str(run.dir.name) in tail, tail
    assert "--experts-bf16" in tail   # the toy config has no MXFP4 experts to write


@pytest.mark.slow
def test_vision_features_from_a_conversion_and_not_from_a_run(run, tmp_path, capsys):
    """vision-features reads a convert output's vision/ tree like the HF files; a run (text
    model only) is refused in one line."""
    from helpers import rel_l2, two_shard_multimodal_checkpoint
    from k3jax.checkpoint.convert import convert

    src, _, v = two_shard_multimodal_checkpoint(tmp_path / "hf")
    convert(src, tmp_path / "orbax")
    args = ["--pixels", str(v / "pixel_values.npy"), "--grids", str(v / "grid_thws.npy")]
    assert cli.main(["vision-features", str(tmp_path / "orbax"), *args, "--out", str(tmp_path / "f.npy")]) == 0
    assert rel_l2(np.load(tmp_path / "f.npy"), np.load(v / "features.npy")) <= 1e-5

    assert cli.main(["vision-features", str(run.dir), *args, "--out", str(tmp_path / "g.npy")]) == 2
    err = capsys.readouterr().err
    assert "no vision_config" in err or "no vision weights" in err, err
    assert not (tmp_path / "g.npy").exists()


# ---------------------------------------------------------------------------------------
# A guarded run directory
# ---------------------------------------------------------------------------------------
def copy_run(run, tmp_path, name="r"):
    import shutil
    shutil.copytree(run.dir, tmp_path / name)
    return tmp_path / name


def metrics(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))}


def test_a_second_train_on_a_live_run_is_refused_at_once(run, tmp_path, capsys):
    from k3jax.train.rundir import RunLock
    r = copy_run(run, tmp_path)
    (r / "checkpoints" / "4").rename(tmp_path / "moved")      # so that there is training left to do
    before = {f: (r / f).read_bytes() for f in ("metrics.jsonl", "config.yaml")}
    with RunLock(str(r)):                                     # a live run: this process
        assert cli.main(["train", run.config, "--no-compile-cache", f"output_dir={tmp_path}", "run_name=r",
                         "runtime.param_dtype=bfloat16"]) == 2
    err = capsys.readouterr().err
    assert f"in use by pid {os.getpid()}" in err and len(err.strip().splitlines()) == 1, err
    assert {f: (r / f).read_bytes() for f in before} == before    # the live run's files untouched


@pytest.mark.slow
def test_resume_takes_over_a_stale_lock_and_trims_a_torn_metrics_line(run, tmp_path):
    """What kill -9 leaves (a lock whose pid is gone, a half-written metrics line) does not
    block the rerun, which then logs what the uninterrupted run logged."""
    import socket
    r = copy_run(run, tmp_path)
    import shutil
    shutil.rmtree(r / "checkpoints" / "4")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (r / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0,
                                            "heartbeat": 0}))
    with open(r / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.2')                    # torn by the kill
    out = train(run.config, f"output_dir={tmp_path}", "run_name=r", "runtime.param_dtype=bfloat16",
                cache=run.cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "taking over the stale lock" in out.stdout and "dropping a torn last line" in out.stdout
    assert "resumed from step 2" in out.stdout
    want = metrics(run.dir)
    got = metrics(r)
    assert got[4] == want[4] and set(got) == set(want) | {3}   # step 3: the first step after resume is logged
    assert not (r / "run.lock").exists()


def test_resuming_with_another_config_is_refused_naming_the_keys(run, tmp_path, capsys):
    r = copy_run(run, tmp_path)
    (r / "checkpoints" / "4").rename(tmp_path / "moved")
    before = (r / "config.yaml").read_bytes()
    other = write_variant(str(tmp_path / "wide.yaml"), layers=("kda",), first_k_dense_replace=0,
                          hidden_size=32, train=TRAIN)
    base = ["--no-compile-cache", f"output_dir={tmp_path}", "run_name=r", "runtime.param_dtype=bfloat16"]
    for cfg, extra, named in ((other, [], "text_config.hidden_size: 64 -> 32"),
                              (run.config, ["data.seq_len=64"], "train.data.seq_len: 32 -> 64"),
                              (run.config, ["seed=3"], "train.seed: 0 -> 3"),
                              (run.config, ["steps=8"], "train.steps: 4 -> 8")):
        assert cli.main(["train", cfg, *base, *extra]) == 2
        err = capsys.readouterr().err
        assert named in err and "refusing to resume" in err and len(err.strip().splitlines()) == 1, err
    assert "init_from=" in err                                # the way to train on
    assert (r / "config.yaml").read_bytes() == before


def test_a_run_with_nothing_to_do_leaves_its_config(run, tmp_path, capsys):
    r = copy_run(run, tmp_path)
    before = (r / "config.yaml").read_bytes()
    assert cli.main(["train", run.config, "--no-compile-cache", f"output_dir={tmp_path}", "run_name=r",
                     "runtime.param_dtype=bfloat16", "optimizer.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "init_from=" in out
    assert (r / "config.yaml").read_bytes() == before         # still describes the checkpoints


@pytest.mark.slow
def test_a_full_disk_stops_training_at_the_failed_checkpoint(run, tmp_path):
    """A real full disk: a 1.5 MB tmpfs holds one checkpoint of the tiny run, not two."""
    d = tmp_path / "small"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out = train(run.config, f"output_dir={d}", "run_name=r", "runtime.param_dtype=bfloat16", "steps=12",
                    cache=run.cache)
        assert out.returncode == 2, out.stdout + out.stderr
        err = out.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert "No space left on device" in err and "Last good checkpoint: step 2" in err, err
        assert max(metrics(d / "r")) < 12                         # it stopped
    finally:
        subprocess.run(["umount", str(d)])


@pytest.mark.slow
def test_a_streamed_run_resumes_exactly(run, tmp_path):
    """data.loader: grain saves each checkpoint's stream position; resuming the step-2
    checkpoint logs the uninterrupted run's losses (same compiled step as the fixture's)."""
    import shutil
    args = ["runtime.param_dtype=bfloat16", "data.loader=grain", "data.shuffle_window=8"]
    first = train(run.config, f"output_dir={tmp_path}", "run_name=g", *args, cache=run.cache)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "streamed from 1 file(s)" in first.stdout
    g = tmp_path / "g"
    assert sorted(os.listdir(g / "data_state")) == sorted(os.listdir(g / "checkpoints")) == ["2", "4"]
    shutil.copytree(g, tmp_path / "g2")
    shutil.rmtree(tmp_path / "g2" / "checkpoints" / "4")
    shutil.rmtree(tmp_path / "g2" / "data_state" / "4")
    again = train(run.config, f"output_dir={tmp_path}", "run_name=g2", *args, cache=run.cache)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 2" in again.stdout
    want, got = metrics(g), metrics(tmp_path / "g2")
    assert got[4] == want[4] and got[3] is not None
