"""Our safetensors reader/writer against the reference library, corrupt files, shards."""
import gzip
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_np

from k3jax.checkpoint import safetensors_io
from k3jax.checkpoint.safetensors_io import (
    SafetensorsError,
    SafetensorsFile,
    ShardedCheckpoint,
    write_safetensors,
)
from helpers import FIXTURES

FIXTURE_B = FIXTURES / "fixture_b" / "model.safetensors"


def _numpy_tensors(rng) -> dict[str, np.ndarray]:
    """Every dtype safetensors.numpy handles, odd shapes included."""
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f64": rng.standard_normal((2, 2, 2)),
        "f16": rng.standard_normal(7).astype(np.float16),
        "i8": rng.integers(-128, 128, (4, 3), dtype=np.int8),
        "u8": rng.integers(0, 256, 9, dtype=np.uint8),
        "i16": rng.integers(-(2**15), 2**15, 5, dtype=np.int16),
        "u16": rng.integers(0, 2**16, 5, dtype=np.uint16),
        "i32": rng.integers(-(2**31), 2**31, (2, 3), dtype=np.int32),
        "u32": rng.integers(0, 2**32, 3, dtype=np.uint32),
        "i64": rng.integers(-(2**62), 2**62, 4, dtype=np.int64),
        "u64": rng.integers(0, 2**63, 4, dtype=np.uint64),
        "bool": rng.random((3, 3)) > 0.5,
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "model.layers.0.a_name.with.dots": np.arange(6, dtype=np.int32).reshape(2, 3),
    }


def _ml_tensors(rng) -> dict[str, np.ndarray]:
    x = rng.standard_normal((4, 6)).astype(np.float32)
    return {
        "bf16": x.astype(ml_dtypes.bfloat16),
        "e4m3": x.astype(ml_dtypes.float8_e4m3fn),
        "e5m2": x.astype(ml_dtypes.float8_e5m2),
        "e8m0": rng.integers(0, 256, 10, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
    }


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- against the reference library ------------------------------------------------------


def test_our_file_reads_with_reference_and_is_byte_identical(tmp_path):
    tensors = _numpy_tensors(np.random.default_rng(0))
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors, metadata={"format": "np"})
    back = st_np.load_file(str(ours))
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert _bits_equal(back[k], v), k
    assert ours.read_bytes() == st_np.save(tensors, metadata={"format": "np"})
    write_safetensors(tmp_path / "no_meta.bin", tensors)
    assert (tmp_path / "no_meta.bin").read_bytes() == st_np.save(tensors)


def test_reference_file_reads_with_ours(tmp_path):
    tensors = _numpy_tensors(np.random.default_rng(1))
    path = tmp_path / "ref.safetensors"
    st_np.save_file(tensors, str(path), metadata={"a": "1", "b": "two"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"a": "1", "b": "two"}
        assert sorted(f.keys()) == sorted(tensors)
        for k, v in tensors.items():
            got = f.get(k)
            assert _bits_equal(got, v), k
            assert f.info(k) == (safetensors_io.dtype_name(v.dtype), v.shape)


def test_ml_dtypes_round_trip_through_ours(tmp_path):
    tensors = _ml_tensors(np.random.default_rng(2))
    path = tmp_path / "f8.safetensors"
    write_safetensors(path, tensors)
    with SafetensorsFile(path) as f:
        assert {k: f.info(k)[0] for k in f.keys()} == {
            "bf16": "BF16", "e4m3": "F8_E4M3", "e5m2": "F8_E5M2", "e8m0": "F8_E8M0"
        }
        for k, v in tensors.items():
            assert _bits_equal(f.get(k), v), k


def test_ml_dtypes_against_reference_via_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is how the reference reads bf16/fp8")
    import safetensors.torch as st_pt

    tensors = _ml_tensors(np.random.default_rng(3))
    torch_dtype = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
                   "e5m2": torch.float8_e5m2, "e8m0": torch.float8_e8m0fnu}
    as_torch = {
        k: torch.from_numpy(v.view(np.uint8 if v.itemsize == 1 else np.int16).copy())
        .view(torch_dtype[k])
        for k, v in tensors.items()
    }
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors)
    assert ours.read_bytes() == st_pt.save(as_torch)
    ref = tmp_path / "ref.safetensors"
    st_pt.save_file(as_torch, str(ref))
    with SafetensorsFile(ref) as f:
        for k, v in tensors.items():
            assert _bits_equal(f.get(k), v), k


def test_writer_accepts_non_contiguous_and_big_endian(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    b = np.arange(5, dtype=">i4")
    write_safetensors(tmp_path / "x.safetensors", {"a": a, "b": b})
    back = st_np.load_file(str(tmp_path / "x.safetensors"))
    assert np.array_equal(back["a"], a) and np.array_equal(back["b"], b)
    assert back["b"].dtype == np.dtype("<i4")


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="complex"):
        write_safetensors(tmp_path / "x", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="reserved"):
        write_safetensors(tmp_path / "x", {"__metadata__": np.zeros(2)})
    with pytest.raises(TypeError, match="str -> str"):
        write_safetensors(tmp_path / "x", {"a": np.zeros(2)}, metadata={"k": 1})
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": np.ones(3, np.float32)})
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors(path, {"a": np.zeros(1000, np.float32)})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


