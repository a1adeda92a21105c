"""The serving engine: continuous batching gives each request what it gets alone.

Greedy outputs are compared with `generate_ids` on each prompt alone, over random arrival
schedules, token budgets, page sizes and pools small enough to force preemption; after
every run all pages are free and no refcount is left.
"""
import asyncio

import flax.nnx as nnx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxllm
from jaxllm.inference.engine import AsyncEngine, Engine
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.prefix_cache import PrefixCachingAllocator
from jaxllm.inference.requests import QueueFullError, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    cfg = jaxllm.load_config("configs/tiny.yaml", overrides=[
        "model.n_layers=2", "model.d_model=64", "model.mlp_dim=128", "model.max_seq_len=128",
        "model.dtype=float32"])
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0))
    return model, cfg, decode_params(model, cfg)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    lengths = [1, 3, 4, 5, 8, 15, 16, 17, 33, 47]  # around page sizes 4, 8 and 16
    return [rng.integers(0, 256, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def alone(setup, prompts):
    """Each prompt's greedy continuation, generated on its own."""
    _, _, params = setup
    return [generate_ids(params, [p], max_new_tokens=MAX_NEW, temperature=0, eos_id=None,
                         warmup=False)[0][0] for p in prompts]


def _engine(setup, **kw):
    model, cfg, params = setup
    return Engine(model, cfg, params=params, warm_up=False, **kw)


def _run_schedule(engine, prompts, params, rng, max_steps=2000):
    """Add the prompts in a random order at random steps; step until all finish."""
    order = rng.permutation(len(prompts)).tolist()
    ids, done = {}, {}
    for _ in range(max_steps):
        for _ in range(rng.integers(0, 3)):
            if order:
                i = order.pop()
                ids[engine.add_request(prompts[i], params)] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
        if not order and len(done) == len(prompts):
            return [done[i] for i in range(len(prompts))]
    raise AssertionError(f"not finished after {max_steps} steps: {engine.stats()}")


def _all_free(engine):
    a = engine.scheduler.allocator
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0
    assert a.num_free == a.num_pages and not a.sequences
    assert int(np.abs(a._refs).sum()) == 0


# (page size, pages in the pool, sequences a step, token budget, prefix caching, decode window)
LAYOUTS = [(4, 24, 4, 16, True, 4),  # a small pool: preemptions
           (8, 64, 8, 32, False, 1),
           (16, 12, 3, 20, True, 8)]


def test_an_idle_engine_reads_its_first_tokens_before_the_next_dispatch(setup, prompts, alone):
    """From idle, the step that samples a request's first token is read before another is
    dispatched (TTFT waits for one dispatch); while requests decode, the next step is
    dispatched before the last one's tokens are read."""
    engine = _engine(setup, page_size=8, num_pages=64, max_num_seqs=4,
                     max_num_batched_tokens=16, decode_window=1)
    for i in (-2, -1):  # 33 and 47 tokens: three prefill chunks each; the second from idle again
        rid, base = engine.add_request(prompts[i], GREEDY), engine.totals["steps"]
        steps, tokens = [], []  # steps dispatched when each token came out
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    steps += [engine.totals["steps"] - base] * len(o.new_token_ids)
                    tokens += o.new_token_ids
        assert steps[:3] == [3, 5, 6]  # the first token with nothing dispatched after it
        assert tokens == alone[i]
        _all_free(engine)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"page{x[0]}-pool{x[1]}-w{x[5]}")
def test_greedy_equals_generate_alone(setup, prompts, alone, layout):
    page, pages, seqs, budget, prefix, window = layout
    engine = _engine(setup, page_size=page, num_pages=pages, max_num_seqs=seqs,
                     max_num_batched_tokens=budget, prefix_caching=prefix,
                     decode_window=window)

    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2 ** 31 - 1))
    def schedules(seed):
        outs = _run_schedule(engine, prompts, GREEDY, np.random.default_rng(seed))
        assert [o.token_ids for o in outs] == alone
        assert all(o.finish_reason == "length" for o in outs)
        _all_free(engine)

    schedules()
    if pages == 24:
        assert engine.stats()["preemptions"] > 0
    assert (engine.stats()["windows"] > 0) == (window > 1)


