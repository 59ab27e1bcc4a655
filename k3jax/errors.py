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


class RunDirError(K3JaxError):
    """A training run directory that cannot be used as asked (locked, different config,
    a checkpoint write that failed); the message names the directory."""
