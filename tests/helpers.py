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