def test_prefix_cache_hits_give_the_same_output(setup, alone, prompts):
    engine = _engine(setup, page_size=8, num_pages=64, max_num_seqs=4,
                     max_num_batched_tokens=32)
    long = prompts[-1]  # 47 tokens: 5 full pages before the last token's page
    first = [o for o in engine.generate([long], GREEDY) if o.finished][0]
    second = [o for o in engine.generate([long], GREEDY) if o.finished][0]
    assert first.cached_tokens == 0 and second.cached_tokens == 40
    assert first.token_ids == second.token_ids == alone[-1]
    # a prompt that shares the first 17 tokens: 2 full pages come from the cache
    other = long[:17] + [7, 7, 7]
    (out,) = [o for o in engine.generate([other], GREEDY) if o.finished]
    assert out.cached_tokens == 16
    fresh = _engine(setup, page_size=8, num_pages=64, max_num_seqs=4,
                    max_num_batched_tokens=32, prefix_caching=False)
    (ref,) = [o for o in fresh.generate([other], GREEDY) if o.finished]
    assert out.token_ids == ref.token_ids
    _all_free(engine)
    assert engine.stats()["prefix_hits"] == 56


def test_prefix_allocator_evicts_least_recently_used():
    a = PrefixCachingAllocator(num_pages=4, page_size=2, max_pages_per_seq=4)
    seqs = []
    for first in (10, 20):  # two sequences of two full pages each, then freed
        s, cached = a.allocate_prefix([first, 1, 2, 3])
        assert cached == 0
        a.append([s], [4])
        a.register(s, [first, 1, 2, 3])
        seqs.append(s)
    for s in seqs:
        a.free(s)
    assert a.num_free == 4 and a.num_cached == 4  # parked, not forgotten
    assert a.allocate_prefix([10, 1, 2, 3, 9])[1] == 4  # 10's pages back in use
    s = a.allocate()
    a.append([s], [3])  # takes two pages: 20's, the least recently used, are evicted
    assert a.num_cached == 2 and a.match([20, 1, 2, 3, 9]) == []
    assert len(a.match([10, 1, 2, 3, 9])) == 2


def test_sampling_is_per_request_and_reproducible(setup, prompts):
    engine = _engine(setup, page_size=8, num_pages=64, max_num_seqs=4,
                     max_num_batched_tokens=32)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=123, max_tokens=MAX_NEW,
                            ignore_eos=True)
    one = [o for o in engine.generate([prompts[5]], seeded) if o.finished][0].token_ids
    mixed = [prompts[2], prompts[5], prompts[7]]
    params = [GREEDY, seeded, SamplingParams(temperature=2.0, max_tokens=MAX_NEW,
                                             ignore_eos=True)]
    outs = {o.request_id: o for o in engine.generate(mixed, params) if o.finished}
    got = [o.token_ids for o in outs.values()]
    assert one in got  # the same draws when batched with other requests
    # top_k = 1 samples the argmax: the greedy tokens
    top1 = SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX_NEW, ignore_eos=True)
    greedy = [o for o in engine.generate([prompts[3]], GREEDY) if o.finished][0].token_ids
    assert [o for o in engine.generate([prompts[3]], top1) if o.finished][0].token_ids == greedy


