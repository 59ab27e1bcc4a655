"""Inference: cached prefill/decode against the full forward, the reference's own cached
decode (fixture C), padded batches, prefix reuse, sampling and `k3jax generate`.

Compiles dominate the runtime on CPU, so tests share shapes (and with them compiled
functions): each config runs one forward, one padded prefill and one decode shape.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FIXTURES, need, rel_l2
from k3jax import config as C
from k3jax import model as M
from k3jax.layout import layer_plan
from k3jax.errors import InputError
from k3jax.checkpoint.hf_params import load_hf_params
from k3jax.infer import caches
from k3jax.infer import generate as G
from k3jax.infer.generator import Generator
from k3jax.infer.prefix import PrefixCache
from k3jax.infer.sampling import SamplingParams, sample

TOY = C.load("toy", kda_chunk_size=16)
VARIANTS = {
    # layer 0 dense + a scanned pair + an unrolled tail, so every code path has a cache
    "kda_only": TOY.replace(num_hidden_layers=4, kda_layers=(1, 2, 3, 4), full_attn_layers=(),
                            attn_res_block_size=2),
    "mla_only": TOY.replace(num_hidden_layers=3, kda_layers=(), full_attn_layers=(1, 2, 3),
                            attn_res_block_size=None),
    # dense KDA layer 0, a scanned [KDA-MoE, MLA-MoE] pair twice, an unrolled MLA-MoE tail:
    # every cache kind both unrolled and scanned, in half the toy's 13 layers
    "hybrid": TOY.replace(num_hidden_layers=6, kda_layers=(1, 2, 4), full_attn_layers=(3, 5, 6)),
}
# the cached latents read by the fused kernel (interpreted here; what TPU runs under 'auto')
VARIANTS["mla_only_fused"] = VARIANTS["mla_only"].with_runtime(decode_attention="pallas")
LENS = (20, 13)      # right-padded prompts of two lengths in one batch
STEPS = 6            # teacher-forced decode steps
MAX_LEN = 32


def numpy_params(cfg, seed=0):
    """Random params with the fixtures' scales (fan-in matrices, norms near 1, AttnRes
    queries far from uniform, KDA gates spread), drawn in numpy: `init_params` would
    compile an init per layer kind, the costliest part of these tests on shared CPUs."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        name, shape = path[-1].key, x.shape
        parent = path[-2].key if len(path) > 1 else ""
        if name in ("weight", "norm"):
            v = 1 + 0.1 * rng.normal(size=shape)
        elif name == "proj":
            v = 0.25 * rng.normal(size=shape)
        elif name == "A_log":
            v = rng.uniform(-0.5, 1.0, shape)
        elif name == "dt_bias":
            v = rng.normal(-2, 1, shape)
        elif name == "e_score_correction_bias":
            v = 0.1 * rng.normal(size=shape)
        elif name == "embedding":
            v = rng.normal(size=shape)
        elif name.endswith("_conv1d"):
            v = rng.normal(size=shape) / np.sqrt(shape[-2])
        else:  # kernels [.., in, out], expert stacks [.., E, in, out], router [.., D, E]
            v = rng.normal(size=shape) / np.sqrt(shape[-2])
            v *= {"gate_proj": 3.0, "up_proj": 8.0, "down_proj": 1 / 12}.get(parent, 1.0)
        return np.asarray(v, x.dtype)
    return jax.tree_util.tree_map_with_path(leaf, M.param_shapes(cfg))


@functools.lru_cache(maxsize=None)
def inputs(name):
    """(config, params, tokens) of a variant: two rows of LENS[0] + STEPS tokens."""
    cfg = VARIANTS[name]
    tokens = np.random.default_rng(3).integers(0, 256, (2, LENS[0] + STEPS), dtype=np.int32)
    return cfg, numpy_params(cfg, 1), tokens


@functools.lru_cache(maxsize=None)
def setup(name):
    """`inputs` and the full forward's logits. Row 1 is its 13-token prompt + 6 fed tokens;
    what follows position 19 is never seen by those positions (causal), so one [2, 26]
    forward is the reference for both rows."""
    cfg, params, tokens = inputs(name)
    return cfg, params, tokens, np.asarray(M.forward(cfg, params, tokens))


