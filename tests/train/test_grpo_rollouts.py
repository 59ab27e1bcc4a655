"""GRPO rollouts through k3jax's engine on a tiny two-layer K3 (KDA + MLA): a completion that
meets the stop id ends there (stop kept, its slot freed for a waiting prompt), the others
run to max_tokens, each row's tokens are the greedy tokens of `generate` on its prompt
alone; the packed rows train on the completion's targets only; the batch source's
advantages are its rewards normalised per group and its old log-probs a plain forward's; with
grpo.mask_truncated the completions cut at max_tokens train on nothing."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as C, model as M
from k3jax.infer.generate import generate
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import config as tconf, dpo
from k3jax.train.rewards import Rewards
from k3jax.train.rollouts import RolloutBatches, build_prompts, pack_rows, rollout

from reference import grpo_advantages_ref

# one compiled engine (two widths) and one forward on the tiny model: ~10 s on 2 cores
pytestmark = pytest.mark.slow

TOK = ByteTokenizer()
WORDS = ["ab", "xy", "cd", "ef"]            # one rendered length: one prefill shape


@pytest.fixture(scope="module")
def tiny():
    from k3jax.testing.variants import variant_dict
    hf = variant_dict(layers=("kda", "mla"), attn_res_block_size=2)
    hf.pop("train")
    cfg = C.K3Config.from_hf(hf).text
    rng = np.random.default_rng(3)
    # peaked next-token distributions: greedy is far from ties
    params = jax.tree_util.tree_map_with_path(
        lambda p, s: np.ones(s.shape, np.float32) if p[-1].key in ("weight", "norm") else
        (rng.normal(size=s.shape) / np.sqrt(s.shape[-2] if len(s.shape) > 1 else 1)).astype(np.float32),
        M.param_shapes(cfg))
    return cfg, jax.tree.map(jax.numpy.asarray, params)


def _tc(tmp_path, **grpo_opts):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Copy: {w}"}], "answer": w}) + "\n"
                         for w in WORDS))
    tc = tconf.resolve({"objective": "grpo", "data": {"format": "chat", "seq_len": 112, "batch_size": 8,
                                                      "chat": {"thinking": False, "thinking_effort": None}},
                        "grpo": {"group_size": 4, "max_tokens": 8, "rollout_slots": 3, **grpo_opts}})
    return tc, build_prompts(tc, TOK, str(p))


def test_rollouts_stop_free_slots_and_match_generate(tiny, tmp_path):
    cfg, params = tiny
    tc, prompts = _tc(tmp_path)
    kw = dict(max_tokens=8, max_len=112, temperature=0.0, top_p=1.0, seeds=[0] * 4, slots=3)
    # no stop first: every row runs to max_tokens; its tokens are generate's for the prompt alone
    free = rollout(cfg, params, prompts, range(4), TOK, Rewards(["exact_match"]), stop=-1, **kw)
    alone = [r[1] for r in free]
    assert all(r[4] == "length" for r in free)
    np.testing.assert_array_equal(alone[0], generate(cfg, params, [prompts.ids[0]], 8)[0])
    # a stop id that row 1 meets at position >= 1 and some other row never makes
    stop = next(t for t in alone[1][1:] if any(t not in a for a in alone))
    res = rollout(cfg, params, prompts, range(4), TOK, Rewards(["exact_match"]), stop=stop, **kw)
    for i, (p, c, total, each, reason) in enumerate(res):
        assert p == prompts.ids[i]
        cut = alone[i].index(stop) + 1 if stop in alone[i] else None
        if cut is not None:          # ends at the stop, which the row keeps
            assert reason == "stop" and c == alone[i][:cut]
        else:                        # 4 requests on 3 slots: the fourth ran in a freed slot
            assert reason == "length" and c == alone[i]
    assert res[1][4] == "stop" and len(res[1][1]) >= 2
    assert any(r[4] == "length" for r in res)
    b = pack_rows(res, 113, 511)
    for j, (p, c, *_) in enumerate(res):
        m = np.flatnonzero(b["loss_mask"][j])
        assert m.tolist() == list(range(len(p) - 1, len(p) + len(c) - 1))    # targets = the completion
        np.testing.assert_array_equal(b["targets"][j, m], c)


def test_rollouts_on_a_mesh_keep_their_caches_split_and_their_tokens(tiny, tmp_path):
    """Under a training mesh (fsdp 2 x expert 2 x tensor 2) the engine lays its cache's rows over
    the batch axes and the KDA heads over the tensor axis (caches.cache_shardings), and the
    sampled completions are the ones the same seeds give on one device."""
    from k3jax.infer.caches import init_cache
    from k3jax.infer.engine import Engine
    from k3jax.infer.generator import MeshScope
    from k3jax.mesh import load_mesh
    from k3jax.model import param_shardings, shard_params
    cfg, params = tiny
    tc, prompts = _tc(tmp_path)
    mesh, rules = load_mesh("fsdp2_expert2_tensor2", jax.devices()[:8])
    scope = MeshScope.around(mesh, rules)
    kw = dict(max_tokens=8, max_len=112, temperature=1.0, top_p=0.9, seeds=[5, 6, 7, 8], slots=4)
    alone = rollout(cfg, params, prompts, range(4), TOK, Rewards(["exact_match"]), **kw)
    with scope():
        placed = shard_params(params, param_shardings(cfg, mesh, rules))
    on_mesh = rollout(cfg, placed, prompts, range(4), TOK, Rewards(["exact_match"]), scope=scope, **kw)
    assert [r[1] for r in on_mesh] == [r[1] for r in alone]
    cache = Engine(cfg, placed, slots=4, max_len=112, scope=scope).cache
    assert jax.tree.map(lambda x: x.shape, cache) == jax.tree.map(lambda x: x.shape, init_cache(cfg, 4, 112))
    # zero3's batch axes of size > 1 (fsdp, expert: 4 ways, the 4 rows); its heads axis: tensor
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache.layers):
        spec = tuple(leaf.sharding.spec) + (None,) * leaf.ndim
        assert spec[0] == ("fsdp", "expert"), (path, spec)
        if path[-1].key == "state":      # [B, H, K, V]
            assert spec[1:4] == ("tensor", None, None), (path, spec)
    # a prompt chunk's step hands the cache back laid out as it came (its buffers reused)
    from k3jax.infer import slots as S
    S4 = lambda dt: jnp.zeros((4,), dt)  # noqa: E731
    with scope():
        out = S.step(cfg, placed, cache, jnp.ones((4, 32), jnp.int32), jnp.full((4,), 32, jnp.int32),
                     S4(jnp.uint32), S4(jnp.int32), S4(jnp.float32) + 1, S4(jnp.int32), S4(jnp.float32) + 1)[2]
    fresh = Engine(cfg, placed, slots=4, max_len=112, scope=scope).cache
    same = jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim), out, fresh)
    assert all(jax.tree.leaves(same)), jax.tree.map(lambda x: x.sharding.spec, out)


def test_batch_source_advantages_and_old_logps(tiny, tmp_path, monkeypatch):
    cfg, params = tiny
    (tmp_path / "grpo_test_rewards.py").write_text(
        "def distinct(record, reply):\n    return len(set(reply['content']))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tc, prompts = _tc(tmp_path, temperature=1.0, rewards=["grpo_test_rewards:distinct"])
    src = RolloutBatches(tc, prompts, TOK, 511)
    src.bind(cfg)
    b = src.batch(0, params)
    assert b["tokens"].shape == (1, 8, 112) and b["advantages"].shape == (1, 8)
    rows = b["tokens"][0]
    picks = np.repeat(src.picks(0), 4)
    for j in range(8):                                  # rows are prompt-major, G = 4 per prompt
        n = len(prompts.ids[picks[j]])
        np.testing.assert_array_equal(rows[j, :n], prompts.ids[picks[j]])
    r = src.last_rewards.reshape(2, 4)
    assert np.ptp(r) > 0                                # the seeded samples differ
    np.testing.assert_allclose(b["advantages"][0], grpo_advantages_ref(r).reshape(-1), rtol=1e-5, atol=1e-6)
    mb = {k: jax.numpy.asarray(v[0]) for k, v in b.items()}
    # the jitted forward of the rollout against the plain one: float32 reassociation only
    np.testing.assert_allclose(b["old_logp"][0], np.asarray(dpo.policy_logps(cfg, params, mb)), rtol=1e-5, atol=3e-5)
    assert (b["old_logp"][0][b["loss_mask"][0] == 0] == 0).all() and (b["old_logp"][0][b["loss_mask"][0] > 0] < 0).all()
    w = src.window(1.0)
    assert w["reward_mean"] == pytest.approx(r.mean()) and w["response_length"] > 0
    assert src.batch(0, params) is b                    # one update per batch: step 0's batch again


def test_mask_truncated_drops_only_the_completions_cut_at_max_tokens(tiny, tmp_path, monkeypatch):
    """grpo.mask_truncated: a completion that ran to max_tokens trains on nothing; one that
    met the stop keeps its targets; the advantages still see every reward of the group."""
    cfg, params = tiny
    from k3jax.train import rollouts
    real, seen = rollouts.rollout, {}

    def with_stop(*a, **kw):   # a stop id some of the tiny model's temperature-1 rows meet
        free = real(*a, **{**kw, "stop": -1})
        rows = [c for _, c, *_ in free]
        some = {t for c in rows for t in c[1:]} - set.intersection(*(set(c) for c in rows))
        stop = max(sorted(some), key=lambda t: sum(t in c[1:] for c in rows))
        seen["res"] = res = real(*a, **{**kw, "stop": stop})
        return res
    monkeypatch.setattr(rollouts, "rollout", with_stop)
    tc, prompts = _tc(tmp_path, temperature=1.0)
    plain = RolloutBatches(tc, prompts, TOK, 511)
    plain.bind(cfg)
    want = plain.batch(0, params)
    tc["grpo"]["mask_truncated"] = True
    src = RolloutBatches(tc, prompts, TOK, 511)
    src.bind(cfg)
    got = src.batch(0, params)
    cut = np.array([r[4] == "length" for r in seen["res"]])
    assert cut.any() and (~cut).any(), [r[4] for r in seen["res"]]
    mask, full = got["loss_mask"][0], want["loss_mask"][0]
    assert not mask[cut].any() and full[cut].any()
    np.testing.assert_array_equal(mask[~cut], full[~cut])
    np.testing.assert_array_equal(got["advantages"], want["advantages"])
