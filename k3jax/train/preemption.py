"""Preemption: every process saves the same step, then exits with a code schedulers restart on.

A scheduler that reclaims the machines sends SIGTERM (to one host or to all, at slightly
different times), waits a grace period, then kills. A per-process flag would let one host
enter the checkpoint save while its peers run the next step's collectives: both hang. With
several processes the decision is jax's preemption sync point instead: the SIGTERM handler
that `jax.distributed.initialize` installs tells the coordination service, every process
posts the step it has reached, and all of them learn the same sync step (the furthest
one + 1), which `reached(step)` reports on each process at that step. One process alone
keeps a Python flag.

The counter is the training step, the numbering Orbax's CheckpointManager passes to the
same sync point when it saves, so `begin(step)` is called with the step the run resumes
from as early as the run knows it, and `reached` once per step after each step. A SIGTERM that
arrives before `begin` resolves to step 1 and is not seen by a resumed run; the scheduler's
kill then ends it, losing nothing saved.

Exit code PREEMPTED (42) after the save, documented per platform in launch/README.md:
xpk / JobSet restart the workload on 42 and 127–255 (up to --max-restarts) and fail it on
anything else, 0 included; launch/slurm_gpu.sbatch requeues the job on 42; on a TPU VM
rerunning the same command resumes.
"""
from __future__ import annotations

import signal

PREEMPTED = 42


def begin(step: int) -> None:
    """Tell the sync point the step this run starts from (before training; a no-op alone)."""
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.reached_preemption_sync_point(step)


class PreemptionWatch:
    """`reached(step)`: True on every process at the one step they all save and stop at."""

    def __init__(self):
        import jax
        self.shared = jax.process_count() > 1
        self.received = False
        self._prev = None
        if not self.shared:
            # with several processes SIGTERM stays jax's: a Python handler would replace it
            self._prev = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_):
        self.received = True

    def reached(self, step: int) -> bool:
        if not self.shared:
            return self.received
        from jax.experimental import multihost_utils
        hit = multihost_utils.reached_preemption_sync_point(step)
        self.received = self.received or hit
        return hit

    def close(self) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)
            self._prev = None
