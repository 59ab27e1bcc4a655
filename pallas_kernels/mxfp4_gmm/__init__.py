"""Fused MXFP4 dequant grouped matmul (Pallas), and the exact E2M1/E8M0 decode it shares
with the pure-JAX path in k3jax.ops.mxfp4_matmul."""
