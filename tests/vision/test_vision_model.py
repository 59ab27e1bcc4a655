"""Images in the token stream end to end: logits, generation and the train step on a tiny
two-layer K3 (KDA + MLA/MoE) with the toy vision tower.

The tests share one tiny checkpoint and one [2, 24] token shape with the same two images
(grids (1, 4, 4) and (1, 2, 8), 4 feature rows each, so both rows expand alike): the
multimodal forward they are held to compiles once for the module. The train step runs a
one-layer model (its backward is the costly compile).
"""
import json

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn

from helpers import rel_l2
from k3jax import cli
from k3jax import model as M
from k3jax.errors import InputError
from k3jax.checkpoint.convert import convert
from k3jax.checkpoint.hf_params import from_tree_layout
from k3jax.checkpoint.load import load_model_dir
from k3jax.checkpoint.names import stored_shape, tensor_map
from k3jax.checkpoint.safetensors_io import write_safetensors
from k3jax.config import K3Config
from k3jax.layers.vision import vision_features, vision_param_shapes
from k3jax.train import config as tconf
from k3jax.train import muon
from k3jax.train import step as tstep
from k3jax.testing.variants import variant_dict
from k3jax.model import multimodal as MM
from k3jax.vision import inputs as MM_in
from k3jax.vision.preprocess import preprocess_images
from k3jax.checkpoint.vision_names import vision_params_to_hf

# fp32 as `k3jax logits` runs; the recurrent KDA oracle compiles its backward in half the
# time of the chunk path on CPU
RUNTIME = {"param_dtype": "float32", "dtype": "float32", "kda_impl": "recurrent"}
GRIDS = np.array([[1, 4, 4], [1, 2, 8]])
T = 24


def _random_tree(shapes, rng):
    """Fixture-like scales: norms near 1, fan-in matrices, spread KDA gates."""
    def leaf(path, s):
        name = path[-1].key
        if name in ("weight", "norm"):
            v = 1 + 0.1 * rng.normal(size=s.shape)
        elif name in ("embedding", "pos_emb"):
            v = rng.normal(size=s.shape)
        elif name == "proj" and len(s.shape) == 1:   # AttnRes queries: away from uniform mixing
            v = 0.25 * rng.normal(size=s.shape)
        elif name == "A_log":
            v = rng.uniform(-0.5, 1.0, s.shape)
        elif name == "dt_bias":
            v = rng.normal(-2, 1, s.shape)
        elif name == "e_score_correction_bias":
            v = 0.1 * rng.normal(size=s.shape)
        else:
            v = rng.normal(size=s.shape) / np.sqrt(s.shape[-2])
        return np.asarray(v, np.float32)
    return jax.tree_util.tree_map_with_path(leaf, shapes)


