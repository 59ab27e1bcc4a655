"""The `k3jax` command: subcommands are discovered from `k3jax.commands`.

Bad input (any `k3jax.errors.K3JaxError`: a config key, a tensor, a token id, a locked run
directory) and the file-system errors a user fixes (a missing or existing path, a full
disk, no permission) end as one line on stderr naming the file or key, exit code 2. Any
other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import pkgutil
import sys

import k3jax.commands

# OSErrors that describe the user's files or disk, not a bug
_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 in JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for mod in sorted(pkgutil.iter_modules(k3jax.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"k3jax.commands.{mod.name}").register(sub)
    return ap


def one_line(e: BaseException) -> str | None:
    """The one-line message for a user-fixable error, or None for anything else."""
    from k3jax.errors import K3JaxError
    if isinstance(e, K3JaxError):
        return " ".join(str(e).split("\n"))
    if isinstance(e, _USER_OS_ERRORS) or (isinstance(e, OSError) and e.errno in _DISK_ERRNOS):
        if e.filename is not None and e.strerror:
            return f"{e.filename}: {e.strerror}"
        return " ".join(str(e).split("\n"))
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow options (`train CONFIG --mesh M steps=10`), which
    # argparse alone leaves unparsed after the first run of positionals
    if extra:
        if getattr(args, "overrides", None) is not None and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except Exception as e:  # noqa: BLE001  (sorted below: the rest re-raised with its traceback)
        message = one_line(e)
        if message is None:
            raise
        print(f"k3jax {args.cmd}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
