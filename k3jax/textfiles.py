"""The user's text data files, read one way: UTF-8 checked, JSON Lines parsed, every failure
one line naming the file, the line and (for bad bytes) the byte offset. And the one way a
local file is written whole (`atomic_write`)."""
from __future__ import annotations

import json
import os
import secrets

from etils import epath

from k3jax.errors import InputError


def decode(data: bytes, where: str, first_line: int | None = 1, base: int = 0) -> str:
    """`data` (starting at byte `base` of the file `where`, on line `first_line` when known) as
    UTF-8; undecodable bytes are an InputError naming the file, the line and the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        newlines = data.count(b"\n", 0, e.start)
        line = "" if first_line is None else f":{first_line + newlines}"
        raise InputError(f"{where}{line}: not UTF-8 text (byte {base + e.start} is "
                         f"{data[e.start:e.start + 1]!r}); save the file as UTF-8") from None


def read_text(path) -> str:
    """A whole file (local or a URL through etils.epath) as UTF-8 text."""
    return decode(epath.Path(path).read_bytes(), str(path))


def json_line(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg})") from None


def jsonl_records(path):
    """(line number, object) of each non-blank line of a .jsonl file."""
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if line.strip():
            yield n, json_line(line, f"{path}:{n}")


def jsonl_files(path: str, what: str) -> list[str]:
    """The .jsonl files `path` names: the file itself, or every .jsonl file of a folder
    (sorted; local or a URL through etils.epath). `what` names the data in the errors."""
    p = epath.Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.name.endswith(".jsonl"))
        if not files:
            raise FileNotFoundError(f"{path}: no .jsonl files")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{what} {path!r} not found")
    return [str(path)]


def atomic_write(path, write, fsync: bool = False):
    """`write(file)` into a fresh temporary name beside `path` (binary), renamed onto `path`
    when complete: a reader never sees it half written, and an interrupted or failed write
    leaves whatever was there before. `fsync`: on disk before the rename (checkpoints)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # O_EXCL on a random name never clobbers anything; 0o666 leaves the permissions to the umask
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
