"""Ahead-of-time compilation of the real steps for devices this machine does not have.

`k3jax compile` builds abstract params, optimizer state, caches and batches (nothing is
allocated) on a mesh preset laid over a TPU topology's devices, lowers the very jitted
functions `k3jax train` and `k3jax generate` run, compiles them with the TPU compiler
(libtpu, in its own environment), and reads XLA's memory and cost analyses next to the
planner's figures. The same programs lower for CUDA through `jax.export`.

  programs.py  the train / prefill / decode programs with abstract inputs on a mesh
  depth.py     reduced-depth configs and the linear extrapolation back to full depth
  hlo.py       loop-aware totals read from the optimized HLO (XLA's cost analysis counts
               a while loop's body once)
  chips.py     per-chip peak FLOP/s, HBM and ICI bandwidth; TPU topologies on a CPU host
  report.py    one compile → memory, cost, planner comparison and the roofline estimate
  gpu.py       the same programs exported for CUDA
"""