def close(a, b, tol=1e-4):
    a, b = np.asarray(a), np.asarray(b)
    assert rel_l2(a, b) <= tol and np.abs(a - b).max() <= tol * np.abs(b).max(), (rel_l2(a, b), np.abs(a - b).max())


@functools.lru_cache(maxsize=None)
def batched_run(name):
    """Prefill the padded batch and decode STEPS teacher-forced tokens per row."""
    cfg, params, tokens = inputs(name)
    n = np.array(LENS, np.int32)
    prompt = np.where(np.arange(LENS[0])[None] < n[:, None], tokens[:, :LENS[0]], cfg.pad_token_id)
    logits, cache = G.prefill(cfg, params, prompt, n, max_len=MAX_LEN)
    out = [np.asarray(logits)]
    for j in range(STEPS):
        logits, cache = G.decode(cfg, params, cache, tokens[np.arange(2), n + j])
        out.append(np.asarray(logits))
    return np.stack(out, 1), np.asarray(cache.lengths)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_then_decode_equals_full_forward(name):
    _, _, _, full = setup(name)
    got, lengths = batched_run(name)
    np.testing.assert_array_equal(lengths, np.array(LENS) + STEPS)
    for b, n in enumerate(LENS):  # each row at its own positions: padding changed nothing
        close(got[b], full[b, n - 1:n + STEPS])


@pytest.mark.slow
def test_padded_row_equals_the_sequence_decoded_alone():
    cfg, params, tokens = inputs("hybrid")
    got, _ = batched_run("hybrid")
    n = LENS[1]
    logits, cache = G.prefill(cfg, params, tokens[1:, :n], max_len=MAX_LEN)
    alone = [np.asarray(logits)]
    for j in range(STEPS):
        logits, cache = G.decode(cfg, params, cache, tokens[1:, n + j])
        alone.append(np.asarray(logits))
    # 1e-4, not bitwise: the padded row splits its tokens into KDA chunks differently
    close(got[1], np.concatenate(alone))


@pytest.mark.slow
def test_prefix_reuse_equals_fresh_prefill():
    cfg, params, tokens = inputs("hybrid")
    got, _ = batched_run("hybrid")   # row 0: a fresh prefill of 20 tokens, then decode
    ids = tokens[0, :LENS[0]].tolist()
    pc = PrefixCache()
    pc.prefill(cfg, params, ids[:LENS[1]], max_len=MAX_LEN)         # saves the shared prefix
    assert pc.lookup(ids)[0] == LENS[1]
    logits, cache = pc.prefill(cfg, params, ids, max_len=MAX_LEN)   # restores it, prefills 7 tokens
    # 1e-4 (the chunk-vs-recurrent ceiling), not bitwise: the suffix is chunked from the
    # restored state, the fresh batched prefill chunks the whole padded row
    close(logits[0], got[0, 0])
    # the restored cache continues like the fresh one (KDA state and MLA KV agree)
    step, _ = G.decode(cfg, params, cache, tokens[0, LENS[0]:LENS[0] + 1])
    close(step[0], got[0, 1])
    # an exact match needs no model call; the snapshot survived the donated decode
    again, _ = pc.prefill(cfg, params, ids, max_len=MAX_LEN)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(logits))


def test_cache_layout_matches_params_and_spec():
    cfg = VARIANTS["hybrid"]
    cache = caches.init_cache(cfg, 2, MAX_LEN)
    params = numpy_params(cfg)
    assert set(cache.layers) == {k for k in params if k.startswith(("layers_", "groups"))}
    plan = layer_plan(cfg)
    for j, (kind, _) in enumerate(plan.group):
        leaf = cache.layers["groups"][f"sub_{j}"]
        if kind == "mla":
            assert leaf["kv"].shape == (plan.n_groups, 2, cfg.kv_lora_rank + cfg.qk_rope_head_dim, MAX_LEN)
        else:
            assert leaf["state"].shape == (plan.n_groups, 2, 4, 16, 16) and leaf["state"].dtype == jnp.float32
    grow = caches.cache_bytes(caches.init_cache(cfg, 1, 2 * MAX_LEN)) - caches.cache_bytes(caches.init_cache(cfg, 1, MAX_LEN))
    assert grow == MAX_LEN * caches.spec_bytes_per_token(cfg)
    k3 = C.load("k3").with_runtime(dtype="bfloat16")
    assert caches.spec_bytes_per_token(k3) == 24 * 576 * 2


