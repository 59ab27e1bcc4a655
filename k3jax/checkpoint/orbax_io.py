"""Orbax checkpoints of k3jax params, written slice by slice and restored onto shardings.

Writing. Orbax saves whole arrays, but a stacked scan leaf of the real model holds 23
layers (the routed-expert stacks alone are ~450 GB each in bf16), so a converter that
hands Orbax full leaves would hold the model in host RAM. Orbax's non-OCDBT format is one
zarr array per leaf (directory `<keys joined by '.'>`) plus a `_METADATA` file with the
tree structure and no shapes. `TreeWriter` therefore creates each leaf's zarr array with
tensorstore at its full shape and writes it slice by slice (one layer, or one block of
experts, at a time); at the end Orbax itself writes the tree metadata from a tree of
scalar placeholders, whose zarr arrays are discarded. The result is an ordinary Orbax
checkpoint: `restore_params` below, or any `PyTreeCheckpointer().restore`, reads it.

Chunks are at most `CHUNK_BYTES` and never span two layers, so a restore onto a sharding
reads only the chunks of its own shard and writing one layer never rewrites another's.
Arrays are stored uncompressed: bf16 weights gain little from zstd and compression would
halve conversion throughput on a few host cores.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from k3jax.errors import K3JaxError

CHUNK_BYTES = 64 << 20
METADATA_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "commit_success.txt")


class OrbaxCheckpointError(K3JaxError):
    """An Orbax checkpoint that does not hold what the config needs; the message names the leaf."""


def leaf_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def chunk_shape(shape: tuple[int, ...], n_lead: int, itemsize: int, limit: int = CHUNK_BYTES) -> list[int]:
    """One element along the stacked leading axes; the rest halved (largest first) to fit `limit`."""
    chunk = [1] * n_lead + [max(int(d), 1) for d in shape[n_lead:]]
    while math.prod(chunk) * itemsize > limit:
        i = max(range(n_lead, len(chunk)), key=lambda j: chunk[j], default=None)
        if i is None or chunk[i] == 1:
            break
        chunk[i] = -(-chunk[i] // 2)
    return chunk


def _ts():
    import tensorstore as ts
    return ts


class TreeWriter:
    """One Orbax pytree item written leaf slice by leaf slice.

    leaves: {path: (shape, numpy dtype, n_lead)}, n_lead = the number of leading axes that
    are stacked (layers, experts) and never share a chunk.
    """

    def __init__(self, directory: str | os.PathLike, leaves: dict, chunk_bytes: int = CHUNK_BYTES):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=False)
        self.leaves = dict(leaves)
        self._arrays = {}
        ts = _ts()
        for path, (shape, dtype, n_lead) in self.leaves.items():
            dtype = np.dtype(dtype)
            spec = {"driver": "zarr",
                    "kvstore": {"driver": "file", "path": str(self.directory / leaf_name(path))},
                    "metadata": {"shape": list(shape), "dtype": _zarr_dtype(dtype), "compressor": None,
                                 "dimension_separator": ".",
                                 "chunks": chunk_shape(tuple(shape), n_lead, dtype.itemsize, chunk_bytes)}}
            self._arrays[path] = ts.open(spec, create=True).result()

    def chunks(self, path) -> list[int]:
        return list(self._arrays[path].chunk_layout.read_chunk.shape)

    def write(self, path, index, value: np.ndarray) -> None:
        """`leaf[index] = value` on disk; index is a tuple of ints and slices."""
        arr = self._arrays[path]
        target = arr[tuple(index)] if index else arr
        if tuple(target.shape) != tuple(value.shape):
            raise OrbaxCheckpointError(f"{leaf_name(path)}{list(index)}: writing shape {value.shape} "
                                       f"into a slot of shape {tuple(target.shape)}")
        target.write(np.asarray(value, dtype=self.leaves[path][1])).result()

    def finalize(self) -> None:
        """Have Orbax write the tree metadata next to the arrays (see module doc)."""
        import orbax.checkpoint as ocp

        tree: dict = {}
        for path, (_, dtype, _) in self.leaves.items():
            node = tree
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = np.zeros((), np.dtype(dtype))
        skeleton = self.directory.with_name(self.directory.name + ".skeleton")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)).save(skeleton, tree)
        for name in METADATA_FILES:
            if (skeleton / name).exists():
                shutil.move(str(skeleton / name), str(self.directory / name))
        shutil.rmtree(skeleton)


def _zarr_dtype(dtype: np.dtype) -> str:
    if dtype.name == "bfloat16":
        return "bfloat16"
    return dtype.str  # '<f4', '|u1', ...


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def _item_format(item_dir: Path) -> tuple[bool, bool]:
    meta_path = item_dir / "_METADATA"
    if not meta_path.exists():
        raise OrbaxCheckpointError(f"{item_dir}: no _METADATA, not an Orbax pytree checkpoint")
    meta = json.loads(meta_path.read_text())
    return bool(meta.get("use_ocdbt", False)), bool(meta.get("use_zarr3", False))


def stored_leaves(item_dir: str | os.PathLike) -> list[tuple[str, ...]]:
    """Tree paths of an Orbax pytree item's arrays, from its `_METADATA` (None leaves, which
    Orbax records but stores nothing for, left out: a LoRA run's frozen base)."""
    meta = json.loads((Path(item_dir) / "_METADATA").read_text())
    return [tuple(k["key"] for k in v["key_metadata"]) for v in meta["tree_metadata"].values()
            if v.get("value_metadata", {}).get("value_type") != "None"]


