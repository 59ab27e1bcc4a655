"""The run directory's small files: URL-aware paths, and metrics.jsonl written the same way
whether appended (local) or rewritten whole (object stores, which cannot append)."""
import json
import os

import pytest

from k3jax.train import rundir


def test_run_dir_keeps_urls_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    assert rundir.run_dir("gs://bucket/runs/", "r1") == "gs://bucket/runs/r1"
    assert rundir.run_dir("s3://b/x", 7) == "s3://b/x/7"
    monkeypatch.chdir(tmp_path)
    assert rundir.run_dir("runs", "r1") == os.path.join(str(tmp_path), "runs", "r1")


def _log(path, keep_through, records, append):
    with rundir.MetricsLog(str(path), keep_through=keep_through, append=append) as m:
        for r in records:
            m.write(r)
    return [json.loads(x) for x in open(path)]


@pytest.mark.parametrize("append", [True, False])
def test_metrics_log_truncates_on_resume_then_adds(tmp_path, append):
    path = tmp_path / "metrics.jsonl"
    first = [{"step": s, "loss": 1.0 / s} for s in (1, 5, 10, 15)]
    assert _log(path, 0, first, append) == first
    # a resume from step 10 drops the lines the lost steps wrote, then logs on
    later = [{"step": 15, "loss": 0.5}, {"step": 20, "loss": 0.25}]
    assert _log(path, 10, later, append) == first[:3] + later
    # a fresh run (no checkpoint) starts the file over
    assert _log(path, 0, [{"step": 1, "loss": 2.0}], append) == [{"step": 1, "loss": 2.0}]


def test_metrics_log_modes_give_identical_files(tmp_path):
    recs = [{"step": s, "loss": s * 0.1, "load_per_layer": {"layers_1": [1.0, 0.5]}} for s in range(1, 6)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _log(a, 0, recs, append=True)
    _log(b, 0, recs, append=False)
    assert a.read_bytes() == b.read_bytes()


def test_url_paths_go_through_epath_rewrites(tmp_path, monkeypatch):
    """The URL branch (epath writes, whole-file rewrites) run on a local directory: every
    path counts as a URL, so nothing is appended or renamed."""
    monkeypatch.setattr(rundir, "is_url", lambda p: True)
    d = f"{tmp_path}/run"
    rundir.make_dirs(d)
    rundir.write_text(f"{d}/config.yaml", "a: 1\n")
    assert open(f"{d}/config.yaml").read() == "a: 1\n"
    m = rundir.MetricsLog(f"{d}/metrics.jsonl", keep_through=0)
    assert not m.append
    m.write({"step": 1, "loss": 3.0})
    m.write({"step": 2, "loss": 2.0})
    m.close()
    assert [json.loads(x)["step"] for x in open(f"{d}/metrics.jsonl")] == [1, 2]
    assert sorted(os.listdir(d)) == ["config.yaml", "metrics.jsonl"]  # no temp files


def test_disabled_log_touches_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    with rundir.MetricsLog(str(path), keep_through=0, enabled=False) as m:
        m.write({"step": 3, "loss": 0.1})
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'


def test_checkpoint_dirs_refuse_urls_by_name():
    """Checkpoint directories use local file APIs: a URL must fail loudly, not become a
    local ./gs:/… directory on every host."""
    from k3jax.checkpoint.convert import convert
    from k3jax.checkpoint.export import export
    from k3jax.checkpoint.load import load_model_dir
    for call in (lambda: convert("/nonexistent-hf", "gs://bucket/k3-orbax"),
                 lambda: export("gs://bucket/k3-orbax", "/tmp/out"),
                 lambda: load_model_dir("gs://bucket/k3-orbax")):
        with pytest.raises(ValueError, match="gcsfuse"):
            call()
    assert not os.path.exists("gs:")
