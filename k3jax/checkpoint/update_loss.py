"""What an export's storage format lost of the fine-tune, and the merge both sides compute.

A release stores routed experts as MXFP4 and the other weights as bf16. An export of a
fine-tune (LoRA merged into its base, or a full fine-tune) rounds each trained weight to
that format; `UpdateLoss` measures what the rounding took from what the run's forward
used, relative to the fine-tune's update to those weights:

    lost = sqrt(Σ |stored − seen|² / Σ |update|²)

`seen` is the weight the run's forward multiplied by: the merged (or trained) value, or,
for a QAT run (`qat: true`), its stored form itself, bit for bit (k3jax.ops.qat), so a QAT
run loses 0. `update` is the adapters' s·A·B, or a full fine-tune's W − W_init.

`merged_fp32` is the numpy twin of pallas_kernels.mxfp4_gmm.encode.merge (the QAT forward's
merge): W + s·Σ_j left[:, j]·right[j, :] in fp32, one rank at a time in order, each product
as four exact partial products, so both round the same sum bit for bit on any backend
(tests/ops/test_qat.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WARN_ABOVE = 0.05   # the export warns when the format lost more than this of the update


def _split(x):
    hi = (x.view(np.int32) & np.int32(-4096)).view(np.float32)
    return hi, x - hi


def _add_product(acc, x, y):
    xh, xl = _split(np.asarray(x, np.float32))
    yh, yl = _split(np.asarray(y, np.float32))
    for p in (xh * yh, xh * yl, xl * yh, xl * yl):
        acc = acc + p
    return acc


def lowrank_fp32(left, right) -> np.ndarray:
    """left [P, r], right [r, Q] -> [P, Q] fp32: encode.lowrank's operations in numpy."""
    left, right = np.asarray(left, np.float32), np.asarray(right, np.float32)
    acc = np.zeros((left.shape[0], right.shape[1]), np.float32)
    for j in range(left.shape[1]):
        acc = _add_product(acc, left[:, j:j + 1], right[j:j + 1, :])
    return acc


def merged_fp32(w, left, right, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(w + scale·lowrank(left, right) in fp32 as encode.merge computes it, the update as
    merged: merged − w in float64)."""
    w = np.asarray(w, np.float32)
    merged = _add_product(w.copy(), np.float32(scale), lowrank_fp32(left, right))
    return merged, merged.astype(np.float64) - w.astype(np.float64)


@dataclass
class _Kind:
    err2: float = 0.0
    delta2: float = 0.0
    tensors: int = 0
    worst: list = field(default_factory=list)   # (lost fraction, name), the largest few

    def fraction(self) -> float:
        return float(np.sqrt(self.err2 / self.delta2)) if self.delta2 else 0.0


@dataclass
class UpdateLoss:
    """Sums of |stored − seen|² and |update|² per kind ('experts' MXFP4, 'dense' bf16)."""
    qat: bool = False
    kinds: dict = field(default_factory=dict)

    def add(self, kind: str, name: str, seen: np.ndarray, stored: np.ndarray, update: np.ndarray) -> None:
        k = self.kinds.setdefault(kind, _Kind())
        e2 = float(np.sum((np.asarray(stored, np.float64) - np.asarray(seen, np.float64)) ** 2))
        d2 = float(np.sum(np.asarray(update, np.float64) ** 2))
        k.err2, k.delta2, k.tensors = k.err2 + e2, k.delta2 + d2, k.tensors + 1
        if d2:
            k.worst = sorted(k.worst + [(np.sqrt(e2 / d2), name)], reverse=True)[:3]

    def fraction(self) -> float:
        err2 = sum(k.err2 for k in self.kinds.values())
        delta2 = sum(k.delta2 for k in self.kinds.values())
        return float(np.sqrt(err2 / delta2)) if delta2 else 0.0

    def summary(self) -> dict:
        return {"fraction": self.fraction(), "qat": self.qat, "warn": self.fraction() > WARN_ABOVE,
                "kinds": {n: {"tensors": k.tensors, "fraction": k.fraction(),
                              "worst": [{"tensor": t, "fraction": float(f)} for f, t in k.worst]}
                          for n, k in sorted(self.kinds.items())}}


def describe(lost: dict) -> list[str]:
    """The export's lines about `lost` (UpdateLoss.summary()): the fraction, per kind, and a
    warning naming `qat: true` above WARN_ABOVE."""
    kinds = ", ".join(f"{n} {k['fraction']:.1%} over {k['tensors']:,d} tensors" for n, k in lost["kinds"].items())
    how = " (QAT: the run's forward used these stored weights)" if lost["qat"] else ""
    lines = [f"update lost to the storage format: {lost['fraction']:.1%} of the fine-tune's change to the weights"
             f"{how}" + (f" ({kinds})" if kinds else "")]
    if lost["warn"]:
        lines.append(f"warning: the export keeps only part of the fine-tune: MXFP4 experts and bf16 weights lost "
                     f"{lost['fraction']:.1%} of its update (> {WARN_ABOVE:.0%}); train with `qat: true` (train "
                     f"config, or qat=true on the command line) so the forward sees the stored weights and the "
                     f"export loses nothing")
    return lines
