"""Safetensors reading and writing without torch.

The format: an 8-byte little-endian u64 ``n``, then ``n`` bytes of UTF-8 JSON (the header),
then the data buffer. The header maps each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the start of the data buffer) and may
hold a ``"__metadata__"`` object of string -> string.

* :class:`SafetensorsFile` validates the whole header when opened and memory-maps the file
  read-only; :meth:`SafetensorsFile.get` returns a zero-copy view, so only the pages of the
  tensors actually touched are ever read from disk.
* :func:`write_safetensors` writes the same bytes as the reference ``safetensors`` library
  and is atomic (temp file in the same directory, then ``os.replace``).
* :class:`ShardedCheckpoint` reads a Hugging Face checkpoint directory
  (``model.safetensors.index.json`` / ``.json.gz`` or a single ``model.safetensors``).

Every malformed header raises :class:`SafetensorsError` naming the file and, where there is
one, the tensor.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from k3jax.errors import K3JaxError
from k3jax.textfiles import atomic_write


class MissingTensor(K3JaxError, KeyError):
    """A tensor name a checkpoint does not hold (a KeyError too, for mapping-style callers)."""

    def __str__(self):   # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


__all__ = [
    "SafetensorsError",
    "SafetensorsFile",
    "ShardedCheckpoint",
    "write_safetensors",
    "DTYPES",
    "dtype_name",
]

# The reference library rejects headers above this size; a larger value is almost
# certainly a corrupt length field, and refusing it avoids reading gigabytes as JSON.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype string -> numpy dtype. Multi-byte numpy types are pinned little-endian
# because the format is; the ml_dtypes types are 1 or 2 bytes and host-endian, which is
# little-endian on every platform JAX runs on.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}

# The reference writer orders tensors by this rank (its dtype enum order, which is
# increasing alignment), largest first, then by name; matching it keeps every tensor
# aligned to its itemsize and makes our files byte-identical to the reference's.
_WRITE_RANK = {name: rank for rank, name in enumerate(DTYPES)}

_NAME_BY_DTYPE: dict[np.dtype, str] = {}
for _name, _dt in DTYPES.items():
    _NAME_BY_DTYPE[_dt] = _name
    # Big-endian inputs are accepted (and byte-swapped on write) for numpy's own types only:
    # swapping an ml_dtypes type yields an anonymous void dtype, not a float.
    if _dt.kind in "biuf":
        _NAME_BY_DTYPE[_dt.newbyteorder(">")] = _name


class SafetensorsError(K3JaxError):
    """A safetensors file, header or checkpoint index that cannot be read as written."""


def dtype_name(dtype) -> str:
    """The safetensors dtype string for a numpy / ml_dtypes dtype (e.g. ``"BF16"``)."""
    dt = np.dtype(dtype)
    try:
        return _NAME_BY_DTYPE[dt]
    except KeyError:
        raise TypeError(f"dtype {dt} has no safetensors equivalent") from None


def _reject_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x) -> bool:
    # JSON booleans arrive as Python bools, which are ints; a shape of [true] is corrupt.
    return isinstance(x, int) and not isinstance(x, bool)


class _TensorEntry:
    __slots__ = ("dtype_str", "dtype", "shape", "begin", "end")

    def __init__(self, dtype_str, dtype, shape, begin, end):
        self.dtype_str = dtype_str
        self.dtype = dtype
        self.shape = shape
        self.begin = begin
        self.end = end


class SafetensorsFile:
    """One ``.safetensors`` file, header validated on open, data memory-mapped read-only.

    ``get`` returns a read-only numpy view into the mapping (no copy, nothing read until it
    is touched). The view stays valid after :meth:`close` (it keeps the mapping alive), but
    it reflects the file on disk: callers that modify the data, or need it to outlive a
    rewrite of the file, should copy it (``np.array(view)``).

    Stricter than the reference reader in naming the file and tensor in every error, more
    lenient in one respect: gaps between tensors and trailing bytes are allowed (overlaps
    are not), since they cannot make a tensor read wrong.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._metadata: dict[str, str] = {}
        self._entries: dict[str, _TensorEntry] = {}
        self._mm: np.memmap | None = None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._data_start = self._parse_header(f, size)
        # np.memmap cannot map an empty range; a header-only file has nothing to map.
        if size > self._data_start:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._closed = False

    # -- header parsing ---------------------------------------------------------------

    def _err(self, msg: str, tensor: str | None = None) -> SafetensorsError:
        where = f"{self.path}" if tensor is None else f"{self.path}: tensor {tensor!r}"
        return SafetensorsError(f"{where}: {msg}")

    def _parse_header(self, f, size: int) -> int:
        if size < 8:
            raise self._err(f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise self._err(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise self._err(f"header length {n} runs past the end of the file ({size} bytes)")
        raw = f.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._err(f"header is not valid UTF-8 ({e})") from None
        try:
            header = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except ValueError as e:
            raise self._err(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._err(f"header is a JSON {type(header).__name__}, not an object")

        data_size = size - 8 - n
        meta = header.pop("__metadata__", None)
        if meta is not None:
            if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
            ):
                raise self._err("__metadata__ must be an object of string -> string")
            self._metadata = meta

        for name, entry in header.items():
            self._entries[name] = self._parse_entry(name, entry, data_size)

        spans = sorted((e.begin, e.end, name) for name, e in self._entries.items())
        prev_end, prev_name = 0, None
        for begin, end, name in spans:
            if begin == end:
                continue
            if begin < prev_end:
                raise self._err(
                    f"bytes [{begin}, {end}) overlap tensor {prev_name!r} (ends at {prev_end})",
                    name,
                )
            prev_end, prev_name = end, name
        return 8 + n

    def _parse_entry(self, name: str, entry, data_size: int) -> _TensorEntry:
        if not isinstance(entry, dict):
            raise self._err(f"header entry is a JSON {type(entry).__name__}, not an object", name)
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise self._err(f"header entry has no {field!r}", name)
        dtype_str = entry["dtype"]
        if not isinstance(dtype_str, str) or dtype_str not in DTYPES:
            raise self._err(
                f"unknown dtype {dtype_str!r} (known: {', '.join(DTYPES)})", name
            )
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise self._err(f"shape {shape!r} is not a list of non-negative integers", name)
        offsets = entry["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
        ):
            raise self._err(f"data_offsets {offsets!r} is not a pair of integers", name)
        begin, end = offsets
        if begin < 0 or end < 0:
            raise self._err(f"data_offsets {offsets} are negative", name)
        if end < begin:
            raise self._err(f"data_offsets {offsets} are out of order (end before begin)", name)
        if end > data_size:
            raise self._err(
                f"data_offsets {offsets} run past the end of the file "
                f"(data section is {data_size} bytes)",
                name,
            )
        dtype = DTYPES[dtype_str]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise self._err(
                f"data_offsets {offsets} hold {end - begin} bytes, but shape {shape} of "
                f"{dtype_str} needs {nbytes}",
                name,
            )
        return _TensorEntry(dtype_str, dtype, tuple(shape), begin, end)

    # -- access -----------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` object (empty if the file has none)."""
        return dict(self._metadata)

    def keys(self) -> list[str]:
        """Tensor names in file order (ascending data offset), the cheapest order to stream."""
        return sorted(self._entries, key=lambda k: (self._entries[k].begin, k))

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def _entry(self, name: str) -> _TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise MissingTensor(f"{self.path}: no tensor {name!r}") from None

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """``(dtype string, shape)`` from the header, without touching the data."""
        e = self._entry(name)
        return e.dtype_str, e.shape

    def data_offset(self, name: str) -> int:
        """Absolute byte offset of the tensor's data within the file."""
        return self._data_start + self._entry(name).begin

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only zero-copy view into the memory map (see class doc)."""
        if self._closed:
            raise ValueError(f"{self.path}: file is closed")
        e = self._entry(name)
        count = math.prod(e.shape)
        if count == 0:
            empty = np.zeros(e.shape, dtype=e.dtype)
            empty.flags.writeable = False
            return empty
        flat = np.frombuffer(
            self._mm, dtype=e.dtype, count=count, offset=self._data_start + e.begin
        )
        return flat.reshape(e.shape)

    def close(self) -> None:
        # Views already handed out hold their own reference to the mapping, so dropping
        # ours cannot invalidate them.
        self._mm = None
        self._closed = True

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"


# -- writing ----------------------------------------------------------------------------


def _header_bytes(header: dict) -> bytes:
    # Compact separators and raw UTF-8 match serde_json, which the reference writer uses.
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    raw = text.encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, atomically.

    Layout follows the reference library exactly (tensors ordered by dtype alignment, then
    name; header padded with spaces to a multiple of 8), so for the same input the bytes are
    identical, except that ``metadata`` keys are written sorted where the reference's order
    is unspecified. Data goes to a temporary file in the same directory which is fsynced and
    renamed over ``path`` only when complete: an interrupted write never leaves a file at
    ``path`` that looks whole.
    """
    path = Path(path)
    prepared = []
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor name {name!r} is not a string")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot be a tensor name")
        arr = np.asarray(value)
        dt_name = dtype_name(arr.dtype)
        # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
        arr = np.require(arr, dtype=DTYPES[dt_name], requirements="C")
        prepared.append((name, dt_name, arr))
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must be str -> str, got {k!r}: {v!r}")

    prepared.sort(key=lambda t: (-_WRITE_RANK[t[1]], t[0]))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name, dt_name, arr in prepared:
        header[name] = {
            "dtype": dt_name,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    head = _header_bytes(header)

    def body(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _, arr in prepared:
            if arr.size:
                f.write(arr.reshape(-1).view(np.uint8).data)
    atomic_write(path, body, fsync=True)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable. Best effort: some platforms cannot open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- sharded checkpoints ----------------------------------------------------------------

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class ShardedCheckpoint:
    """A Hugging Face checkpoint directory: tensor name -> shard file, shards opened lazily.

    Looks for ``model.safetensors.index.json``, then ``model.safetensors.index.json.gz``,
    then a single ``model.safetensors``. The index is trusted only as far as it goes: a
    shard it names that is missing, or that lacks the tensor, raises
    :class:`SafetensorsError` naming both when that tensor is first asked for.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._files: dict[str, SafetensorsFile] = {}
        self.index_metadata: dict = {}
        index = self.directory / INDEX_NAME
        index_gz = self.directory / (INDEX_NAME + ".gz")
        single = self.directory / SINGLE_NAME
        if index.is_file():
            self.index_path = index
            self._weight_map = self._load_index(index, index.read_bytes())
        elif index_gz.is_file():
            self.index_path = index_gz
            try:
                raw = gzip.decompress(index_gz.read_bytes())
            except (OSError, EOFError) as e:
                raise SafetensorsError(f"{index_gz}: not a readable gzip file ({e})") from None
            self._weight_map = self._load_index(index_gz, raw)
        elif single.is_file():
            self.index_path = None
            self._files[SINGLE_NAME] = SafetensorsFile(single)
            self._weight_map = {k: SINGLE_NAME for k in self._files[SINGLE_NAME].keys()}
        else:
            raise SafetensorsError(
                f"{self.directory}: no {INDEX_NAME}, {INDEX_NAME}.gz or {SINGLE_NAME}"
            )

    def _load_index(self, path: Path, raw: bytes) -> dict[str, str]:
        try:
            index = json.loads(raw.decode("utf-8"))
        except ValueError as e:
            raise SafetensorsError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise SafetensorsError(f"{path}: no 'weight_map' object")
        meta = index.get("metadata")
        self.index_metadata = meta if isinstance(meta, dict) else {}
        weight_map = index["weight_map"]
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise SafetensorsError(f"{path}: tensor {name!r}: shard {shard!r} is not a string")
            # Shard names come from a downloaded file; never let one reach outside the
            # checkpoint directory.
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise SafetensorsError(
                    f"{path}: tensor {name!r}: shard {shard!r} is outside the checkpoint directory"
                )
        return dict(weight_map)

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._weight_map)

    def __contains__(self, name) -> bool:
        return name in self._weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def shard_of(self, name: str) -> str:
        """The shard file name (relative to the directory) holding ``name``."""
        try:
            return self._weight_map[name]
        except KeyError:
            raise MissingTensor(f"{self.directory}: no tensor {name!r} in the checkpoint") from None

    def shards(self) -> dict[str, list[str]]:
        """Shard file name -> the tensor names it holds (sorted), for streaming shard by shard."""
        out: dict[str, list[str]] = {}
        for name in self.keys():
            out.setdefault(self._weight_map[name], []).append(name)
        return dict(sorted(out.items()))

    def _file_for(self, name: str) -> SafetensorsFile:
        shard = self.shard_of(name)
        f = self._files.get(shard)
        if f is None:
            path = self.directory / shard
            if not path.is_file():
                raise SafetensorsError(
                    f"{self.index_path}: tensor {name!r} is mapped to shard {shard!r}, "
                    f"but {path} does not exist"
                )
            f = self._files[shard] = SafetensorsFile(path)
        if name not in f:
            raise SafetensorsError(
                f"{self.index_path or self.directory}: tensor {name!r} is mapped to shard "
                f"{shard!r}, but {f.path} does not contain it"
            )
        return f

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._file_for(name).info(name)

    def get(self, name: str) -> np.ndarray:
        """Read-only zero-copy view, as :meth:`SafetensorsFile.get`."""
        return self._file_for(name).get(name)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedCheckpoint({str(self.directory)!r}, {len(self._weight_map)} tensors)"
