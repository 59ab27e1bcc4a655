"""The run directory's own small files (config.yaml, metrics.jsonl, run.lock), local or remote.

`{output_dir}/{run_name}` may be a local path or a URL such as gs://bucket/runs: pod hosts
have no shared local disk, and Orbax writes checkpoints to either natively. The small files
go through etils.epath, which reaches gs:// through gcsfs (or tensorflow) when installed.
Object stores cannot append, so for a URL metrics.jsonl is rewritten whole at each logging
step (it holds one short line per logged step); a local file is appended to and flushed.

One run at a time: `RunLock` holds `run.lock` (pid, host, start, heartbeat) while a
`k3jax train` uses the directory, so a second one is refused naming the holder before it
touches anything. A lock is stale, and taken over with a warning, when its pid is gone on
this host, or when its heartbeat (rewritten every `HEARTBEAT_S`) is older than `STALE_S`
on another host. On a local disk the lock is created atomically (O_EXCL); an object store
has no such operation, so there two runs started within the same second can both pass.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time

from etils import epath

from k3jax.checkpoint.dirs import RUN_CONFIG, RUN_DATA_STATE, RUN_LOCK, RUN_METRICS, is_url, pid_alive
from k3jax import textfiles
from k3jax.errors import RunDirError

HEARTBEAT_S = 30.0
STALE_S = 600.0


def run_dir(output_dir, run_name) -> str:
    """`{output_dir}/{run_name}`: absolute for a local path, verbatim for a URL (abspath
    would turn gs://b/x into ./gs:/b/x, a local directory on every host)."""
    if is_url(output_dir):
        return f"{str(output_dir).rstrip('/')}/{run_name}"
    return os.path.abspath(os.path.join(output_dir, str(run_name)))


def make_dirs(path: str):
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def first_missing(path: str) -> str | None:
    """The outermost folder of `path` that does not exist yet (what make_dirs will create)."""
    p, top = epath.Path(path), None
    while not p.exists() and p.parent != p:
        p, top = p.parent, p
    return None if top is None else str(top)


def remove_if_nothing_saved(path: str, created: str, checkpoints: list[int]) -> None:
    """Remove `created` (the folders a run made for its directory `path`) when the run ended
    before any checkpoint and any metrics line: a refused or failed start leaves nothing behind."""
    metrics = epath.Path(path) / RUN_METRICS
    if not checkpoints and not (metrics.exists() and metrics.read_text().strip()) and epath.Path(created).exists():
        epath.Path(created).rmtree()


def write_text(path: str, text: str):
    """Replace a whole file so that no reader sees it half written: locally through a
    temporary file and a rename; an object in a store is replaced atomically anyway."""
    if is_url(path):
        epath.Path(path).write_text(text)
        return
    textfiles.atomic_write(path, lambda f: f.write(text.encode()))


class RunLock:
    """`run.lock` in a run directory, held from `acquire()` to `release()` (or the `with`
    block). `log` receives the warning when a stale lock is taken over."""

    def __init__(self, directory: str, log=print):
        self.path = f"{str(directory).rstrip('/')}/{RUN_LOCK}"
        self.log = log
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = None

    def _record(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "started": self.started, "heartbeat": time.time()})

    def _create(self) -> bool:
        """Create the lock file if none exists; False when one does."""
        if is_url(self.path):
            p = epath.Path(self.path)
            if p.exists():
                return False
            p.write_text(self._record())
            return True
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self._record())
        except BaseException:      # a full disk: no empty lock left to refuse the next run
            os.remove(self.path)
            raise
        return True

    def holder(self) -> dict | None:
        """The lock's record, {} when it cannot be read (a torn write), None when absent."""
        p = epath.Path(self.path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            return None
        try:
            rec = json.loads(text)
            return rec if isinstance(rec, dict) else {}
        except json.JSONDecodeError:
            return {}

    def _stale(self, rec: dict) -> str | None:
        """Why the lock `rec` is stale, or None when its holder may still run."""
        if rec.get("host") == self.host and isinstance(rec.get("pid"), int):
            return None if pid_alive(rec["pid"]) else f"pid {rec['pid']} is gone"
        age = time.time() - float(rec.get("heartbeat") or 0)
        return f"no heartbeat for {age:.0f} s" if age > STALE_S else None

    def _unreadable(self) -> str | None:
        """An unreadable lock is a torn write: stale once it is old, else being written."""
        try:
            age = time.time() - float(epath.Path(self.path).stat().mtime)
        except (OSError, AttributeError):
            age = STALE_S
        return f"its record is unreadable, {age:.0f} s old" if age > 10 else None

    def acquire(self) -> "RunLock":
        for _ in range(3):
            if self._create():
                break
            rec = self.holder()
            if rec is None:        # released between our attempt and the read
                continue
            why = self._stale(rec) if rec else self._unreadable()
            if why is None and not rec:
                raise RunDirError(f"{self.path}: another run is creating this lock; try again in a few seconds")
            if why is None:
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec.get("started") or 0)))
                raise RunDirError(
                    f"{os.path.dirname(self.path)} is in use by pid {rec.get('pid')} on host {rec.get('host')} "
                    f"(since {since}, heartbeat {time.time() - float(rec.get('heartbeat') or 0):.0f} s ago); "
                    f"wait for it to finish or pass another run_name=. If that process is gone, delete {self.path}")
            self.log(f"warning: taking over the stale lock {self.path} ({why}; held by pid {rec.get('pid')} "
                     f"on host {rec.get('host')})")
            self._remove_if(rec)
        else:
            raise RunDirError(f"{self.path}: could not take the lock (another run keeps taking it)")
        self._thread = threading.Thread(target=self._beat, name="k3jax-run-lock", daemon=True)
        self._thread.start()
        return self

    def _remove_if(self, rec: dict) -> None:
        """Remove the lock file if it still holds `rec` (a peer may have taken it over)."""
        if self.holder() == rec:
            try:
                epath.Path(self.path).unlink()
            except FileNotFoundError:
                pass

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (self.holder() or {}).get("pid") == self.pid:
                    write_text(self.path, self._record())
            except OSError:          # a full disk: the lock stays, its heartbeat ages
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        rec = self.holder()
        if rec and rec.get("pid") == self.pid and rec.get("host") == self.host:
            self._remove_if(rec)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class MetricsLog:
    """metrics.jsonl, one JSON object per logged step.

    Opening it keeps only the lines of steps <= `keep_through` (the step a run resumes
    from; 0 for a fresh run), so after a resume the file reads as one uninterrupted run;
    the file is rewritten only when that drops a line. A torn last line (what a crash or a
    full disk leaves) is dropped with a warning to `log`; any other unreadable line is an
    error naming the file and line. `enabled=False` (processes other than 0) neither reads
    nor writes. `append` defaults to True for local paths and False (rewrite whole) for URLs.
    """

    def __init__(self, path: str, keep_through: int, enabled: bool = True, append: bool | None = None, log=print):
        self.path, self.enabled = path, enabled
        self.append = (not is_url(path)) if append is None else append
        self._lines: list[str] = []
        self._file = None
        if not enabled:
            return
        p = epath.Path(path)
        if p.exists():
            text = p.read_text()
            records = _parse_metrics(path, text.splitlines(), log)
            self._lines = [json.dumps(r) + "\n" for r in records if r["step"] <= keep_through]
            if "".join(self._lines) != text:    # untouched unless a line goes
                write_text(path, "".join(self._lines))
        if self.append:
            self._file = open(path, "a")

    def write(self, record: dict):
        if not self.enabled:
            return
        line = json.dumps(record) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        else:
            self._lines.append(line)
            write_text(self.path, "".join(self._lines))

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _parse_metrics(path: str, lines: list[str], log) -> list[dict]:
    records = []
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    for i, (n, line) in enumerate(numbered):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as e:
            if i == len(numbered) - 1:
                log(f"warning: {path}:{n}: dropping a torn last line ({len(line)} bytes, {e})")
                break
            raise RunDirError(f"{path}:{n}: not a metrics record ({e}); fix or remove that line") from None
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------
# config.yaml: read back, compared on resume, written when a checkpoint is
# ---------------------------------------------------------------------------------------
def read_run_config(directory: str) -> dict | None:
    """The run's config.yaml as a dict (None when there is none); YAML errors name file:line."""
    from k3jax.config import ConfigError
    from k3jax.configfiles import parse_yaml
    path = f"{str(directory).rstrip('/')}/{RUN_CONFIG}"
    p = epath.Path(path)
    if not p.exists():
        return None
    d = parse_yaml(p.read_text(), path)
    if not isinstance(d, dict) or not isinstance(d.get("train"), dict):
        raise ConfigError(f"{path}: not a run config (a mapping with a train: section)")
    return d


