"""Distributed Newton–Schulz: every Muon block orthogonalised whole, on one device.

Left to XLA, Newton–Schulz on a sharded block runs its products sharded and all-reduces
each partial Gram matrix (K3 on v5p-1024: ~5 TB of all-reduce per device per step), and a
block replicated over some mesh axis is orthogonalised on every device of that axis. Here
(as in Moonshot's distributed Muon, which has each rank orthogonalise only the matrices it
owns) the blocks of one view are dealt out instead:

  1. all-to-all over the axes that shard the block's two matrix dims: each device trades
     its slices of the others' blocks for whole blocks of its own share;
  2. a device on an axis the view is replicated over keeps only its part of that share;
  3. Newton–Schulz on whole local blocks: no collective inside it;
  4. the way back: all-gather over the replicated axes, the inverse all-to-alls.

Each device then runs ⌈local blocks / group⌉ blocks, `group` being the devices that shared
them: the work of the whole view over all devices, up to the padding to a multiple of the
group. A view with fewer blocks than its group (a dense projection stacked over 22 layers,
over 512 devices) is dealt out too: a block on each of 22 devices, padding on the others,
which costs one block's Newton–Schulz per device where XLA's sharded form, measured on K3's
compiled step (`k3jax compile`, scope 'other'), cost 2.6x the whole optimizer's fair share
in FLOPs and most of the step's all-reduce bytes. A single (unstacked) matrix rides in the
padding of a pack of its block shape where one has room: it then costs no device anything
more. Otherwise it is left to XLA (one block per device would replicate its work), as is
every view outside a mesh. Left to XLA, a matrix whose short side is not sharded has its
Gram products replicated on every device (K3's unstacked shared-expert projections: 154x
their fair share each, 3.2e13 FLOPs a device a step in all on v5p-1024).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.mesh import entry_axes


# Padding (blocks past a view's own, over its group's share) above which a view is packed
# with others of its block shape.
MAX_PADDING = 0.1


@dataclass(frozen=True)
class Deal:
    """How one view's blocks are dealt out: its PartitionSpec (one entry per dim), the mesh,
    the axes sharding the two matrix dims (each dim's, major first) and those the view is
    replicated over."""
    mesh: Mesh
    spec: tuple
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    replicas: tuple[str, ...]

    @property
    def group(self) -> int:
        sizes = dict(self.mesh.shape)
        return math.prod(sizes[a] for a in self.rows + self.cols + self.replicas)

    def local_blocks(self, shape) -> int:
        sizes = dict(self.mesh.shape)
        split = math.prod(sizes[a] for e in self.spec[:-2] for a in entry_axes(e))
        return math.prod(shape[:-2]) // split

    def per_device(self, shape) -> int:
        """Blocks each device orthogonalises (padding included)."""
        return -(-self.local_blocks(shape) // self.group)


def plan(shape, spec: P | tuple | None, mesh: Mesh | None) -> Deal | None:
    """The Deal for a view of `shape` sharded as `spec` on `mesh`, or None where XLA's own
    sharded Newton–Schulz is kept (no mesh or nothing to deal). A single matrix's Deal says
    which packs it may ride in (`orthogonalize_many`)."""
    if mesh is None or spec is None or len(shape) < 2 or mesh.size == 1:
        return None
    sizes = dict(mesh.shape)
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    if len(spec) != len(shape):
        return None
    big = lambda axes: tuple(a for a in axes if sizes[a] > 1)  # noqa: E731
    used = {a for e in spec for a in entry_axes(e)}
    deal = Deal(mesh, spec, big(entry_axes(spec[-2])), big(entry_axes(spec[-1])),
                tuple(a for a in mesh.axis_names if a not in used and sizes[a] > 1))
    if deal.group == 1:
        return None                      # every block already whole and alone on its device
    return deal


def view_spec(sharding) -> tuple | None:
    """A param's PartitionSpec and mesh, where it has a NamedSharding on a mesh of > 1 device."""
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return tuple(sharding.spec), sharding.mesh
    return None


def orthogonalize(x, deal: Deal, ns: Callable, chunks: int = 1):
    """`ns` (Newton–Schulz of one [in, out] block) applied to every block of `x` ([..batch..,
    in, out], sharded as deal.spec), each block on one device. `chunks`: the device's blocks
    run in about this many sequential batches (bounds the live Newton–Schulz temporaries)."""
    return orthogonalize_many([x], [deal], ns, [chunks])[0]


def orthogonalize_many(xs, deals, ns: Callable, chunks) -> list:
    """`orthogonalize` of several views at once: views whose blocks have one shape and whose
    deals trade over the same axes are packed into one deal, so they pad to a multiple of
    the group once between them, not each (K3's dense projections: 22 stacked blocks each
    over 512 devices, one block per device per view alone, ~one per device for all of them
    packed). Views padding at most MAX_PADDING run alone, as `orthogonalize` runs them.
    Each view's blocks run in batches no larger than `orthogonalize`'s for it. A single
    matrix (2-D view) takes a padding slot of a pack it can join, else XLA's sharded form."""
    packs: dict = {}
    singles = []
    for k, (x, d) in enumerate(zip(xs, deals)):
        # tall blocks packed transposed with wide ones: Newton–Schulz of Xᵀ is its result's
        # transpose, and optax turns a tall block wide before iterating, so nothing changes
        flip = x.shape[-2] > x.shape[-1]
        rows, cols = (d.cols, d.rows) if flip else (d.rows, d.cols)
        shape = tuple(x.shape[-2:])[::-1] if flip else tuple(x.shape[-2:])
        key = (d.mesh, rows, cols, d.replicas, shape, x.dtype)
        if x.ndim == 2:
            singles.append((k, flip, key))
            continue
        # a view that pads little runs alone: packed, its copies on the way in and out would
        # be live together with the others' (K3's expert leaves: 12.6 GiB a device a pack)
        alone = d.per_device(x.shape) * d.group <= (1 + MAX_PADDING) * d.local_blocks(x.shape)
        packs.setdefault(key + (k if alone else -1,), []).append((k, flip))
    out = [None] * len(xs)
    for k, flip, key in singles:
        pack = next((m for pk, m in packs.items() if pk[:-1] == key and _room(m, xs, deals)), None)
        if pack is None:
            out[k] = ns(xs[k])
        else:
            pack.append((k, flip))
    for (_, rows, cols, *_), members in packs.items():
        idx = [k for k, _ in members]
        ys = _orthogonalize_pack([xs[k] for k in idx], [deals[k] for k in idx], [f for _, f in members],
                                 rows, cols, ns, [chunks[k] for k in idx])
        for k, y in zip(idx, ys):
            out[k] = y
    return out


def _room(members, xs, deals) -> int:
    """Padding slots of a pack: blocks it could take with no device running more."""
    b = sum(deals[k].local_blocks(xs[k].shape) for k, _ in members)
    group = deals[members[0][0]].group
    return -(-b // group) * group - b


def _copies(y, n: int):
    """`n` blocks of padding made of copies of `y`'s real blocks (zero padding that fills a
    device's whole share becomes a constant all-to-all operand, which XLA:CPU's
    decomposition of the exchange turns into HLO its verifier rejects)."""
    if n <= 0:
        return y[:0]
    return jnp.concatenate([y] * (n // y.shape[0]) + [y[:n % y.shape[0]]])


def _orthogonalize_pack(xs, deals, flips, rows, cols, ns: Callable, chunks):
    """One deal for views whose blocks (tall ones transposed, `flips`) share a shape, with
    `rows` / `cols` the axes sharding those blocks' two dims."""
    d0 = deals[0]
    sizes = dict(d0.mesh.shape)
    group = d0.group
    # each view's own batch (its blocks per device over its chunks): the largest bounds the pack's
    batch = max(max(1, -(-d.per_device(x.shape) // max(c, 1))) for x, d, c in zip(xs, deals, chunks))

    def local(*xls):
        blocks = [jnp.swapaxes(xl, -1, -2) if f else xl for xl, f in zip(xls, flips)]
        i, o = blocks[0].shape[-2:]
        counts = [math.prod(xl.shape[:-2]) for xl in xls]
        b = sum(counts)
        n = -(-b // group)
        y = jnp.concatenate([xl.reshape(c, i, o) for xl, c in zip(blocks, counts)])
        y = jnp.concatenate([y, _copies(y, n * group - b)])     # padding: dropped on the way back
        # minor axis first: the concatenated slices then come back in the dim's order
        for a in reversed(rows):
            y = jax.lax.all_to_all(y, a, 0, 1, tiled=True)
        for a in reversed(cols):
            y = jax.lax.all_to_all(y, a, 0, 2, tiled=True)
        for a in d0.replicas:
            y = jax.lax.dynamic_index_in_dim(y.reshape(sizes[a], -1, *y.shape[1:]), jax.lax.axis_index(a),
                                             keepdims=False)
        y = jax.lax.map(ns, y, batch_size=min(batch, n))
        for a in reversed(d0.replicas):
            y = jax.lax.all_gather(y, a, axis=0, tiled=True)
        for a in cols:
            y = jax.lax.all_to_all(y, a, 2, 0, tiled=True)
        for a in rows:
            y = jax.lax.all_to_all(y, a, 1, 0, tiled=True)
        starts = [sum(counts[:j]) for j in range(len(counts))]
        return tuple(jnp.swapaxes(y[s:s + c].reshape(bl.shape), -1, -2) if f else y[s:s + c].reshape(bl.shape)
                     for s, c, bl, f in zip(starts, counts, blocks, flips))

    specs = tuple(P(*d.spec) for d in deals)
    return list(jax.shard_map(local, mesh=d0.mesh, in_specs=specs, out_specs=specs, check_vma=False)(*xs))