def _hf_tensors(cfg, params):
    """Text params under the released K3 names (fp32, experts unquantized)."""
    out = {}
    for e in tensor_map(cfg, "k3", "mlp"):
        leaf = params
        for k in e.path:
            leaf = leaf[k]
        slot = np.asarray(leaf)[e.index]
        if e.is_expert:
            out[f"{e.hf}.weight"] = np.ascontiguousarray(slot.T)
        else:
            out[e.hf] = from_tree_layout(e, slot, stored_shape(e, slot.shape, cfg, "k3"))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm")
    hf = variant_dict(layers=("kda", "mla"))
    hf.pop("train")
    k3 = K3Config.from_hf(hf)
    rng = np.random.default_rng(0)
    text = _random_tree(M.param_shapes(k3.text), rng)
    vision = _random_tree(vision_param_shapes(k3.vision), rng)
    src = d / "hf"
    src.mkdir()
    write_safetensors(src / "model.safetensors", {**_hf_tensors(k3.text, text),
                                                   **vision_params_to_hf(k3.vision, vision)})
    (src / "config.json").write_text(json.dumps(hf))
    k3, params = load_model_dir(src, RUNTIME, vision=True)
    pad = MM_in.media_pad_id(k3)
    # images as files (for the commands) and as the packed pixels they preprocess to
    from PIL import Image
    files = []
    for i, (h, w) in enumerate([(56, 56), (28, 112)]):
        files.append(d / f"img{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(files[-1])
    pixels, grids = preprocess_images(files)
    np.testing.assert_array_equal(grids, GRIDS)
    # one pad per image before expansion: row 0 holds image 0, row 1 image 1
    short = rng.integers(0, 256, (2, T - 3), dtype=np.int32)
    short[:, 0] = k3.text.bos_token_id
    short[0, 2], short[1, 9] = pad, pad
    tokens = MM_in.expand_tokens(short, [4, 4], pad)
    assert tokens.shape == (2, T)
    return {"dir": d, "src": src, "k3": k3, "params": params, "pad": pad, "files": files, "pixels": pixels,
            "short": short, "tokens": tokens}


def _forward(t, tokens):
    k3 = t["k3"]
    return np.asarray(MM.forward_with_images(k3.text, k3.vision, t["params"], tokens, t["pixels"], GRIDS,
                                             pad_id=t["pad"]))


class _SpliceAtEmbed:
    """Flax interceptor: the token embedding's output replaced by a given array."""
    def __init__(self, emb):
        self.emb = emb

    def __call__(self, next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Embed) and context.method_name == "__call__":
            return self.emb.astype(np.float32)
        return next_fun(*args, **kwargs)


@pytest.mark.slow
def test_logits_with_images_equal_features_spliced_by_hand(tiny):
    t = tiny
    k3, params, tokens = t["k3"], t["params"], t["tokens"]
    got = _forward(t, tokens)
    # reference: the tower on its own, its rows written over the pads by numpy indexing
    # (boolean indexing runs row-major, the documented order), the text model on that
    feats = np.asarray(vision_features(k3.vision, params["vision"], t["pixels"], GRIDS))
    assert feats.shape == (8, k3.text.hidden_size)
    emb = np.asarray(params["embed_tokens"]["embedding"])[tokens]
    emb[tokens == t["pad"]] = feats
    text, _ = MM.split_params(params)
    with nn.intercept_methods(_SpliceAtEmbed(emb)):
        ref = np.asarray(jax.jit(lambda p, x: M.K3Model(k3.text).apply({"params": p}, x))(text, tokens))
    for b in range(2):
        assert rel_l2(got[b], ref[b]) <= 1e-5, rel_l2(got[b], ref[b])
    # the features really differ from the pad embeddings they replace
    pad_row = np.asarray(params["embed_tokens"]["embedding"])[t["pad"]]
    assert np.abs(feats - pad_row).max(axis=1).min() > 1e-2


def test_bad_image_inputs_are_clear_errors(tiny):
    t = tiny
    k3, params, tokens = t["k3"], t["params"], t["tokens"]
    fewer = tokens.copy()
    fewer[0, np.flatnonzero(tokens[0] == t["pad"])[0]] = 7
    with pytest.raises(InputError, match=r"7 <\|media_pad\|>.* 8 feature"):
        MM.forward_with_images(k3.text, k3.vision, params, fewer, t["pixels"], GRIDS, pad_id=t["pad"])
    extra = t["short"].copy()
    extra[0, 5] = t["pad"]
    with pytest.raises(InputError, match=r"3 <\|media_pad\|>.* 2 image"):
        MM_in.expand_tokens(extra, [4, 4], t["pad"])
    with pytest.raises(InputError, match="no vision tower"):
        MM.forward_with_images(k3.text, None, params, tokens, t["pixels"], GRIDS, pad_id=t["pad"])
    text, _ = MM.split_params(params)
    with pytest.raises(InputError, match="no vision tower"):
        MM.forward_with_images(k3.text, k3.vision, text, tokens, t["pixels"], GRIDS, pad_id=t["pad"])
    with pytest.raises(InputError, match="need sum"):
        MM.forward_with_images(k3.text, k3.vision, params, tokens, t["pixels"][:-1], GRIDS, pad_id=t["pad"])
    _, text_only = load_model_dir(t["src"], RUNTIME)
    assert MM.VISION_KEY not in text_only


def test_logits_command_with_images_from_hf_and_converted_checkpoints(tiny, tmp_path):
    t = tiny
    want = _forward(t, t["tokens"])
    short, out = tmp_path / "short.npy", tmp_path / "logits.npy"
    np.save(short, t["short"])    # one pad per image: the command expands them
    assert cli.main(["logits", str(t["src"]), "--tokens", str(short), "--image", *map(str, t["files"]),
                     "--out", str(out), "--kda-impl", "recurrent"]) == 0
    np.testing.assert_array_equal(np.load(out), want)
    # the converted checkpoint carries the tower as a param tree; pre-patchified pixels and
    # already expanded pads give the same logits
    orbax = t["dir"] / "orbax"
    if not orbax.exists():
        convert(t["src"], orbax)
    pix, grids, full = tmp_path / "pix.npy", tmp_path / "grids.npy", tmp_path / "full.npy"
    np.save(pix, t["pixels"]), np.save(grids, GRIDS), np.save(full, t["tokens"])
    assert cli.main(["logits", str(orbax), "--tokens", str(full), "--pixels", str(pix), "--grids", str(grids),
                     "--out", str(out), "--kda-impl", "recurrent"]) == 0
    np.testing.assert_array_equal(np.load(out), want)


@pytest.mark.slow
def test_generate_command_with_images_on_a_mesh_matches_the_full_forward(tiny, tmp_path):
    t = tiny
    prompt = t["short"][:, :T - 3 - 2]     # both pads inside: expanded, 22 tokens per row
    ids, out = tmp_path / "prompt.npy", tmp_path / "gen.json"
    np.save(ids, prompt)
    # params sharded over 8 devices with 'ep' expert dispatch, the tower replicated; the
    # unsharded prefill with images is held to the forward in the chunked-prefill test
    assert cli.main(["generate", str(t["src"]), "--prompt-ids", str(ids), "--image", *map(str, t["files"]),
                     "--max-new-tokens", "3", "--no-eos-stop", "--out", str(out),
                     "--mesh", "data2_fsdp2_expert2"]) == 0
    gen = np.array(json.loads(out.read_text())["generated_ids"])
    assert gen.shape == (2, 3)
    # greedy, teacher-forced: each id is the argmax of the uncached forward at its position
    full = np.concatenate([MM_in.expand_tokens(prompt, [4, 4], t["pad"]), gen[:, :2]], axis=1)
    logits = _forward(t, full.astype(np.int32))
    np.testing.assert_array_equal(logits[:, T - 3:].argmax(-1), gen)


@pytest.mark.slow
def test_chunked_prefill_hands_each_piece_its_image_rows(tiny):
    from k3jax.infer.generate import prefill
    from k3jax.model.multimodal import feature_rows
    t = tiny
    k3, tokens = t["k3"], t["tokens"]
    text, _ = MM.split_params(t["params"])
    feats = MM.image_features(k3.text, k3.vision, t["params"], MM.prepare_images(k3.vision, t["pixels"], GRIDS))
    # pieces of 11: row 1's image rows (positions 9-12) straddle the first two pieces
    assert np.flatnonzero(tokens[1] == t["pad"]).tolist() == [9, 10, 11, 12]
    logits, cache = prefill(k3.text, text, tokens, max_len=T, chunk=11, image_features=feats,
                            feature_rows=feature_rows(tokens, t["pad"]))
    want = _forward(t, tokens)[:, -1]
    assert rel_l2(logits, want) <= 1e-5, rel_l2(logits, want)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [T, T])


