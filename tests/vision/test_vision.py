"""MoonViT-V2 + merger + projector (k3jax.layers.vision), preprocessing, the name map, the
media-pad merge and `k3jax vision-features`.

Parity: fixture_v (Moonshot's modeling_kimi_k3.py, fp32). Each fixed piece is also held to an
independent per-element reference written here (bilinear resize, 2D RoPE, time embedding,
segment attention), and bilinear additionally to torch itself.
"""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FIXTURES, REFERENCE_CONFIG, need, rel_l2
from k3jax.config import K3Config, VisionConfig
from k3jax.layers import vision as V
from k3jax.model.multimodal import merge_image_features
from k3jax.vision import preprocess as P
from k3jax.checkpoint.vision_names import (VisionCheckpointError, load_vision_params, vision_params_to_hf,
                                       vision_tensor_map)

FV = FIXTURES / "fixture_v"


@pytest.fixture(scope="module")
def fixture_v():
    need(FV / "features.npy")
    vcfg = K3Config.from_hf(FV / "config.json").vision
    params = load_vision_params(vcfg, FV)
    return {"vcfg": vcfg, "params": params, "pixels": np.load(FV / "pixel_values.npy"),
            "grids": np.load(FV / "grid_thws.npy"), "features": np.load(FV / "features.npy"),
            "inter": dict(np.load(FV / "intermediates.npz"))}


def _tiny_vcfg(**kw) -> VisionConfig:
    base = dict(patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
                vt_num_attention_heads=3, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
                qkv_hidden_size=48, merge_kernel_size=(2, 2), mm_hidden_size=32, text_hidden_size=64)
    base.update(kw)
    return VisionConfig(**base)


# ----------------------------------------------------------------------------- parity

def test_fixture_v_features_parity(fixture_v):
    f = fixture_v
    out = np.asarray(V.vision_features(f["vcfg"], f["params"], f["pixels"], f["grids"]))
    ref = f["features"]
    assert out.shape == ref.shape == (12, 64)
    rows = V.rows_per_image(f["vcfg"], V.check_grids(f["vcfg"], f["grids"]))
    start = 0
    for n in rows:
        err = rel_l2(out[start:start + n], ref[start:start + n])
        # fixture README: fp32 noise floor ~4e-7; the GELU-variant probes sit at >= 1.3e-4.
        assert err <= 1e-5, err
        start += n
    assert np.abs(out - ref).max() <= 1e-4


def test_fixture_v_intermediates(fixture_v):
    """Stage by stage, so a miss is localised: patch proj, + pos emb, encoder, merge, projector."""
    f = fixture_v
    vcfg, p, inter = f["vcfg"], f["params"], f["inter"]
    grids = V.check_grids(vcfg, f["grids"])
    px = jnp.asarray(f["pixels"])
    proj = px.reshape(px.shape[0], -1) @ p["vision_tower"]["patch_embed"]["proj"]["kernel"]
    assert rel_l2(proj, inter["patch_proj_out"]) <= 1e-6
    emb = V.PatchEmbed(vcfg).apply({"params": p["vision_tower"]["patch_embed"]}, px, grids)
    assert rel_l2(emb, inter["embed_out"]) <= 1e-6
    enc = V.VisionTower(vcfg).apply({"params": p["vision_tower"]}, px, grids)
    assert rel_l2(enc, inter["encoder_out"]) <= 1e-5
    merged = V.tpool_merge(jnp.asarray(inter["encoder_out"]), grids, (2, 2))
    np.testing.assert_array_equal(np.asarray(merged), inter["merged"].reshape(12, -1))
    pm = p["mm_projector"]
    pre = jax.nn.gelu(jnp.asarray(inter["merged"].reshape(12, -1)) @ pm["proj_0"]["kernel"],
                      approximate=False) @ pm["proj_2"]["kernel"]
    assert rel_l2(pre, inter["projector_pre_norm"]) <= 1e-6


# ----------------------------------------------------------------------------- fixed pieces

def _bilinear_loop(src: np.ndarray, h: int, w: int) -> np.ndarray:
    """Per output element, torch's align_corners=False rule: source = (i+.5)·in/out − .5, <0 → 0."""
    h0, w0, d = src.shape
    out = np.zeros((h, w, d))

    def coord(i, n_in, n_out):
        s = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        lo = min(int(math.floor(s)), n_in - 1)
        return lo, min(lo + 1, n_in - 1), s - lo

    for i in range(h):
        y0, y1, ly = coord(i, h0, h)
        for j in range(w):
            x0, x1, lx = coord(j, w0, w)
            for c in range(d):
                out[i, j, c] = ((1 - ly) * ((1 - lx) * src[y0, x0, c] + lx * src[y0, x1, c])
                                + ly * ((1 - lx) * src[y1, x0, c] + lx * src[y1, x1, c]))
    return out


