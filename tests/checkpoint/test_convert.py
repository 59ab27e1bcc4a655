"""HF → Orbax conversion, export back, logits from either, sharded restore, bad inputs."""
import gzip
import json
import re
import shutil

import jax
import numpy as np
import pytest

from helpers import FIXTURES, SHARED, assert_logits_match, need, rel_l2, two_shard_multimodal_checkpoint
from k3jax import cli
from k3jax.checkpoint import convert as convert_mod
from k3jax.checkpoint.convert import MANIFEST, convert, dry_run
from k3jax.checkpoint.export import export
from k3jax.checkpoint.hf_params import load_hf_params
from k3jax.checkpoint.load import load_model_dir
from k3jax.checkpoint.orbax_io import default_shardings, restore_params
from k3jax.checkpoint.safetensors_io import INDEX_NAME, SafetensorsFile, ShardedCheckpoint, write_safetensors
from k3jax.config import K3Config
from k3jax.layers.vision import vision_features
from k3jax.model import param_shapes
from k3jax.checkpoint.vision_names import load_vision_params

REFERENCE = SHARED / "reference" / "kimi-k3"


def _tensors(path):
    with SafetensorsFile(path) as f:
        return {n: np.array(f.get(n)) for n in f.keys()}


def _hf_dir(tmp, tensors, config=None, src="fixture_b"):
    """A one-file HF dir with `tensors` and fixture `src`'s config (or `config`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_safetensors(tmp / "model.safetensors", tensors)
    cfg = config or json.loads((FIXTURES / src / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp


def _no_finished_output(root):
    return not any(p.name == MANIFEST for p in root.rglob("*"))


@pytest.fixture(scope="module")
def fixture_a_orbax(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "a"
    convert(need(FIXTURES / "fixture_a"), out)
    return out


# ---------------------------------------------------------------------------------------
# Round trip: MXFP4 + bf16 + fp32 text tensors (fixture B) and vision tensors (fixture V),
# two shards behind an index → Orbax (the vision tower as its own param tree) → the
# released layout, byte for byte per tensor.
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_convert_export_round_trip_is_byte_identical(tmp_path):
    src, _, v = two_shard_multimodal_checkpoint(tmp_path / "hf")

    manifest = convert(src, tmp_path / "orbax")
    assert manifest["experts"] == "mxfp4" and manifest["vision_tensors"] == 18
    # the vision tower is a param tree next to the text params, usable as loaded
    k3, params = load_model_dir(tmp_path / "orbax", {"param_dtype": "float32"}, vision=True)
    want = load_vision_params(k3.vision, src)
    assert jax.tree.structure(params["vision"]) == jax.tree.structure(want)
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(params["vision"]), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), ref, err_msg=jax.tree_util.keystr(path))
    feats = vision_features(k3.vision, params["vision"], np.load(v / "pixel_values.npy"), np.load(v / "grid_thws.npy"))
    assert rel_l2(feats, np.load(v / "features.npy")) <= 1e-5
    export(tmp_path / "orbax", tmp_path / "back", max_shard_bytes=300_000)
    a, back = ShardedCheckpoint(src), ShardedCheckpoint(tmp_path / "back")
    assert back.keys() == a.keys() and len(back.shards()) > 1
    for n in a.keys():
        assert back.info(n) == a.info(n), n
        assert back.get(n).tobytes() == a.get(n).tobytes(), n
    index = json.loads((tmp_path / "back" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(a.get(n).nbytes for n in a.keys())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "orbax"]  # no temporaries left

    export(tmp_path / "orbax", tmp_path / "bf16", experts_bf16=True)
    f = ShardedCheckpoint(tmp_path / "bf16")
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    from k3jax.checkpoint.mxfp4 import dequantize_mxfp4_np
    want = dequantize_mxfp4_np(a.get(f"{name}.weight_packed"), a.get(f"{name}.weight_scale"))
    assert f.info(f"{name}.weight")[0] == "BF16"
    np.testing.assert_array_equal(f.get(f"{name}.weight").astype(np.float32), want)
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())["text_config"]


# ---------------------------------------------------------------------------------------
# Logits from the Orbax checkpoint, through the command line
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, "data2_fsdp2_expert2"])
def test_logits_command_from_orbax_matches_reference(fixture_a_orbax, tmp_path, mesh):
    d = FIXTURES / "fixture_a"
    out = tmp_path / "logits.npy"
    extra = [] if mesh is None else ["--mesh", mesh]  # sharded, with 'ep' expert dispatch
    assert cli.main(["logits", str(fixture_a_orbax), "--tokens", str(d / "inputs.npy"), "--out", str(out),
                     *extra]) == 0
    logits, ref = np.load(out), np.load(d / "logits.npy")
    assert logits.dtype == np.float32
    assert_logits_match(logits, ref)


def test_restore_onto_mesh_shardings(fixture_a_orbax):
    cfg = K3Config.from_hf(fixture_a_orbax / "config.json").text
    assert jax.device_count() == 8
    shardings = default_shardings(param_shapes(cfg))
    params = restore_params(fixture_a_orbax, cfg, shardings)
    source = load_hf_params(cfg, FIXTURES / "fixture_a", dtype=np.float32)
    flat_p = dict(jax.tree_util.tree_leaves_with_path(params))
    flat_s = dict(jax.tree_util.tree_leaves_with_path(shardings))
    flat_src = dict(jax.tree_util.tree_leaves_with_path(source))
    assert flat_p.keys() == flat_src.keys()
    n_sharded = 0
    for path, arr in flat_p.items():
        assert arr.sharding == flat_s[path], jax.tree_util.keystr(path)
        n_sharded += "fsdp" in tuple(arr.sharding.spec)
        np.testing.assert_array_equal(np.asarray(arr), flat_src[path], err_msg=jax.tree_util.keystr(path))
    assert n_sharded > len(flat_p) // 2  # most leaves really are split over the 8 devices


# ---------------------------------------------------------------------------------------
# Dry run: the released index, names only
# ---------------------------------------------------------------------------------------
def test_dry_run_maps_every_released_name(capsys):
    ref = need(REFERENCE / "model.safetensors.index.json.gz")
    assert cli.main(["convert", str(REFERENCE), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "497,220 names" in out and "0 missing, 0 unexpected" in out and "complete mapping" in out
    n = len(json.loads(gzip.decompress(ref.read_bytes()))["weight_map"])
    assert n == 497_220


def test_dry_run_lists_unmatched_names(tmp_path, capsys):
    names = list(SafetensorsFile(FIXTURES / "fixture_b" / "model.safetensors").keys())
    gone = "language_model.model.layers.2.self_attn.A_log"
    names = [n for n in names if n != gone] + ["language_model.model.layers.2.self_attn.bogus.weight",
                                               "vision_tower.encoder.blocks.0.wo.weight"]
    tmp_path.joinpath(INDEX_NAME).write_text(json.dumps({"weight_map": {n: "x.safetensors" for n in names}}))
    shutil.copyfile(FIXTURES / "fixture_b" / "config.json", tmp_path / "config.json")
    r = dry_run(tmp_path)
    assert gone in r["missing"] and "language_model.model.layers.2.self_attn.bogus.weight" in r["unexpected"]
    assert "vision_tower.patch_embed.proj.weight" in r["missing"]  # a partial vision tower is reported
    assert cli.main(["convert", str(tmp_path), "--dry-run"]) == 1
    assert f"missing     {gone}" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# Bad inputs: each error names the tensor, and nothing that looks finished is left
# ---------------------------------------------------------------------------------------
BASE = "language_model.model.layers.4.self_attn."


def _bad_missing(t, cfg):
    del t[BASE + "q_proj.weight"]
    return BASE + "q_proj.weight"


def _bad_extra(t, cfg):
    t[BASE + "extra_proj.weight"] = np.zeros((2, 2), np.float32)
    return BASE + "extra_proj.weight"


def _bad_shape(t, cfg):
    t[BASE + "k_proj.weight"] = np.ascontiguousarray(t[BASE + "k_proj.weight"][:, :-1])
    return BASE + "k_proj.weight"


def _bad_dtype(t, cfg):
    t[BASE + "dt_bias"] = t[BASE + "dt_bias"].view(np.int32)  # float bits stored as int
    return BASE + "dt_bias"


def _bad_config(t, cfg):
    cfg["text_config"]["vocab_size"] = 1024  # a config from another checkpoint
    return "language_model.model.embed_tokens.weight"


def _bad_vision_shape(t, cfg):
    name = "vision_tower.encoder.blocks.1.wo.weight"
    t.update(_tensors(FIXTURES / "fixture_v" / "model.safetensors"))
    cfg["vision_config"] = json.loads((FIXTURES / "fixture_v" / "config.json").read_text())["vision_config"]
    t[name] = np.ascontiguousarray(t[name][:, :-1])
    return name


@pytest.mark.parametrize("make_bad", [_bad_missing, _bad_extra, _bad_shape, _bad_dtype, _bad_config,
                                      _bad_vision_shape])
def test_bad_checkpoint_is_refused_naming_the_tensor(tmp_path, make_bad):
    tensors = _tensors(FIXTURES / "fixture_b" / "model.safetensors")
    cfg = json.loads((FIXTURES / "fixture_b" / "config.json").read_text())
    name = make_bad(tensors, cfg)
    src = _hf_dir(tmp_path / "hf", tensors, cfg)
    with pytest.raises(ValueError, match=re.escape(name)):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _no_finished_output(tmp_path)


def test_truncated_shard_is_refused_naming_the_tensor(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    shutil.copyfile(FIXTURES / "fixture_b" / "config.json", src / "config.json")
    data = (FIXTURES / "fixture_b" / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-100])
    f = SafetensorsFile(FIXTURES / "fixture_b" / "model.safetensors")
    cut = [n for n in f.keys() if f.data_offset(n) + f.get(n).nbytes > len(data) - 100]
    with pytest.raises(ValueError, match="|".join(re.escape(f"'{n}'") for n in cut)):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_convert_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = convert_mod._write_entry

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 150:
            raise KeyboardInterrupt("simulated interruption")
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_mod, "_write_entry", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert(FIXTURES / "fixture_b", tmp_path / "out")
    assert calls["n"] == 150
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="out: no such directory"):
        export(tmp_path / "out", tmp_path / "back")


def test_convert_refuses_to_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert(FIXTURES / "fixture_b", tmp_path / "out")