def test_prompt_text_places_images_at_the_placeholder(tiny):
    from k3jax.commands.generate import _encode
    from k3jax.tokenizer import ByteTokenizer
    k3, pad = tiny["k3"], tiny["pad"]
    tok = ByteTokenizer.for_config(k3.text)
    mark = k3.top["image_placeholder"]
    assert _encode(tok, k3, f"a{mark}b{mark}", 2) == [tok.bos_id, ord("a"), pad, ord("b"), pad]
    assert _encode(tok, k3, "ab", 2) == [tok.bos_id, pad, pad, ord("a"), ord("b")]


@pytest.mark.slow
def test_train_step_with_images(tiny):
    t = tiny
    tokens = t["tokens"]
    # one dense KDA layer: the splice does not care about depth, and the backward of the
    # two-layer model costs twice the compile time
    hf = variant_dict(layers=("kda",))
    hf.pop("train")
    k3 = K3Config.from_hf(hf)
    cfg = k3.text.with_runtime(**RUNTIME)
    text = _random_tree(M.param_shapes(cfg), np.random.default_rng(1))
    params = {**text, "vision": jax.tree.map(np.array, t["params"]["vision"])}
    # plain SGD at lr 1 (old - new = gradient), the projector frozen, the tower trained
    groups = muon.param_groups(cfg, params, freeze=("vision/mm_projector/*",))
    labels = jax.tree.map(lambda g: "sgd" if g in muon.TRAINED else None, groups)   # the step's trained tree
    tx = optax.multi_transform({"sgd": optax.sgd(1.0)}, labels)
    tc = tconf.resolve({"data": {"seq_len": T, "batch_size": 2}})
    step = tstep.make_train_step(cfg, tc, tx, groups, vision=k3.vision, media_pad_id=t["pad"])
    targets = np.roll(tokens, -1, axis=1)
    mask = (tokens != t["pad"]).astype(np.float32)
    batch = {"tokens": tokens[None], "targets": targets[None], "loss_mask": mask[None],
             "segment_ids": np.ones_like(tokens)[None],
             "images": {"pixels": t["pixels"][None], "grid_thws": GRIDS}}
    fewer = {**batch, "tokens": np.where(tokens == t["pad"], 7, tokens)[None]}
    with pytest.raises(InputError, match=r"microbatch 0: 0 <\|media_pad\|>"):
        step(tstep.init_state(params, tx, groups), fewer)

    new, metrics = step(tstep.init_state(params, tx, groups), batch)
    # the loss is the cross-entropy of the multimodal forward's logits
    logits = np.asarray(MM.forward_with_images(cfg, k3.vision, params, tokens, t["pixels"], GRIDS,
                                               pad_id=t["pad"]), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    want = (ce * mask).sum() / mask.sum()
    assert np.isfinite(float(metrics["loss"])) and abs(float(metrics["loss"]) - want) <= 1e-5 * want
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads["vision"]["vision_tower"]):
        assert np.abs(g).max() > 0, jax.tree_util.keystr(path)
    for g in jax.tree.leaves(grads["vision"]["mm_projector"]):
        np.testing.assert_array_equal(g, 0)
    assert np.abs(grads["embed_tokens"]["embedding"]).max() > 0