@pytest.mark.parametrize("hw", [(4, 6), (6, 4), (13, 9), (3, 11), (1, 1), (5, 7), (16, 2)])
def test_bilinear_pos_emb_matches_loop_and_torch(hw):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    table = rng.standard_normal((5, 7, 3)).astype(np.float32)
    h, w = hw
    ours = np.asarray(V.interpolate_pos_emb(jnp.asarray(table), h, w)).reshape(h, w, 3)
    np.testing.assert_allclose(ours, _bilinear_loop(table.astype(np.float64), h, w), rtol=0, atol=2e-6)
    ref = torch.nn.functional.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(h, w),
                                          mode="bilinear", align_corners=False)[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-6)


def test_bilinear_is_not_jax_image_resize():
    """jax.image.resize antialiases when shrinking; the reference does not (fixture probe: 0.235 rel L2)."""
    table = np.random.default_rng(1).standard_normal((8, 8, 2)).astype(np.float32)
    ours = np.asarray(V.interpolate_pos_emb(jnp.asarray(table), 3, 5)).reshape(3, 5, 2)
    aa = np.asarray(jax.image.resize(jnp.asarray(table), (3, 5, 2), "bilinear"))
    assert np.abs(ours - aa).max() > 1e-2


def test_rope_matches_per_element_loop():
    hd, nh, grids = 8, 2, ((2, 3, 5), (1, 2, 4))
    cos, sin = V.packed_rope(grids, hd)
    L = sum(t * h * w for t, h, w in grids)
    x = np.random.default_rng(2).standard_normal((L, nh, hd)).astype(np.float32)
    ours = np.asarray(V.apply_rope(jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin)))
    ref = np.zeros_like(x, dtype=np.float64)
    n = 0
    for t, h, w in grids:
        for _ in range(t):  # every frame restarts at the image's own positions
            for r in range(h):
                for c in range(w):
                    for head in range(nh):
                        for j in range(hd // 2):
                            pos = c if j % 2 == 0 else r  # even pair: column; odd pair: row
                            ang = pos * 10000.0 ** (-4 * (j // 2) / hd)
                            z = complex(x[n, head, 2 * j], x[n, head, 2 * j + 1]) * complex(math.cos(ang),
                                                                                           math.sin(ang))
                            ref[n, head, 2 * j], ref[n, head, 2 * j + 1] = z.real, z.imag
                    n += 1
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-6)


def test_time_embedding_matches_loop():
    d, t = 10, 4
    ours = V.time_embedding(t, d)
    for p in range(t):
        for k in range(d):
            om = 10000.0 ** (-(k % (d // 2)) / (d / 2))
            want = math.sin(p * om) if k < d // 2 else math.cos(p * om)
            assert abs(ours[p, k] - want) < 1e-6


def test_segment_attention_matches_masked_dense():
    rng = np.random.default_rng(3)
    lengths, nh, hd = (5, 3, 4), 2, 4
    q, k, v = (rng.standard_normal((sum(lengths), nh, hd)).astype(np.float32) for _ in range(3))
    seg = np.repeat(np.arange(len(lengths)), lengths)
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    s = np.where(seg[None, :, None] == seg[None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("hqk,khd->qhd", p, v)
    np.testing.assert_allclose(np.asarray(V.segment_attention(q, k, v, lengths)), ref, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- packing

def test_packed_images_do_not_attend_across(fixture_v):
    vcfg, params = fixture_v["vcfg"], fixture_v["params"]
    rng = np.random.default_rng(4)
    ga, gb = (1, 4, 6), (2, 2, 4)  # different sizes; b is a 2-frame video
    pa = rng.standard_normal((24, 3, 14, 14)).astype(np.float32)
    pb = rng.standard_normal((16, 3, 14, 14)).astype(np.float32)
    fa = np.asarray(V.vision_features(vcfg, params, pa, [ga]))
    fb = np.asarray(V.vision_features(vcfg, params, pb, [gb]))
    packed = np.asarray(V.vision_features(vcfg, params, np.concatenate([pa, pb]), [ga, gb]))
    assert packed.shape == (6 + 2, 64)
    np.testing.assert_allclose(packed[:6], fa, rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed[6:], fb, rtol=0, atol=1e-5)
    # Changing image b's pixels leaves image a's rows bit-identical.
    packed2 = np.asarray(V.vision_features(vcfg, params, np.concatenate([pa, pb * -3.0]), [ga, gb]))
    np.testing.assert_array_equal(packed2[:6], packed[:6])
    assert np.abs(packed2[6:] - packed[6:]).max() > 1e-3


# ----------------------------------------------------------------------------- sizes

def test_init_shapes_match_the_name_map():
    vcfg = _tiny_vcfg(vt_num_hidden_layers=3)
    shapes = V.vision_param_shapes(vcfg)
    for e in vision_tensor_map(vcfg):
        leaf = shapes
        for k in e.path:
            leaf = leaf[k]
        assert leaf.shape[:len(e.index)] == ((3,) if e.index else ()), e.hf
    assert shapes["vision_tower"]["patch_embed"]["proj"]["kernel"].shape == (3 * 14 * 14, 32)


def test_param_count_real_config():
    vcfg = K3Config.from_hf(need(REFERENCE_CONFIG)).vision
    n = V.count_vision_params(vcfg)
    d, q, i, p = vcfg.vt_hidden_size, vcfg.qkv_hidden_size, vcfg.vt_intermediate_size, vcfg.patch_size
    tower = (3 * p * p * d + vcfg.init_pos_emb_height * vcfg.init_pos_emb_width * d
             + vcfg.vt_num_hidden_layers * (2 * d + 3 * q * d + q * d + 2 * d * i) + d)
    proj = (4 * d) ** 2 + 4 * d * vcfg.text_hidden_size + vcfg.text_hidden_size
    assert (n["vision_tower"], n["mm_projector"]) == (tower, proj)
    assert round(n["vision_tower"] / 1e9, 2) == 0.40 and round(n["mm_projector"] / 1e9, 3) == 0.046
    # The full-size forward traces for a large and a one-side-maximal image (nothing allocated).
    grids = ((1, 74, 74), (1, 2, 512))
    x = jax.ShapeDtypeStruct((74 * 74 + 2 * 512, 3, 14, 14), jnp.float32)
    out = jax.eval_shape(lambda prm, px: V._forward(vcfg, jnp.dtype(jnp.bfloat16), grids, prm, px),
                         V.vision_param_shapes(vcfg, jnp.bfloat16), x)
    assert out.shape == (37 * 37 + 256, 7168) and out.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- name map

def test_vision_names_round_trip(fixture_v):
    from k3jax.checkpoint.safetensors_io import SafetensorsFile
    vcfg = fixture_v["vcfg"]
    out = vision_params_to_hf(vcfg, fixture_v["params"])
    with SafetensorsFile(FV / "model.safetensors") as f:
        assert sorted(out) == sorted(f.keys()) == sorted(e.hf for e in vision_tensor_map(vcfg))
        for name, arr in out.items():
            np.testing.assert_array_equal(arr, f.get(name), err_msg=name)


class _FakeCkpt:
    def __init__(self, tensors):
        self.t = tensors

    def keys(self):
        return list(self.t)

    def info(self, name):
        return "F32", self.t[name].shape

    def get(self, name):
        return self.t[name]


def test_vision_names_errors(fixture_v):
    vcfg = fixture_v["vcfg"]
    good = vision_params_to_hf(vcfg, fixture_v["params"])
    missing = {k: v for k, v in good.items() if k != "vision_tower.encoder.blocks.1.wo.weight"}
    with pytest.raises(VisionCheckpointError, match="blocks.1.wo.weight"):
        load_vision_params(vcfg, _FakeCkpt(missing))
    extra = dict(good, **{"mm_projector.proj.4.weight": np.zeros(3, np.float32)})
    with pytest.raises(VisionCheckpointError, match="proj.4"):
        load_vision_params(vcfg, _FakeCkpt(extra))
    bad = dict(good, **{"vision_tower.patch_embed.pos_emb.weight": np.zeros((64, 64, 32), np.float32)})
    with pytest.raises(VisionCheckpointError, match=r"pos_emb.weight: shape \(64, 64, 32\)"):
        load_vision_params(vcfg, _FakeCkpt(bad))


# ----------------------------------------------------------------------------- input errors

def test_bad_inputs_are_clear_errors(fixture_v):
    vcfg, params, px = fixture_v["vcfg"], fixture_v["params"], fixture_v["pixels"]
    g = fixture_v["grids"]
    with pytest.raises(V.VisionInputError, match="channels-last"):
        V.vision_features(vcfg, params, px.transpose(0, 2, 3, 1), g)
    with pytest.raises(V.VisionInputError, match="whole images"):
        V.vision_features(vcfg, params, np.zeros((1, 56, 84, 3), np.float32), g)
    with pytest.raises(V.VisionInputError, match="48 patches but"):
        V.vision_features(vcfg, params, px, [[1, 4, 6]])
    with pytest.raises(V.VisionInputError, match="not divisible by the merge kernel"):
        V.check_grids(vcfg, [[1, 3, 6]])
    with pytest.raises(V.VisionInputError, match="5 frames"):
        V.check_grids(vcfg, [[5, 2, 2]])
    with pytest.raises(V.VisionInputError, match=r"\[num_images, 3\]"):
        V.check_grids(vcfg, [1, 4, 6])
    with pytest.raises(V.VisionInputError, match="integers"):
        V.check_grids(vcfg, [[1.0, 4.0, 6.0]])
    with pytest.raises(V.VisionInputError, match="floating"):
        V.vision_features(vcfg, params, px.astype(np.int32), g)


# ----------------------------------------------------------------------------- preprocessing

def test_patchify_matches_fixture_layout(fixture_v):
    imgs = np.load(FV / "images.npz")
    pix, grids = [], []
    for i in range(2):
        p, g = P.patchify(imgs[f"image{i}"], 14)
        pix.append(p)
        grids.append(g)
    np.testing.assert_array_equal(np.concatenate(pix), fixture_v["pixels"])
    np.testing.assert_array_equal(np.asarray(grids), fixture_v["grids"])
    with pytest.raises(V.VisionInputError, match="multiple of the patch size"):
        P.patchify(np.zeros((1, 30, 28, 3)), 14)


def test_resize_plan_budget_and_padding():
    mc = P.MediaConfig()
    r = P.resize_plan(150, 100, mc)  # small: no resize, pad to 168 x 112
    assert (r["new_width"], r["new_height"], r["pad_width"], r["pad_height"]) == (150, 100, 18, 12)
    assert (r["grid_h"], r["grid_w"], r["num_tokens"]) == (8, 12, 24)
    r = P.resize_plan(20000, 15000, mc)  # large: shrunk into the 65536-patch budget, aspect kept
    assert r["grid_h"] * r["grid_w"] <= 65536 + 2 * (r["grid_h"] + r["grid_w"])
    assert r["grid_h"] % 2 == 0 and r["grid_w"] % 2 == 0
    assert abs(r["new_width"] / r["new_height"] - 4 / 3) < 1e-2
    r = P.resize_plan(100000, 50, mc)  # one side capped at 512 patches
    # int() truncation of width·scale (as in the processor) can land one pixel short; the pad restores it
    assert r["grid_w"] == 512 and 512 * 14 - 1 <= r["new_width"] <= 512 * 14
    small = P.MediaConfig(in_patch_limit=64)
    r = P.resize_plan(280, 280, small)
    assert (r["new_width"], r["grid_h"], r["grid_w"]) == (112, 8, 8)


def test_preprocess_image_files(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(5)
    rgb = (rng.random((30, 45, 3)) * 255).astype(np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    Image.fromarray(np.zeros((20, 20, 4), np.uint8)).save(tmp_path / "clear.png")  # fully transparent
    pix, grids = P.preprocess_images([tmp_path / "a.png", tmp_path / "clear.png"])
    assert grids.tolist() == [[1, 4, 4], [1, 2, 2]]
    assert pix.shape == (16 + 4, 3, 14, 14) and pix.dtype == np.float32
    frames = pix[:16].reshape(1, 4, 4, 3, 14, 14).transpose(0, 1, 4, 2, 5, 3).reshape(1, 56, 56, 3)
    np.testing.assert_allclose(frames[0, :30, :45], rgb / 127.5 - 1.0, atol=1e-6)  # mean = std = 0.5
    assert np.all(frames[0, 30:] == -1.0) and np.all(frames[0, :, 45:] == -1.0)  # black zero pad
    clear = pix[16:].reshape(1, 2, 2, 3, 14, 14).transpose(0, 1, 4, 2, 5, 3).reshape(28, 28, 3)
    # transparent pixels show K3's chessboard: 8-px squares, white (255) at the top-left, gray 180
    assert np.allclose(clear[0, 0], 1.0) and np.allclose(clear[0, 8], 180 / 127.5 - 1.0)
    assert np.allclose(clear[8, 8], 1.0)
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(V.VisionInputError, match="cannot decode"):
        P.preprocess_images([tmp_path / "junk.png"])


# ----------------------------------------------------------------------------- text side

def test_expand_media_pads_and_merge():
    pad = 505
    toks = np.array([1, pad, 7, 8, pad, 9])
    ex = P.expand_media_pads(toks, [3, 2], pad)
    assert ex.tolist() == [1, pad, pad, pad, 7, 8, pad, pad, 9]
    with pytest.raises(V.VisionInputError, match="2 <|media_pad|>"):
        P.expand_media_pads(toks, [3], pad)

    d = 4
    emb = np.arange(2 * 9 * d, dtype=np.float32).reshape(2, 9, d)
    tokens = np.stack([ex, np.array([pad, 2, 3, 4, 5, 6, 7, 8, pad])])
    feats = -np.arange(1, 8, dtype=np.float32)[:, None] * np.ones((1, d), np.float32)
    out = np.asarray(merge_image_features(emb, tokens, feats, pad))
    want = emb.copy()
    k = 0
    for b in range(2):
        for t in range(9):
            if tokens[b, t] == pad:
                want[b, t] = feats[k]
                k += 1
    np.testing.assert_array_equal(out, want)
    jitted = jax.jit(lambda e, t, f: merge_image_features(e, t, f, pad))(emb, tokens, feats)
    np.testing.assert_array_equal(np.asarray(jitted), want)
    with pytest.raises(V.VisionInputError, match="7 <|media_pad|>"):
        merge_image_features(emb, tokens, feats[:5], pad)
    with pytest.raises(V.VisionInputError, match="must match"):
        merge_image_features(emb, tokens[:, :5], feats, pad)


# ----------------------------------------------------------------------------- command

def _cli(argv):
    from k3jax.cli import build_parser
    args = build_parser().parse_args(argv)
    return args.fn(args)


def test_vision_features_command(tmp_path, fixture_v):
    out = tmp_path / "f.npy"
    assert _cli(["vision-features", str(FV), "--pixels", str(FV / "pixel_values.npy"),
                 "--grids", str(FV / "grid_thws.npy"), "--out", str(out)]) == 0
    got = np.load(out)
    assert got.dtype == np.float32 and rel_l2(got, fixture_v["features"]) <= 1e-5

    from PIL import Image
    Image.fromarray((np.random.default_rng(6).random((56, 84, 3)) * 255).astype(np.uint8)).save(tmp_path / "i.png")
    assert _cli(["vision-features", str(FV), "--image", str(tmp_path / "i.png"), "--out", str(tmp_path / "g.npy"),
                 "--grids-out", str(tmp_path / "grid.npy")]) == 0
    assert np.load(tmp_path / "g.npy").shape == (6, 64) and np.load(tmp_path / "grid.npy").tolist() == [[1, 4, 6]]

    with pytest.raises(ValueError, match="npz archive"):
        _cli(["vision-features", str(FV), "--pixels", str(FV / "images.npz"), "--grids",
              str(FV / "grid_thws.npy"), "--out", str(out)])
    with pytest.raises(ValueError, match="needs --grids"):
        _cli(["vision-features", str(FV), "--pixels", str(FV / "pixel_values.npy"), "--out", str(out)])
    cfg = tmp_path / "noviz"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    with pytest.raises(ValueError, match="no vision_config"):
        _cli(["vision-features", str(cfg), "--pixels", str(FV / "pixel_values.npy"), "--grids",
              str(FV / "grid_thws.npy"), "--out", str(out)])


def test_bfloat16_compute_runs(fixture_v):
    """bf16 activations (the real checkpoint's dtype): finite and close to fp32; not a parity gate,
    the ViT's eps=None RMSNorm itself becomes 2^-7 in bf16."""
    f = fixture_v
    out = np.asarray(V.vision_features(f["vcfg"], f["params"], f["pixels"], f["grids"], dtype=jnp.bfloat16),
                     np.float32)
    assert np.isfinite(out).all() and rel_l2(out, f["features"]) < 5e-2
