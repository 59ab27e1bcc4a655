"""Subcommands of `k3jax`: each module here defines `register(subparsers)`.

`k3jax.cli` discovers the modules, so adding a command is adding a file. The helpers below
are shared by the commands that write files.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os


def number(kind=int, low=None, high=None, low_open=False):
    """An argparse `type` that range-checks: `--top-p 0` or `--limit -1` is argparse's usage
    error naming the flag and the range (exit 2), never a silent default or a traceback."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
            hi = "" if high is None else f"<= {high}"
            raise argparse.ArgumentTypeError(f"must be {' and '.join(x for x in (lo, hi) if x)}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


_EXPERT_FORMAT_HELP = {
    "held": "routed experts widened (bf16) or held as the checkpoint's MXFP4 bytes, dequantized tile by "
            "tile inside the expert matmuls",
    "planned": "routed experts as bf16 or as the checkpoint's MXFP4",
    "stored": "routed experts widened (bf16) or kept packed as MXFP4 bytes in the Orbax checkpoint",
}


def add_expert_format(p, use: str) -> None:
    """`--expert-format`, spelled once for every command that takes it; `use`: 'held' (a
    forward runs with them), 'planned' (plan, compile) or 'stored' (convert)."""
    from k3jax.config import EXPERT_FORMATS
    p.add_argument("--expert-format", choices=EXPERT_FORMATS, default="bf16", help=_EXPERT_FORMAT_HELP[use])


def output_path(path: str, suffix: str | None = None) -> str:
    """The path a command will write (with `suffix` added as np.save would add it),
    checked before any long work: its folder exists and is writable, and it is not a
    folder itself. Errors name the path."""
    if suffix and not path.endswith(suffix):
        path += suffix
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(2, "output folder does not exist", folder)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "is a directory, not an output file", path)
    if not os.access(folder, os.W_OK):
        raise PermissionError(13, "output folder is not writable", folder)
    return path


def atomic_write(path: str, write) -> str:
    """`write(file)` into a temporary name next to `path`, renamed onto it when complete:
    an interrupted or failed write never leaves a half-written result."""
    from k3jax import textfiles
    with writing(path):      # a full disk names `path`, not the temporary
        return textfiles.atomic_write(path, write)


_DISK = (("No space left", errno.ENOSPC), ("os_error_code='28'", errno.ENOSPC), ("Disk quota", errno.EDQUOT),
         ("os_error_code='122'", errno.EDQUOT), ("Read-only file system", errno.EROFS),
         ("File too large", errno.EFBIG))


@contextlib.contextmanager
def writing(path):
    """A disk error while a command writes `path` (an OSError without a name, or tensorstore's
    ValueError naming one chunk file of a temporary folder) re-raised as an OSError naming
    `path`: the CLI's one line says which output did not fit."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        text = " ".join(str(e).split())
        code = e.errno if isinstance(e, OSError) else next((c for w, c in _DISK if w in text), None)
        if code not in {c for _, c in _DISK}:
            raise
        raise OSError(code, os.strerror(code), str(path)) from e