@pytest.mark.parametrize("S", [6, 200])     # 200: the one-token form's 128-wide windows, the last one shifted
@pytest.mark.parametrize("T", [1, 3])
def test_cache_writes_land_at_each_rows_length(T, S):
    """apply_updates against a NumPy write, on an unrolled [B, E, S] and a stacked
    [G, B, E, S] latent buffer: row b's t-th new latent lands at lengths[b] + t for
    t < n_new[b]; a full row and a row with no new token keep what they hold (the one-token
    form writes per row in place, the longer one scatters)."""
    B, E, G = 4, 5, 2
    rng = np.random.default_rng(T)
    lengths = np.array([0, 2 if S < 128 else 150, S, S - 1], np.int32)   # empty, partial, full, one slot left
    n_new = np.array([T, T, T, 0 if T == 1 else 1], np.int32)
    old = {"layers_1": {"kv": rng.standard_normal((B, E, S)).astype(np.float32)},
           "groups": {"sub_0": {"kv": rng.standard_normal((G, B, E, S)).astype(np.float32)}}}
    new = {"layers_1": {"kv": rng.standard_normal((B, T, E)).astype(np.float32)},
           "groups": {"sub_0": {"kv": rng.standard_normal((G, B, T, E)).astype(np.float32)}}}
    cache = caches.Cache(jax.tree.map(jnp.asarray, old), jnp.asarray(lengths))
    got = jax.jit(caches.apply_updates)(cache, jax.tree.map(jnp.asarray, new), jnp.asarray(n_new))
    for key, leaf in (("layers_1", lambda d: d["layers_1"]["kv"]), ("groups", lambda d: d["groups"]["sub_0"]["kv"])):
        want = leaf(old).copy()
        src = leaf(new)
        for b in range(B):
            for t in range(n_new[b]):
                if lengths[b] + t < S:
                    want[..., b, :, lengths[b] + t] = src[..., b, t, :]
        np.testing.assert_array_equal(np.asarray(leaf(got.layers)), want, err_msg=key)
    np.testing.assert_array_equal(np.asarray(got.lengths), lengths + n_new)


# ---------------------------------------------------------------------------------------
# Fixture C: the reference's own cached greedy decode (KimiDynamicCache)
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def fixture_c():
    d = need(FIXTURES / "fixture_c")
    cfg = C.K3Config.from_hf(d / "config.json").text
    return d, cfg, load_hf_params(cfg, d, dtype=np.float32)


@pytest.mark.slow
def test_greedy_decode_reproduces_fixture_c():
    d, cfg, params = fixture_c()
    prompt, fed = np.load(d / "prompt_ids.npy"), np.load(d / "generated_ids.npy")
    ref_prefill, ref_steps = np.load(d / "prefill_last_logits.npy"), np.load(d / "step_logits.npy")
    for b in range(2):   # one row at a time: the CLI tests below reuse these compiled shapes
        # max_len 64: what `generate` allocates for 8 new tokens after 40
        logits, cache = G.prefill(cfg, params, prompt[b:b + 1], max_len=64)
        close(logits[0], ref_prefill[b])
        assert int(np.argmax(logits[0])) == fed[b, 0]
        steps = []
        for j in range(fed.shape[1]):   # teacher-forced: some greedy margins are ~1e-2
            step_logits, cache = G.decode(cfg, params, cache, fed[b:b + 1, j])
            steps.append(np.asarray(step_logits[0]))
        close(np.stack(steps), ref_steps[b])
        np.testing.assert_array_equal(np.argmax(steps, -1), ref_steps[b].argmax(-1))


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------
PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def draws(n=4000, seed=0, **kw):
    logits = jnp.asarray(np.tile(np.log(PROBS), (n, 1)), jnp.float32)
    ids = np.asarray(sample(logits, jax.random.PRNGKey(seed), **kw))
    return np.bincount(ids, minlength=4) / n