def test_stops_abort_and_queue_limit(setup, prompts, alone):
    engine = _engine(setup, page_size=8, num_pages=64, max_num_seqs=4,
                     max_num_batched_tokens=32, max_waiting=2)
    ref = alone[4]
    # a stop token id ends the request before it (not part of the output)
    p = GREEDY.replace(stop_token_ids=(ref[3],))
    (out,) = [o for o in engine.generate([prompts[4]], p) if o.finished]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(ref[3])]
    # min_tokens holds a stop id back: the first MAX_NEW - 2 tokens may not be ref[0]
    p = GREEDY.replace(stop_token_ids=(ref[0],), min_tokens=2)
    (out,) = [o for o in engine.generate([prompts[4]], p) if o.finished]
    assert out.token_ids[0] != ref[0] and len(out.token_ids) >= 2
    # a stop string cuts the text before it; streamed deltas join to the final text
    text = engine.tokenizer.decode(ref)
    stop = text[2:4]
    outs = list(engine.generate([prompts[4]], GREEDY.replace(stop=(stop,))))
    assert outs[-1].finish_reason == "stop" and outs[-1].text == text[:text.index(stop)]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    # to its length: the text is every token's (an incomplete last character included)
    outs = list(engine.generate([prompts[4]], GREEDY))
    assert outs[-1].text == "".join(o.new_text for o in outs) == engine.tokenizer.decode(ref)
    # each step's cumulative fields, read after the run, are what the deltas had made then
    for i, o in enumerate(outs):
        assert o.token_ids == sum((x.new_token_ids for x in outs[:i + 1]), [])
        assert o.text == "".join(x.new_text for x in outs[:i + 1])
    # abort frees the pages at once
    rid = engine.add_request(prompts[-1], GREEDY)
    engine.step()
    assert engine.stats()["pages_used"] > 0
    assert engine.abort(rid).finish_reason == "abort"
    _all_free(engine)
    # bad requests and a full queue are refused before anything changes
    with pytest.raises(ValueError, match="exceed the model's context"):
        engine.add_request(prompts[0], GREEDY.replace(max_tokens=200))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([300], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    engine.add_request(prompts[0], GREEDY)
    engine.add_request(prompts[1], GREEDY)
    with pytest.raises(QueueFullError):
        engine.add_request(prompts[2], GREEDY)


def test_no_compiles_after_warm_up_and_async_streams(setup, prompts, alone):
    model, cfg, params = setup
    engine = Engine(model, cfg, params=params, page_size=8, num_pages=64, max_num_seqs=4,
                    max_num_batched_tokens=32)
    assert engine.runner.buckets == (16, 32)

    async def main():
        aeng = AsyncEngine(engine).start()
        try:
            async def one(i):
                return [o async for o in aeng.add_request(prompts[i], GREEDY)]
            results = await asyncio.wait_for(
                asyncio.gather(*(one(i) for i in range(len(prompts)))), timeout=120)
            # a stream left after its first output aborts its request
            stream = aeng.add_request(prompts[-1], GREEDY.replace(max_tokens=20))
            async for _ in stream:
                break
            for _ in range(200):  # bounded wait for the engine thread to apply the abort
                if engine.stats()["running"] == 0:
                    break
                await asyncio.sleep(0.02)
            return results
        finally:
            aeng.stop()

    results = asyncio.run(main())
    assert [sum((o.new_token_ids for o in r), []) for r in results] == alone
    assert all(r[-1].finished for r in results)
    _all_free(engine)
    assert engine.stats()["compiles_since_start"] == 0


def test_steps_do_not_branch_on_the_device(setup):
    """Neither form of the step or the window holds a device-side conditional: the GPU
    runtime resolves one by reading its predicate back, which would hold the host's next
    dispatch until the step's logits exist."""
    import jax
    import jax.numpy as jnp
    engine = _engine(setup, page_size=8, num_pages=64, max_num_seqs=4,
                     max_num_batched_tokens=32, decode_window=4)
    run = engine.runner
    for sampled in (False, True):
        batch = run.empty_batch(16)
        buf = jax.ShapeDtypeStruct(batch.pack().shape, jnp.int32)
        args = (run.weights, run.pools, run.last, buf, batch.layout(), sampled)
        for text in (run._jit.lower(*args).as_text(),
                     run._jit_window.lower(*args, run.window_steps).as_text()):
            assert "stablehlo.case" not in text and "stablehlo.if" not in text
