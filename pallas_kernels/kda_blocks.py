"""Block rules the KDA chunk form (k3jax.ops.kda_chunk) and its Pallas kernels
(pallas_kernels.kda) share: plain integer and bit arithmetic, no Pallas import, so that
ops and kernels both import it and neither imports the other's modules upward."""
from __future__ import annotations

# Largest exponent a bounded gate may put into a leaf block's scores (its masked entries,
# i < j, reach e^{(leaf−1)|lb|}): e^80 ≈ 5.5e34 leaves fp32 (max 3.4e38) four decades for
# |q|·|k|.
_MAX_FACTOR_EXPONENT = 80.0


def score_leaf(gate_lower_bound, chunk_size):
    """Tokens per leaf block of _intra_chunk_scores: 1 for a gate with no lower bound, else
    the largest power of two s (at most the chunk, padded to a power of two) with
    (s − 1)·|lb| <= _MAX_FACTOR_EXPONENT — 16 for K3's lb = −5."""
    pow2 = 1 << (chunk_size - 1).bit_length()
    if gate_lower_bound is None:
        return 1
    s = 1
    while 2 * s <= pow2 and (2 * s - 1) * -gate_lower_bound <= _MAX_FACTOR_EXPONENT:
        s *= 2
    return s


def pair_join_mask(row, col, s):
    """For row and column indices (NumPy, or int32 iotas inside a Pallas kernel): within
    each group of 2s rows and columns, the block of the group's upper-half rows and
    lower-half columns (s a power of two; bit operations lower everywhere)."""
    group = (2 * s).bit_length() - 1  # log2(2s)
    return ((row >> group) == (col >> group)) & ((row & s) != 0) & ((col & s) == 0)
