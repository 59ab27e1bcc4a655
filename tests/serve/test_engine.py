"""The continuous-batching engine: batched greedy tokens equal `generate`'s, chunked
prefill, slot reuse, prefix reuse, cancellation, stops and seeds. One compiled engine
(4 slots, chunk 16) serves every test; the server's tests compile the same shapes."""
import numpy as np
import pytest

from k3jax.infer.engine import Engine, Request
from k3jax.infer.generate import generate
from k3jax.infer.generator import Generator
from k3jax.infer.sampling import SamplingParams

SLOTS, MAX_LEN, CHUNK = 4, 512, 16
# every test here shares the one compiled engine (~12 s to load and compile on 2 cores)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gen(tiny_model):
    return Generator.load(str(tiny_model))


@pytest.fixture(scope="module")
def engine(gen):
    e = gen.engine(SLOTS, MAX_LEN, CHUNK, tokenizer=gen.tokenizer)
    e.warmup()
    return e


def prompts(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def test_batched_requests_give_the_tokens_of_generate(gen, engine):
    # 5 requests for 4 slots: the fifth enters a slot freed mid-run while others decode;
    # prompts of 40 and 21 tokens are fed in 3 and 2 chunks of 16
    ps = prompts(40, 5, 21, 9, 3)
    lens = [6, 3, 8, 5, 7]
    steps = {}

    def seen(r, ids, text):
        steps.setdefault(r.id, []).append(engine.steps)
    reqs = engine.run([Request(p, n, on_event=seen) for p, n in zip(ps, lens)])
    # generate's padded batch computes each row as it would alone (tests/infer)
    want = generate(gen.cfg, gen.text_params, ps, max(lens))
    assert [r.out for r in reqs] == [w[:n] for w, n in zip(want, lens)]
    assert [r.finish_reason for r in reqs] == ["length"] * 5
    assert all(r is None for r in engine.active) and not engine.waiting
    # the short prompts decoded while the 40-token one was still being fed (3 steps)
    first_of_long = steps[reqs[0].id][0]
    assert steps[reqs[1].id][0] < first_of_long and len([s for s in steps[reqs[1].id] if s < first_of_long]) >= 2
    # the fifth request waited for a slot, then ran to its end
    assert min(steps[reqs[4].id]) > min(steps[reqs[1].id])


def test_prefix_reuse_feeds_only_the_new_tokens(gen, engine):
    p = prompts(20, seed=1)[0]
    first = engine.run([Request(p, 4)])[0]
    follow = p + first.out + [10, 32, 65]
    again = engine.run([Request(follow, 5)])[0]
    assert again.cached_prompt == len(p)
    fresh = Engine(gen.cfg, gen.text_params, slots=SLOTS, max_len=MAX_LEN, chunk=CHUNK, prefix_entries=0)
    alone = fresh.run([Request(follow, 5)])[0]
    assert alone.cached_prompt == 0 and again.out == alone.out


def test_cancel_frees_the_slot(engine):
    p = prompts(7, seed=2)[0]

    def cancel_at_3(r, ids, text):
        if len(r.out) >= 3 and not r.done:
            engine.cancel(r)
    r = Request(p, 50, on_event=cancel_at_3)
    engine.submit(r)
    while not r.done:
        engine.step()
    assert r.finish_reason == "cancelled" and 3 <= len(r.out) <= 4
    assert all(a is None for a in engine.active)
    queued = Request(p, 5)
    engine.submit(queued)
    engine.cancel(queued)            # cancelled while waiting: never takes a slot
    engine.step()
    assert queued.finish_reason == "cancelled" and queued.out == []
    # the freed slot serves the next request from a clean start
    assert engine.run([Request(p, 3)])[0].out == engine.run([Request(p, 3)])[0].out


def test_stop_ids_and_stop_strings(engine):
    p = prompts(11, seed=3)[0]
    free = engine.run([Request(p, 6)])[0].out
    r = engine.run([Request(p, 6, stop_ids=frozenset({free[2]}))])[0]
    assert r.finish_reason == "stop" and r.out == free[:free.index(free[2])]
    # strings: an injective detok makes the text of each token known; a two-token stop
    # string is held back while it could still complete, and cut from the text
    tag = "".join
    detok = lambda ids: tag(f"<{i}>" for i in ids)   # noqa: E731
    shown = []
    r = engine.run([Request(p, 6, stop=(f"<{free[3]}><{free[4]}>",), detok=detok,
                            on_event=lambda r, ids, text: shown.append(text))])[0]
    assert r.finish_reason == "stop" and r.text == detok(free[:3]) and "".join(shown) == r.text
    assert r.out == free[:5]
    r = engine.run([Request(p, 6, stop=("never",), detok=detok)])[0]
    assert r.finish_reason == "length" and r.text == detok(free)


def test_seeds_reproduce_whatever_shares_the_batch(engine):
    p, q = prompts(9, 30, seed=4)
    s = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = engine.run([Request(p, 8, s)])[0].out
    crowd = engine.run([Request(q, 8, SamplingParams(0.7, seed=1)), Request(p, 8, s), Request(q, 4)])[1].out
    other = engine.run([Request(p, 8, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8))])[0].out
    assert alone == crowd and alone != other


def test_requests_past_the_cache_are_refused(engine):
    from k3jax.errors import InputError
    with pytest.raises(InputError, match="max_len"):
        engine.submit(Request(list(range(MAX_LEN)), 1))
    with pytest.raises(InputError, match="max_tokens"):
        engine.submit(Request([1, 2], 0))
    r = engine.check(Request(list(range(MAX_LEN - 3)), 100))
    assert r.max_tokens == 4          # capped to the room left: the reply ends with 'length'


def test_lora_adapters_are_served_unmerged(gen, engine):
    # a LoRA run loads as the base params plus params['lora'] with cfg.runtime.lora set
    # (checkpoint.load); the engine runs them as they are, unmerged
    import jax

    from k3jax import lora
    from k3jax.model import abstract_params, adapter_shapes, LORA_KEY
    cfg = gen.cfg.with_runtime(lora=lora.resolve({"rank": 4}, gen.cfg, abstract_params(gen.cfg)))
    rng = np.random.default_rng(5)
    adapters = jax.tree.map(lambda s: (0.5 * rng.normal(size=s.shape)).astype(s.dtype),
                            adapter_shapes(cfg))
    params = {**gen.text_params, LORA_KEY: adapters}
    ps = prompts(19, 6, seed=6)
    # chunk 1: one step width, one compile of the adapted model
    got = [r.out for r in Engine(cfg, params, slots=SLOTS, max_len=MAX_LEN, chunk=1).run(
        [Request(p, 5) for p in ps])]
    # greedy, teacher-forced: each token is the argmax of the uncached forward (one compile,
    # where generate's prefill and decode would be two) at its position
    from k3jax.model import forward
    full = np.zeros((2, 23), np.int32)
    for b, (p, out) in enumerate(zip(ps, got)):
        full[b, :len(p) + 4] = p + out[:4]
    logits = np.asarray(forward(cfg, params, full))
    for b, p in enumerate(ps):
        assert logits[b, len(p) - 1:len(p) + 4].argmax(-1).tolist() == got[b]
    assert got != [r.out for r in engine.run([Request(p, 5) for p in ps])]    # the adapters count