# -- zero-copy / partial reads ----------------------------------------------------------


def test_get_is_a_read_only_view_into_the_mapping(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.arange(10, dtype=np.float32), "b": np.ones(4, np.uint8)})
    f = SafetensorsFile(path)
    a1, a2 = f.get("a"), f.get("a")
    assert np.shares_memory(a1, a2)  # both views of the same mapped bytes, no copy
    assert not a1.flags.writeable
    mm = f._mm
    assert a1.ctypes.data - mm.ctypes.data == f.data_offset("a")
    raw = path.read_bytes()
    start = f.data_offset("a")
    assert raw[start : start + 40] == np.arange(10, dtype=np.float32).tobytes()
    f.close()
    assert np.array_equal(a1, np.arange(10))  # views outlive close
    with pytest.raises(ValueError, match="closed"):
        f.get("a")


def test_reads_only_the_tensor_asked_for(tmp_path):
    # A 1 GiB tensor region that is a hole in a sparse file: opening and reading the small
    # tensor must neither read nor allocate it.
    big = 1 << 30
    header = {
        "big": {"dtype": "U8", "shape": [big], "data_offsets": [0, big]},
        "small": {"dtype": "F32", "shape": [3], "data_offsets": [big, big + 12]},
    }
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head)
        fh.seek(8 + len(head) + big)
        fh.write(np.array([1.0, 2.0, 3.0], np.float32).tobytes())
    with SafetensorsFile(path) as f:
        assert np.array_equal(f.get("small"), [1.0, 2.0, 3.0])
        assert f.info("big") == ("U8", (big,))


# -- corrupt files ----------------------------------------------------------------------

_GOOD = {
    "alpha": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "beta": {"dtype": "U8", "shape": [4], "data_offsets": [24, 28]},
}


def _write_raw(path: Path, header, data: bytes = bytes(28), n: int | None = None) -> Path:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head) if n is None else n) + head + data)
    return path


def _edit(name, **fields):
    h = json.loads(json.dumps(_GOOD))
    for k, v in fields.items():
        if v is None:
            del h[name][k]
        else:
            h[name][k] = v
    return h


@pytest.mark.parametrize(
    "header, n, tensor, message",
    [
        (_edit("beta", dtype=None), None, "beta", "no 'dtype'"),
        (_edit("beta", shape=None), None, "beta", "no 'shape'"),
        (_edit("alpha", data_offsets=None), None, "alpha", "no 'data_offsets'"),
        (_edit("beta", dtype="F7"), None, "beta", "unknown dtype"),
        (_edit("alpha", data_offsets=[24, 0]), None, "alpha", "out of order"),
        (_edit("beta", data_offsets=[-4, 0]), None, "beta", "negative"),
        (_edit("beta", data_offsets=[24, 10**9]), None, "beta", "past the end"),
        (_edit("alpha", shape=[2, 4]), None, "alpha", "needs 32"),
        (_edit("beta", data_offsets=[20, 24]), None, "beta", "overlap"),
        (_edit("alpha", shape=[2, -3]), None, "alpha", "non-negative"),
        (_edit("alpha", shape=[True, 3]), None, "alpha", "non-negative"),
        (_edit("alpha", data_offsets=[0]), None, "alpha", "pair"),
        ({**_GOOD, "gamma": [1, 2]}, None, "gamma", "not an object"),
    ],
)
def test_corrupt_entries_name_file_and_tensor(tmp_path, header, n, tensor, message):
    path = _write_raw(tmp_path / "bad.safetensors", header, n=n)
    with pytest.raises(SafetensorsError, match=message) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value) and repr(tensor) in str(e.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x05\x00\x00", "shorter than the 8-byte"),
        (struct.pack("<Q", 10**6) + b"{}", "past the end"),
        (struct.pack("<Q", 10**12), "exceeds"),
        (struct.pack("<Q", 8) + b'{"alpha"', "not valid JSON"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "UTF-8"),
        (struct.pack("<Q", 8) + b"[1, 2]  ", "not an object"),
        (struct.pack("<Q", 32) + b'{"__metadata__": {"a": 1}}      ', "__metadata__"),
        (struct.pack("<Q", 16) + b'{"a": 1, "a": 2}', "duplicate"),
    ],
)
def test_corrupt_headers_name_file(tmp_path, raw, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(SafetensorsError, match=message) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)


def test_truncated_file_names_the_cut_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": np.zeros(100, np.float32), "b": np.zeros(10, np.uint8)})
    os.truncate(path, path.stat().st_size - 4)  # "b" (u8) is stored last
    with pytest.raises(SafetensorsError, match="past the end") as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value) and "'b'" in str(e.value)