def write_run_config(directory: str, k3, tc: dict) -> None:
    import yaml
    write_text(f"{str(directory).rstrip('/')}/{RUN_CONFIG}",
               yaml.safe_dump({**k3.to_hf(), "train": tc}, sort_keys=False))


def model_conflicts(saved, new) -> list[str]:
    """Architecture keys (ModelConfig / VisionConfig fields) on which two K3Configs differ."""
    import dataclasses
    out = []
    for where, a, b in (("text_config", saved.text, new.text), ("vision_config", saved.vision, new.vision)):
        if (a is None) != (b is None):
            out.append(f"{where}: {'absent' if a is None else 'present'} -> {'absent' if b is None else 'present'}")
            continue
        if a is None:
            continue
        for f in dataclasses.fields(a):
            if f.compare and f.name != "runtime" and getattr(a, f.name) != getattr(b, f.name):
                out.append(f"{where}.{f.name}: {getattr(a, f.name)!r} -> {getattr(b, f.name)!r}")
    return out


def check_resume(directory: str, k3, tc: dict, log=print) -> None:
    """Refuse to resume the checkpoints in `directory` with a config that would make them
    another run: a different model, data stream, seed, or (cosine schedule) steps."""
    from k3jax.config import K3Config
    from k3jax.train.config import resume_conflicts

    saved = read_run_config(directory)
    if saved is None:
        log(f"warning: {directory} has checkpoints but no {RUN_CONFIG}; resuming without checking the config")
        return
    train = saved.pop("train")
    conflicts = model_conflicts(K3Config.from_hf(saved), k3) + resume_conflicts(train, tc)
    if conflicts:
        more = ""
        if any(c.startswith("train.steps") for c in conflicts):
            more = (f" To train on, start a new run from its weights: init_from={directory} run_name=NEW "
                    f"steps=N (a fresh optimizer and schedule).")
        raise RunDirError(f"{directory}: its checkpoints were trained with a different config; refusing to "
                          f"resume: {'; '.join(conflicts)}. Pass another run_name= for a new run.{more}")


