"""The run directory's own small files (config.yaml, metrics.jsonl), local or remote.

`{output_dir}/{run_name}` may be a local path or a URL such as gs://bucket/runs: pod hosts
have no shared local disk, and Orbax writes checkpoints to either natively. The small files
go through etils.epath, which reaches gs:// through gcsfs (or tensorflow) when installed.
Object stores cannot append, so for a URL metrics.jsonl is rewritten whole at each logging
step (it holds one short line per logged step); a local file is appended to and flushed.
"""
from __future__ import annotations

import json
import os

from etils import epath


def is_url(path) -> bool:
    return "://" in str(path)


def run_dir(output_dir, run_name) -> str:
    """`{output_dir}/{run_name}`: absolute for a local path, verbatim for a URL (abspath
    would turn gs://b/x into ./gs:/b/x, a local directory on every host)."""
    if is_url(output_dir):
        return f"{str(output_dir).rstrip('/')}/{run_name}"
    return os.path.abspath(os.path.join(output_dir, str(run_name)))


def make_dirs(path: str):
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def write_text(path: str, text: str):
    """Replace a whole file so that no reader sees it half written: locally through a
    temporary file and a rename; an object in a store is replaced atomically anyway."""
    if is_url(path):
        epath.Path(path).write_text(text)
        return
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class MetricsLog:
    """metrics.jsonl, one JSON object per logged step.

    Opening it keeps only the lines of steps <= `keep_through` (the step a run resumes
    from; 0 for a fresh run), so after a resume the file reads as one uninterrupted run.
    `enabled=False` (processes other than 0) neither reads nor writes. `append` defaults to
    True for local paths and False (rewrite whole) for URLs.
    """

    def __init__(self, path: str, keep_through: int, enabled: bool = True, append: bool | None = None):
        self.path, self.enabled = path, enabled
        self.append = (not is_url(path)) if append is None else append
        self._lines: list[str] = []
        self._file = None
        if not enabled:
            return
        p = epath.Path(path)
        if p.exists():
            self._lines = [line + "\n" for line in p.read_text().splitlines()
                           if line.strip() and json.loads(line)["step"] <= keep_through]
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
