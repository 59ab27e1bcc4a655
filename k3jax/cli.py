"""The `k3jax` command: subcommands are discovered from `k3jax.commands`."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import k3jax.commands


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 in JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for mod in sorted(pkgutil.iter_modules(k3jax.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"k3jax.commands.{mod.name}").register(sub)
    return ap


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
    from k3jax.config import ConfigError
    from k3jax.model import InputError
    try:
        return args.fn(args)
    except (ConfigError, InputError, FileNotFoundError, ValueError) as e:
        print(f"k3jax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
