"""The `k3jax` command as a user runs it."""
import json
import subprocess
import sys

import pytest

from helpers import REFERENCE_CONFIG, need


def k3jax(*args):
    return subprocess.run([sys.executable, "-m", "k3jax.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_params_json_on_the_real_config():
    out = k3jax("params", str(need(REFERENCE_CONFIG)), "--json")
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["total"] == 2_779_484_478_208 and counts["active"] == 104_189_614_848


def test_params_unknown_config_is_a_clear_error():
    out = k3jax("params", "no_such_model")
    assert out.returncode == 2 and "no_such_model" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------
# Bad input ends in one line and exit code 2; anything else keeps its traceback
# ---------------------------------------------------------------------------------------
import numpy as np  # noqa: E402

from helpers import FIXTURES  # noqa: E402
from k3jax import cli  # noqa: E402


def one_line_error(capsys, *argv, code=2) -> str:
    assert cli.main(list(argv)) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_config_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("text_config:\n  hidden_size: 64\n  layers: [1, 2\ntrain: {}\n")
    assert f"{bad}:4:" in one_line_error(capsys, "train", str(bad), "--no-compile-cache")
    (tmp_path / "c.json").write_text('{"vocab_size": 8,\n "hidden_size": }\n')
    assert f"{tmp_path / 'c.json'}:2:" in one_line_error(capsys, "params", str(tmp_path / "c.json"))
    err = one_line_error(capsys, "train", "toy", "--no-compile-cache", "seed=abc", "optimizer.schedule=bogus")
    assert "train.seed: expected an integer, got 'abc'" in err and "'bogus' is not one of 'cosine', 'constant'" in err


def test_existing_output_and_missing_input_are_one_line(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    a = str(FIXTURES / "fixture_a")
    assert "already exists" in one_line_error(capsys, "convert", a, str(tmp_path / "out"))
    t = str(tmp_path / "t.npy")
    assert f"{t}: No such file or directory" in one_line_error(capsys, "logits", a, "--tokens", t, "--out",
                                                               str(tmp_path / "l.npy"))
    np.save(t, np.array([[1, 2]], np.int32))
    assert f"{tmp_path / 'nope'}: no such directory" in one_line_error(
        capsys, "logits", str(tmp_path / "nope"), "--tokens", t, "--out", str(tmp_path / "l.npy"))


def test_token_ids_are_checked_before_any_cast(tmp_path, capsys):
    """2**32 + 5 as int64 would become 5 in int32: refused, naming the file and the id."""
    a = str(FIXTURES / "fixture_a")
    np.save(tmp_path / "big.npy", np.array([[1, 2, 2**32 + 5]], np.int64))
    np.save(tmp_path / "empty.npy", np.zeros((1, 0), np.int32))
    out = str(tmp_path / "l.npy")
    err = one_line_error(capsys, "logits", a, "--tokens", str(tmp_path / "big.npy"), "--out", out)
    assert "big.npy: token id 4294967301 at index [0, 2] is outside the vocabulary" in err
    assert "no token ids" in one_line_error(capsys, "logits", a, "--tokens", str(tmp_path / "empty.npy"), "--out", out)
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    assert "junk.npy: not a readable .npy" in one_line_error(capsys, "logits", a, "--tokens",
                                                             str(tmp_path / "junk.npy"), "--out", out)
    err = one_line_error(capsys, "generate", a, "--prompt-ids", str(tmp_path / "big.npy"), "--max-new-tokens", "1")
    assert "token id 4294967301" in err                    # was an OverflowError traceback
    assert not (tmp_path / "l.npy").exists()


def test_output_paths_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    import k3jax.checkpoint.load as load
    monkeypatch.setattr(load, "load_model_dir", lambda *a, **k: pytest.fail("loaded before checking --out"))
    a = str(FIXTURES / "fixture_a")
    np.save(tmp_path / "ids.npy", np.array([[1, 2]], np.int32))
    missing = tmp_path / "no" / "such"
    err = one_line_error(capsys, "generate", a, "--prompt-ids", str(tmp_path / "ids.npy"), "--out", str(missing / "g.json"))
    assert f"{missing}: output folder does not exist" in err
    err = one_line_error(capsys, "logits", a, "--tokens", str(tmp_path / "ids.npy"), "--out", str(missing / "l"))
    assert f"{missing}: output folder does not exist" in err
    err = one_line_error(capsys, "generate", a, "--prompt-ids", str(tmp_path / "ids.npy"), "--out", str(tmp_path))
    assert f"{tmp_path}: is a directory" in err


def test_unexpected_exceptions_keep_their_traceback(monkeypatch):
    import k3jax.commands.params as params
    monkeypatch.setattr(params, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["params", "toy"])


def test_disk_errors_read_as_one_line():
    import errno
    assert cli.one_line(OSError(errno.ENOSPC, "No space left on device", "/data/out")) == \
        "/data/out: No space left on device"
    assert cli.one_line(OSError(errno.EIO, "Input/output error")) is None     # not the user's to fix
    assert cli.one_line(RuntimeError("bug")) is None


def test_a_killed_converts_temporary_directory_is_removed(tmp_path, capsys):
    import os
    import socket
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    stale = tmp_path / f".out.tmp-{socket.gethostname()}-{p.pid}-abc123"
    live = tmp_path / f".out.tmp-{socket.gethostname()}-{os.getpid()}-def456"   # a writer still running
    for d in (stale, live):
        (d / "params").mkdir(parents=True)
    assert cli.main(["convert", str(FIXTURES / "fixture_a"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert f"removed {stale}" in capsys.readouterr().out
    assert not stale.exists() and live.exists() and (tmp_path / "out" / "k3jax_checkpoint.json").exists()


def test_a_missing_optional_package_names_its_extra(monkeypatch):
    import sys

    from k3jax.errors import K3JaxError, MissingDependency
    from k3jax.tokenizer import TiktokenTokenizer
    monkeypatch.setitem(sys.modules, "tiktoken", None)       # as if not installed
    with pytest.raises(MissingDependency, match=r"pip install 'k3jax\[tokenizer\]'") as e:
        TiktokenTokenizer("tiktoken.model", vocab_size=10, bos_id=1, eos_id=2)
    assert isinstance(e.value, ImportError) and isinstance(e.value, K3JaxError)


def test_chat_input_errors_are_one_line(tmp_path, capsys):
    rows = tmp_path / "chat.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": 3}\n')
    err = one_line_error(capsys, "render-chat", str(rows))
    assert f"{rows}:2" in err and "non-empty 'messages' list" in err
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}\n')
    assert "no tool name" in one_line_error(capsys, "render-chat", str(rows))
    msgs = tmp_path / "m.json"
    msgs.write_text('[{"role": "user",\n "content": }]')
    err = one_line_error(capsys, "generate", str(FIXTURES / "fixture_a"), "--messages", str(msgs))
    assert f"--messages {msgs}: not valid JSON" in err and "line 2" in err


@pytest.mark.parametrize("argv,said", [
    (["forward", "toy", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["forward", "toy", "--seq", "abc"], "argument --seq: expected an integer, got 'abc'"),
    (["generate", "toy", "--top-p", "0"], "argument --top-p: must be > 0 and <= 1, got 0"),
    (["generate", "toy", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    (["generate", "toy", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["render-chat", "x.jsonl", "--limit", "0"], "argument --limit: must be >= 1, got 0"),
    (["render-chat", "x.jsonl", "--limit", "-1"], "argument --limit: must be >= 1, got -1"),
    (["export", "a", "b", "--max-shard-gb", "0"], "argument --max-shard-gb: must be > 0, got 0"),
    (["plan", "toy", "--mesh", "data8", "--ep-buffer-mib", "-1"], "argument --ep-buffer-mib: must be >= 0, got -1"),
])
def test_numeric_flags_are_range_checked(argv, said, capsys):
    """A number out of range is argparse's usage error naming the flag and the range (exit 2)
    before anything loads: not a silent default (`--limit 0` showed everything) or a traceback."""
    from k3jax.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_disk_errors_while_writing_name_the_output(tmp_path, capsys, monkeypatch):
    """convert and export on a full disk (an OSError without a file name, or tensorstore's
    ValueError naming a chunk of a temporary folder) end as one line naming the output they
    were writing; any other error keeps its traceback."""
    import errno

    from k3jax.commands import atomic_write, writing
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/x/.o.tmp/params/a/0.0.0": Failed '
                             "to write 16384 bytes to file 5: No space left on device [os_error_code='28']")
    for raised, code in ((OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC), (tensorstore, errno.ENOSPC),
                         (ValueError("Disk quota exceeded [os_error_code='122']"), errno.EDQUOT),
                         (OSError(errno.EROFS, "Read-only file system"), errno.EROFS)):
        with pytest.raises(OSError) as e, writing(tmp_path / "out"):
            raise raised
        assert (e.value.errno, e.value.filename) == (code, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="a bug"), writing(tmp_path / "out"):
        raise ValueError("a bug")
    # logits and vision-features write through atomic_write: the output named, no temporary left
    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as e:
        atomic_write(str(tmp_path / "logits.npy"), full)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "logits.npy"))
    assert cli.one_line(e.value) == f"{tmp_path / 'logits.npy'}: No space left on device"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".logits")]
    from k3jax.checkpoint import convert as conv
    monkeypatch.setattr(conv, "convert", lambda *a, **k: (_ for _ in ()).throw(tensorstore))
    assert cli.main(["convert", str(tmp_path), str(tmp_path / "orbax")]) == 2
    assert capsys.readouterr().err.strip() == f"k3jax convert: error: {tmp_path / 'orbax'}: No space left on device"
