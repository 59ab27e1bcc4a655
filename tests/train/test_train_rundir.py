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


# ---------------------------------------------------------------------------------------
# The lock: one run per directory
# ---------------------------------------------------------------------------------------
def _dead_pid() -> int:
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _write_lock(d, **rec):
    (d / "run.lock").write_text(json.dumps(rec))


def test_lock_refuses_a_live_holder_and_names_it(tmp_path):
    import socket

    from k3jax.errors import RunDirError
    with rundir.RunLock(str(tmp_path)):
        held = json.loads((tmp_path / "run.lock").read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()} on host {socket.gethostname()}"):
            rundir.RunLock(str(tmp_path)).acquire()
    assert not (tmp_path / "run.lock").exists()             # released
    # another host's lock with a fresh heartbeat may be alive: refused, naming the file to delete
    import time
    _write_lock(tmp_path, pid=1, host="elsewhere", started=time.time(), heartbeat=time.time())
    with pytest.raises(RunDirError, match=f"delete {tmp_path}/run.lock"):
        rundir.RunLock(str(tmp_path)).acquire()


def test_stale_locks_are_taken_over_with_a_warning(tmp_path):
    import socket
    import time
    warnings = []
    for rec in ({"pid": _dead_pid(), "host": socket.gethostname(), "started": 0, "heartbeat": time.time()},
                {"pid": 1, "host": "elsewhere", "started": 0, "heartbeat": time.time() - 2 * rundir.STALE_S}):
        _write_lock(tmp_path, **rec)
        with rundir.RunLock(str(tmp_path), log=warnings.append):
            assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert len(warnings) == 2 and "is gone" in warnings[0] and "no heartbeat" in warnings[1]


# ---------------------------------------------------------------------------------------
# metrics.jsonl after a crash
# ---------------------------------------------------------------------------------------
def test_a_torn_last_metrics_line_is_trimmed_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 4, "lo')   # the crash
    warnings = []
    with rundir.MetricsLog(str(path), keep_through=3, log=warnings.append) as m:
        m.write({"step": 4, "loss": 0.2})
    assert [json.loads(x) for x in open(path)] == good + [{"step": 4, "loss": 0.2}]
    assert len(warnings) == 1 and f"{path}:4: dropping a torn last line" in warnings[0]


def test_an_unreadable_middle_metrics_line_names_file_and_line(tmp_path):
    from k3jax.errors import RunDirError
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\nnot json\n{"step": 3, "loss": 0.5}\n')
    before = path.read_text()
    with pytest.raises(RunDirError, match=f"{path}:2: not a metrics record"):
        rundir.MetricsLog(str(path), keep_through=3)
    assert path.read_text() == before                      # nothing replaced


def test_metrics_file_is_not_rewritten_when_nothing_is_dropped(tmp_path):
    """Opened for a resume at its last step, the file is only appended to (same inode)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    inode = path.stat().st_ino
    with rundir.MetricsLog(str(path), keep_through=2) as m:
        m.write({"step": 3, "loss": 0.25})
    assert path.stat().st_ino == inode and len(path.read_text().splitlines()) == 3


def test_unfinished_checkpoint_writes_are_removed(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "2" / "default").mkdir(parents=True)
    (ck / "4.orbax-checkpoint-tmp" / "default").mkdir(parents=True)
    (ck / "6.orbax-checkpoint-tmp-1712345").mkdir()
    log = []
    assert rundir.remove_unfinished_checkpoints(str(ck), log.append) == ["4.orbax-checkpoint-tmp",
                                                                        "6.orbax-checkpoint-tmp-1712345"]
    assert sorted(os.listdir(ck)) == ["2"] and len(log) == 2


def test_storage_errors_are_told_from_bugs():
    import errno
    assert rundir.is_storage_error(OSError(errno.ENOSPC, "No space left on device"))
    # what tensorstore raises inside Orbax on a full disk
    e = ValueError("RESOURCE_EXHAUSTED: Error writing \"x\" in OCDBT database: Failed to write 311730 bytes "
                   "to file 15: No space left on device [os_error_code='28']")
    assert rundir.is_storage_error(e) and rundir.storage_reason(e) == "No space left on device"
    assert not rundir.is_storage_error(ValueError("shapes (3,) and (4,) do not match"))
    assert not rundir.is_storage_error(TypeError("No space left"))


def test_data_states_follow_the_kept_checkpoints(tmp_path):
    from k3jax.errors import RunDirError
    for step in (2, 4, 6):
        rundir.write_data_state(str(tmp_path), step, 0, {"next_step": step})
    rundir.prune_data_state(str(tmp_path), {4, 6})
    assert sorted(os.listdir(tmp_path / "data_state")) == ["4", "6"]
    assert rundir.read_data_state(str(tmp_path), 6, 0) == {"next_step": 6}
    with pytest.raises(RunDirError, match="process_1.json: missing"):
        rundir.read_data_state(str(tmp_path), 6, 1)


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """A full disk when the lock is written: the error propagates (the CLI names the path) and
    no empty run.lock stays to refuse the next run once space is freed."""
    import errno
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run.lock"))

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(rundir.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space left"):
        rundir.RunLock(str(tmp_path)).acquire()
    assert not (tmp_path / "run.lock").exists()
    monkeypatch.setattr(rundir.os, "fdopen", real_fdopen)
    with rundir.RunLock(str(tmp_path)):              # space freed: the next run takes the lock at once
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_a_refused_start_leaves_no_directory(tmp_path, capsys):
    """A run that stops before its first checkpoint or metrics line (here: data that is not
    UTF-8) removes the folders it created; an existing output folder is left as it was."""
    from k3jax.cli import main
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"one\n\ntwo \xff three\n")
    for out, made in ((tmp_path / "new" / "runs", tmp_path / "new"), (tmp_path, tmp_path / "toy")):
        assert main(["train", "toy", f"data.path={bad}", f"output_dir={out}", "steps=1"]) == 2
        assert "not UTF-8 text" in capsys.readouterr().err
        assert not made.exists() and tmp_path.exists() and bad.exists()