def open_leaf(item_dir: str | os.PathLike, path: tuple[str, ...]):
    """A tensorstore handle on one leaf (slices read only their chunks); either Orbax format."""
    item_dir = Path(item_dir).resolve()
    use_ocdbt, use_zarr3 = _item_format(item_dir)
    name = leaf_name(path)
    if use_ocdbt:
        kv = {"driver": "ocdbt", "base": f"file://{item_dir}", "path": name}
    else:
        kv = {"driver": "file", "path": str(item_dir / name)}
    try:
        return _ts().open({"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kv}, open=True).result()
    except ValueError as e:
        raise OrbaxCheckpointError(f"{item_dir}: leaf {name} cannot be opened ({e})") from None


def default_shardings(abstract):
    """Shard each leaf's largest axis over all devices where it divides, else replicate."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec

    def one(leaf):
        dims = [i for i in sorted(range(len(leaf.shape)), key=lambda i: -leaf.shape[i]) if leaf.shape[i] % n == 0]
        spec = [None] * len(leaf.shape)
        if dims:
            spec[dims[0]] = "fsdp"
        return jax.sharding.NamedSharding(mesh, P(*spec))
    return jax.tree.map(one, abstract)


def restore_params(ckpt_dir, cfg, shardings=None, item: str = "params", prefix: tuple = ()):
    """Params of `cfg` from a k3jax checkpoint directory (or a bare Orbax item), each leaf
    read straight into its target sharding (default: the first device) and cast to the
    model's param dtype for that leaf; nothing is assembled on the host first. `prefix`:
    where the params sit inside the item (('params',) in a training run's TrainState)."""

    from k3jax.model import param_shapes

    ckpt_dir = Path(ckpt_dir)
    item_dir = ckpt_dir / item if (ckpt_dir / item / "_METADATA").exists() else ckpt_dir
    return restore_tree(item_dir, param_shapes(cfg), shardings, prefix=prefix)


def restore_tree(item_dir, abstract, shardings=None, prefix: tuple = ()):
    """An Orbax item onto the tree of ShapeDtypeStructs `abstract`: every leaf must be
    stored at its shape (errors name the leaf); values are cast to the abstract dtypes.
    With `prefix`, the item holds more (a TrainState's optimizer state, say) and only the
    subtree at `prefix` is read (Orbax's partial restore)."""
    import orbax.checkpoint as ocp

    item_dir = Path(item_dir)
    prefix = tuple(prefix)
    want = {prefix + tuple(k.key for k in p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    stored = stored_leaves(item_dir)
    have = {p for p in stored if p[:len(prefix)] == prefix}
    missing = sorted(set(want) - have)
    extra = sorted(have - set(want))
    if missing or extra:
        raise OrbaxCheckpointError(
            f"{item_dir}: checkpoint tree does not match the config: "
            f"missing {[leaf_name(p) for p in missing[:10]]}, unexpected {[leaf_name(p) for p in extra[:10]]}")
    for path, leaf in want.items():
        shape = tuple(open_leaf(item_dir, path).shape)
        if shape != tuple(leaf.shape):
            raise OrbaxCheckpointError(f"{item_dir}: leaf {leaf_name(path)} has shape {shape}, "
                                       f"the config needs {tuple(leaf.shape)}")
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, abstract)
    args = jax.tree.map(lambda a, s: ocp.ArrayRestoreArgs(sharding=s, global_shape=a.shape, dtype=a.dtype),
                        abstract, shardings)
    item, partial = abstract, len(have) < len(stored)
    for key in reversed(prefix):
        item, args = {key: item}, {key: args}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        out = ckptr.restore(item_dir.resolve(), args=ocp.args.PyTreeRestore(
            item=item if partial else None, restore_args=args, partial_restore=partial))
    for key in prefix:
        out = out[key]
    return out
