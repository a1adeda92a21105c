"""The serving engine on a multi-head latent attention model: its page pool holds one
latent row a token and layer, and greedy outputs equal `generate_ids` on each prompt alone
(whose contiguous latent cache decodes through the same `kernels.mla_decode`)."""
import dataclasses

import flax.nnx as nnx
import jax
import numpy as np
import pytest

import jaxllm
from jaxllm.inference.engine import Engine
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.requests import SamplingParams

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    cfg = jaxllm.load_config("configs/tiny_mla.yaml", overrides=[
        "model.n_layers=2", "model.d_model=64", "model.mlp_dim=128", "model.max_seq_len=128",
        "model.dtype=float32"])
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0))
    return model, cfg, decode_params(model, cfg)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, n).tolist() for n in (1, 5, 8, 9, 23, 41)]


@pytest.fixture(scope="module")
def alone(setup, prompts):
    _, _, params = setup
    return [generate_ids(params, [p], max_new_tokens=MAX_NEW, temperature=0, eos_id=None,
                         warmup=False)[0][0] for p in prompts]


def _engine(setup, **kw):
    model, cfg, params = setup
    return Engine(model, cfg, params=params, warm_up=False, **kw)


def _finished(engine, prompts):
    outs = {}
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    while len(outs) < len(prompts):
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[i] for i in ids]


def _all_free(engine):
    a = engine.scheduler.allocator
    assert a.num_free == a.num_pages and not a.sequences


@pytest.mark.parametrize("page,budget,window", [(8, 16, 1), (4, 32, 4)])
def test_greedy_equals_generate_alone(setup, prompts, alone, page, budget, window):
    """Ragged prompts, chunked prefill (a budget below the longest prompt), decode rows
    beside prefill chunks, and decode windows of several steps."""
    engine = _engine(setup, page_size=page, num_pages=64, max_num_seqs=3,
                     max_num_batched_tokens=budget, prefix_caching=False, decode_window=window)
    outs = _finished(engine, prompts)
    assert [o.token_ids for o in outs] == alone
    assert (engine.stats()["windows"] > 0) == (window > 1)
    _all_free(engine)


def test_latent_pool_holds_rank_plus_rope_values_per_token(setup):
    """bf16 latents in pages of 64: (kv_lora_rank + qk_rope_head_dim) x 2 bytes a token
    and layer, one array for the layer stack."""
    _, cfg, params = setup
    params = params.replace(cfg=dataclasses.replace(cfg.model, dtype="bfloat16"))
    engine = Engine(None, cfg, params=params, warm_up=False, page_size=64, num_pages=6,
                    max_num_seqs=2)
    (pool,) = engine.runner.pools
    mla, n_layers = cfg.model.mla, cfg.model.n_layers
    assert pool.shape == (n_layers, 6, 64, mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert pool.dtype == jax.numpy.bfloat16
    per_token_layer = engine.runner.pool_bytes / (6 * 64 * n_layers)
    assert per_token_layer == (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2


def test_prefix_cache_gives_the_same_tokens(setup, prompts, alone):
    long, shared = prompts[-1], prompts[-1][:17] + [7, 7, 7]
    kw = dict(page_size=8, num_pages=64, max_num_seqs=2, max_num_batched_tokens=32)
    on, off = _engine(setup, **kw), _engine(setup, prefix_caching=False, **kw)
    first, second = _finished(on, [long]), _finished(on, [long])
    assert first[0].cached_tokens == 0 and second[0].cached_tokens == 40
    assert first[0].token_ids == second[0].token_ids == alone[-1]
    (hit,) = _finished(on, [shared])
    (ref,) = _finished(off, [shared])
    assert hit.cached_tokens == 16 and ref.cached_tokens == 0
    assert hit.token_ids == ref.token_ids
    _all_free(on)
