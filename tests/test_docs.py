"""The numbers in README.md, launch/README.md and docs/performance.md are what the code
computes now: every generated block equals what scripts/docs_tables.py makes from
`k3jax plan` / `k3jax params` and the mesh presets."""
import pytest
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("docs_tables", os.path.join(ROOT, "scripts", "docs_tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_generated_doc_blocks_are_up_to_date():
    mod = _script()
    stale = mod.stale()
    assert not stale, ("out of date with the code: " + ", ".join(f"{p} block {n!r}" for p, n in stale)
                       + f"; regenerate with `{mod.REGEN}` and commit the result")

