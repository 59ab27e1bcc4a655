"""The one error base class: bad input that the user can fix.

Every error raised for a bad file, config key, tensor, token id or path derives from
`K3JaxError`; its message is one line that names what is wrong and where. The `k3jax`
command prints such an error as that one line and exits 2; any other exception is a bug
(or the machine failing) and keeps its traceback. `K3JaxError` is a `ValueError`, so
existing `except ValueError` handlers keep working.
"""
from __future__ import annotations


class K3JaxError(ValueError):
    """Bad input: the message names the file, key, tensor or id."""


class ConfigError(K3JaxError):
    """A config key is unknown, missing or inconsistent; the message names it."""


class InputError(K3JaxError):
    """Model inputs that cannot be run: wrong shape, ids out of range, too long."""


def check_token_ids(ids, vocab_size: int, what: str):
    """`ids` as an int32 array after checking, on the values as given, that they are
    integers in [0, vocab_size): a cast first would wrap an int64 id of 2**32 + 5 to 5."""
    import numpy as np
    arr = np.asarray(ids)
    if arr.size == 0:
        raise InputError(f"{what}: no token ids (shape {arr.shape})")
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{what}: token ids must be integers, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        where = tuple(int(i) for i in np.argwhere(arr == bad)[0])
        raise InputError(f"{what}: token id {bad} at index {list(where)} is outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)


class RunDirError(K3JaxError):
    """A training run directory that cannot be used as asked (locked, different config,
    a checkpoint write that failed); the message names the directory."""


class MissingDependency(K3JaxError, ImportError):
    """An optional package is not installed; the message names the pip extra that has it."""


def require(module: str, extra: str, feature: str, package: str | None = None):
    """`import module`, or a MissingDependency naming the extra of pyproject.toml that
    provides it (for features outside the core install)."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{feature} needs the {package or module!r} package, which the core install "
                                f"does not include: pip install 'k3jax[{extra}]' (from a checkout: "
                                f"pip install -e '.[{extra}]')") from e