def test_greedy_is_argmax_and_sampling_is_seeded():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.PRNGKey(0))), np.argmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.PRNGKey(5), temperature=1.0, top_k=1)),
                                  np.argmax(logits, -1))
    np.testing.assert_array_equal(draws(seed=7, temperature=1.0), draws(seed=7, temperature=1.0))
    assert not np.array_equal(draws(seed=7, temperature=1.0), draws(seed=8, temperature=1.0))


def test_temperature_top_k_top_p_distributions():
    np.testing.assert_allclose(draws(temperature=1.0), PROBS, atol=0.03)
    hot = PROBS ** 0.5 / np.sum(PROBS ** 0.5)     # temperature 2 flattens: p^(1/2), renormalised
    np.testing.assert_allclose(draws(temperature=2.0), hot, atol=0.03)
    np.testing.assert_allclose(draws(temperature=1.0, top_k=2), [0.625, 0.375, 0, 0], atol=0.03)
    # top_p 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it; the rest is cut
    got = draws(temperature=1.0, top_p=0.7)
    np.testing.assert_allclose(got, [0.625, 0.375, 0, 0], atol=0.03)
    assert got[2:].sum() == 0
    np.testing.assert_allclose(draws(temperature=1.0, top_p=0.1), [1, 0, 0, 0])   # the top token always stays
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


# ---------------------------------------------------------------------------------------
# The generation loop and `k3jax generate`
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_generate_ids_reproduce_fixture_c(tmp_path):
    from k3jax.cli import main
    d, _, _ = fixture_c()
    ids = tmp_path / "row1.npy"
    np.save(ids, np.load(d / "prompt_ids.npy")[1])     # [T]: one prompt, the compiled batch of one
    out = tmp_path / "gen.json"
    rc = main(["generate", str(d), "--prompt-ids", str(ids), "--max-new-tokens", "8", "--no-eos-stop",
               "--out", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    np.testing.assert_array_equal(np.array(got["generated_ids"]), np.load(d / "generated_ids.npy")[1:])


def test_cli_generate_streams_text(capsys):
    from k3jax.cli import main
    d, cfg, params = fixture_c()
    text = "The quick brown fox jumps over the dog."   # bos + 39 bytes: fixture C's compiled shapes
    assert main(["generate", str(d), "--prompt", text, "--max-new-tokens", "5", "--temperature", "0.8",
                 "--top-p", "0.9", "--seed", "3", "--no-eos-stop"]) == 0
    out = capsys.readouterr().out
    # the Python API with the same settings samples the same ids (same seed, same steps)
    ids = Generator(cfg, params).generate([[cfg.bos_token_id, *text.encode()]], 5, SamplingParams(0.8, 0, 0.9, 3))
    assert len(ids[0]) == 5
    streamed = bytes(i for i in ids[0] if i < 256).decode("utf-8", errors="replace").rstrip("\ufffd")
    assert out.startswith(text + streamed)


def test_cli_generate_text_needs_a_tokenizer_for_the_real_vocabulary(monkeypatch, capsys):
    from k3jax.cli import main
    from k3jax.commands import generate as cmd
    monkeypatch.setattr(cmd, "load", lambda *a, **k: (C.load_k3("k3"), None))
    assert main(["generate", "any_dir", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer" in err and "--prompt-ids" in err


def test_inputs_past_the_cache_are_clear_errors():
    cfg, params, tokens = inputs("hybrid")
    with pytest.raises(InputError, match="max_len"):
        G.prefill(cfg, params, tokens[:, :20], max_len=16)
    with pytest.raises(InputError, match="vocabulary"):
        G.prefill(cfg, params, np.full((1, 4), cfg.vocab_size), max_len=16)


@pytest.mark.slow
def test_chunked_prefill_equals_one_piece():
    # pieces of 8 over rows of 20 and 13 tokens: the short row has no token in the last
    # piece, so its state, tails and logits must pass through that piece untouched
    cfg, params, tokens, _ = setup("kda_only")
    got, _ = batched_run("kda_only")
    n = np.array(LENS, np.int32)
    prompt = np.where(np.arange(LENS[0])[None] < n[:, None], tokens[:, :LENS[0]], 0)
    logits, cache = G.prefill(cfg, params, prompt, n, max_len=MAX_LEN, chunk=8)
    close(logits, got[:, 0])
    step, _ = G.decode(cfg, params, cache, tokens[np.arange(2), n])
    close(step, got[:, 1])
