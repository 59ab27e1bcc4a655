"""Shared test utilities: where the golden fixtures live, and error metrics."""
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("K3JAX_SHARED", ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures"
REFERENCE_CONFIG = SHARED / "reference" / "kimi-k3" / "config.json"


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found (set K3JAX_SHARED to the shared/ folder)")
    return path


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_logits_match(logits, ref, rel: float = 1e-4, max_abs: float = 2e-3, margin: float = 1e-2):
    """DESIGN.md's full-model parity bar, per sequence: relative L2, max |diff|, and the same
    argmax wherever the reference's top-2 margin is clear."""
    logits, ref = np.asarray(logits), np.asarray(ref)
    assert logits.shape == ref.shape, (logits.shape, ref.shape)
    for b in range(ref.shape[0]):
        assert rel_l2(logits[b], ref[b]) <= rel, (b, rel_l2(logits[b], ref[b]))
        assert np.abs(logits[b] - ref[b]).max() <= max_abs, (b, np.abs(logits[b] - ref[b]).max())
        top2 = np.sort(ref[b], axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > margin
        np.testing.assert_array_equal(logits[b].argmax(-1)[clear], ref[b].argmax(-1)[clear])
