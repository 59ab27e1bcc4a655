"""Subcommands of `k3jax`: each module here defines `register(subparsers)`.

`k3jax.cli` discovers the modules, so adding a command is adding a file.
"""