# ---------------------------------------------------------------------------------------
# A streamed loader's state, one file per process and checkpoint
# ---------------------------------------------------------------------------------------
def _data_state_path(directory: str, step: int, process: int) -> str:
    return f"{str(directory).rstrip('/')}/{RUN_DATA_STATE}/{step}/process_{process}.json"


def write_data_state(directory: str, step: int, process: int, state: dict) -> None:
    """Written before the checkpoint of `step` is saved: a checkpoint never lacks it."""
    path = _data_state_path(directory, step, process)
    make_dirs(path.rsplit("/", 1)[0])
    write_text(path, json.dumps(state))


def read_data_state(directory: str, step: int, process: int) -> dict:
    path = _data_state_path(directory, step, process)
    p = epath.Path(path)
    if not p.exists():
        raise RunDirError(f"{path}: missing; checkpoint {step} cannot resume a streamed loader without its "
                          "data state (saved with every checkpoint since data.loader: grain)")
    return json.loads(p.read_text())


def prune_data_state(directory: str, keep_steps) -> None:
    """Drop the data states of checkpoints Orbax no longer keeps."""
    root = epath.Path(f"{str(directory).rstrip('/')}/{RUN_DATA_STATE}")
    if not root.exists():
        return
    keep = {int(s) for s in keep_steps}
    for p in root.iterdir():
        if p.name.isdigit() and int(p.name) not in keep:
            p.rmtree(missing_ok=True)