def test_good_raw_file_and_unknown_tensor(tmp_path):
    path = _write_raw(tmp_path / "ok.safetensors", _GOOD)
    with SafetensorsFile(path) as f:
        assert f.keys() == ["alpha", "beta"] and f.metadata == {}
        assert f.get("alpha").shape == (2, 3)
        with pytest.raises(KeyError, match="gamma"):
            f.get("gamma")


def test_header_only_file(tmp_path):
    path = tmp_path / "empty.safetensors"
    write_safetensors(path, {"z": np.zeros((0,), np.float32)}, metadata={})
    with SafetensorsFile(path) as f:
        assert f.get("z").shape == (0,) and f.metadata == {}
    assert path.read_bytes() == st_np.save({"z": np.zeros((0,), np.float32)}, metadata={})


# -- sharded checkpoints ----------------------------------------------------------------


def _make_sharded(tmp_path: Path, gz: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    shard1 = {"model.a": rng.standard_normal((2, 3)).astype(np.float32),
              "model.b": np.arange(4, dtype=np.int64)}
    shard2 = {"model.c": rng.standard_normal(5).astype(ml_dtypes.bfloat16)}
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", shard1)
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", shard2)
    index = {
        "metadata": {"total_size": 100},
        "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in shard1},
                       **{k: "model-00002-of-00002.safetensors" for k in shard2}},
    }
    raw = json.dumps(index).encode()
    if gz:
        (tmp_path / "model.safetensors.index.json.gz").write_bytes(gzip.compress(raw))
    else:
        (tmp_path / "model.safetensors.index.json").write_bytes(raw)
    return {**shard1, **shard2}


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
def test_sharded_checkpoint(tmp_path, gz):
    tensors = _make_sharded(tmp_path, gz)
    with ShardedCheckpoint(tmp_path) as ck:
        assert ck.keys() == sorted(tensors) and len(ck) == 3 and "model.c" in ck
        assert ck.index_metadata == {"total_size": 100}
        assert ck._files == {}  # nothing opened until asked
        assert ck.info("model.c") == ("BF16", (5,))
        assert list(ck._files) == ["model-00002-of-00002.safetensors"]
        for k, v in tensors.items():
            assert _bits_equal(ck.get(k), v), k
        assert ck.shards() == {
            "model-00001-of-00002.safetensors": ["model.a", "model.b"],
            "model-00002-of-00002.safetensors": ["model.c"],
        }
        with pytest.raises(KeyError, match="model.zzz"):
            ck.get("model.zzz")


def test_sharded_single_file(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"w": np.ones(3, np.float32)})
    with ShardedCheckpoint(tmp_path) as ck:
        assert ck.keys() == ["w"] and np.array_equal(ck.get("w"), np.ones(3))


def test_sharded_errors_name_tensor_and_shard(tmp_path):
    _make_sharded(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.lost"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with ShardedCheckpoint(tmp_path) as ck:
        with pytest.raises(SafetensorsError, match="does not contain") as e:
            ck.get("model.ghost")
        assert "'model.ghost'" in str(e.value) and "model-00001-of-00002" in str(e.value)
        with pytest.raises(SafetensorsError, match="does not exist") as e:
            ck.info("model.lost")
        assert "'model.lost'" in str(e.value) and "model-00009-of-00009" in str(e.value)
        assert ck.get("model.a").shape == (2, 3)  # the rest stays readable


def test_sharded_rejects_bad_indexes(tmp_path):
    with pytest.raises(SafetensorsError, match="no model.safetensors.index.json"):
        ShardedCheckpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "../x.safetensors"}}')
    with pytest.raises(SafetensorsError, match="outside"):
        ShardedCheckpoint(tmp_path)
    index.write_text('{"metadata": {}}')
    with pytest.raises(SafetensorsError, match="weight_map"):
        ShardedCheckpoint(tmp_path)
    index.write_text("{")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        ShardedCheckpoint(tmp_path)


# -- the real checkpoint layout ---------------------------------------------------------


def test_fixture_b_every_tensor():
    if not FIXTURE_B.exists():
        pytest.skip(f"fixture not found: {FIXTURE_B}")
    counts: dict[str, int] = {}
    with SafetensorsFile(FIXTURE_B) as f, safetensors.safe_open(str(FIXTURE_B), "np") as ref:
        assert sorted(f.keys()) == sorted(ref.keys())
        assert f.metadata == ref.metadata()
        for k in f.keys():
            dt, shape = f.info(k)
            counts[dt] = counts.get(dt, 0) + 1
            got = f.get(k)
            assert got.shape == shape
            if dt == "BF16":
                continue  # numpy cannot hold bf16; checked through torch below
            assert _bits_equal(got, ref.get_tensor(k)), k
    assert counts == {"BF16": 211, "F32": 51, "U8": 432}
    assert any(k.endswith("experts.0.w1.weight_packed") for k in f.keys())

    torch = pytest.importorskip("torch", reason="the reference reads bf16 only through torch")
    with SafetensorsFile(FIXTURE_B) as f, safetensors.safe_open(str(FIXTURE_B), "pt") as ref:
        for k in f.keys():
            if f.info(k)[0] == "BF16":
                want = ref.get_tensor(k).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                assert _bits_equal(f.get(k), want), k
