"""The grouped-matmul kernels' shared product and block-size rule (pallas_kernels.gmm and
pallas_kernels.mxfp4_gmm)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def matmul_for(mode, cdt):
    """The kernels' matmul: fp32 accumulation; fp32 operands at fp32 accuracy in each
    backend's way (TF32x3 on Triton, as for the KDA kernels: see pallas_kernels/kda/fwd.py);
    bf16 operands need nothing more (their products are exact in fp32)."""
    if cdt == jnp.bfloat16:
        precision = jax.lax.Precision.DEFAULT
    elif mode == "triton":
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        precision = _HI

    def matmul(a, b, dims):
        return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    return matmul


def pow2(n, lo, hi):
    """n rounded up to a power of two, clamped to [lo, hi] (Triton's block sizes)."""
    return int(min(hi, max(lo, 1 << max(0, n - 1).bit_length())))