# ---------------------------------------------------------------------------------------
# Checkpoint writes that fail (a full disk)
# ---------------------------------------------------------------------------------------
_UNFINISHED = re.compile(r"^\d+\.orbax-checkpoint-tmp")


def remove_unfinished_checkpoints(checkpoints_dir: str, log=print) -> list[str]:
    """Remove the temporary step directories a failed or killed save left in a local
    `checkpoints/` (Orbax's own cleanup runs asynchronously and can miss them); only while
    holding the run's lock, when no save of this run can be in flight."""
    if is_url(checkpoints_dir) or not os.path.isdir(checkpoints_dir):
        return []
    removed = []
    for name in sorted(os.listdir(checkpoints_dir)):
        if _UNFINISHED.match(name):
            shutil.rmtree(os.path.join(checkpoints_dir, name), ignore_errors=True)
            removed.append(name)
            log(f"removed an unfinished checkpoint write: {checkpoints_dir}/{name}")
    return removed


_STORAGE_WORDS = ("No space left", "os_error_code='28'", "os_error_code='122'", "Disk quota", "RESOURCE_EXHAUSTED",
                  "Read-only file system", "Permission denied", "File too large")


def is_storage_error(e: BaseException) -> bool:
    """A write that failed because of the disk (full, read-only, no permission), as an
    OSError or as the ValueError tensorstore raises inside Orbax."""
    if isinstance(e, OSError):
        return True
    text = str(e)
    return isinstance(e, (ValueError, RuntimeError)) and any(w in text for w in _STORAGE_WORDS)


def storage_reason(e: BaseException) -> str:
    """What the disk said, short: 'No space left on device' rather than tensorstore's
    whole message (which names every chunk file)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    text = " ".join(str(e).split())
    for phrase in ("No space left on device", "Disk quota exceeded", "Read-only file system",
                   "Permission denied", "File too large"):
        if phrase in text:
            return phrase
    return text if len(text) <= 300 else text[:300] + " ..."


class OrbaxErrorLog:
    """While active, Orbax's background threads' ERROR records (each with a traceback,
    one per thread and retry) are held back instead of printed: the loop reports the
    failure itself, once. `records` keeps them."""

    def __init__(self):
        import logging
        self._logger = logging.getLogger("absl")
        self.records = []

    def filter(self, record) -> bool:
        if record.levelno >= 40 and "orbax" in (record.pathname or ""):
            self.records.append(record)
            return False
        return True

    def __enter__(self):
        self._logger.addFilter(self)
        return self

    def __exit__(self, *exc):
        self._logger.removeFilter(self)


_silenced = []


def silence_abandoned_writes() -> None:
    """For the rest of the process (idempotent): when a save fails, Orbax gives up on it
    at the first failed write, and the writes still in flight finish later, perhaps before
    the loop has noticed, into an event loop already closed (tensorstore's callbacks raise
    'Event loop is closed', each printed as an unraisable traceback) or into futures nobody
    awaits (asyncio logs each one at exit). Both are echoes of the failure the loop reports
    once; anything else is still printed."""
    import logging
    import sys
    if _silenced:
        return
    _silenced.append(True)

    def echo_of_failure(exc) -> bool:
        return ((isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
                or (exc is not None and is_storage_error(exc)))

    shown = sys.unraisablehook

    def unraisable(u):
        if not echo_of_failure(u.exc_value):
            shown(u)

    def never_retrieved(record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in record.getMessage() and echo_of_failure(exc))

    sys.unraisablehook = unraisable
    logging.getLogger("asyncio").addFilter(never_retrieved)
