"""The host loop of `generate_ids`: the tokens do not depend on the chunk size or on
whether the next chunk is queued before the current one is read, and generation stops
at EOS (the first EOS cuts a row; once every row has one, no further chunk is read)."""
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.model import build_model

SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.mlp_dim=64",
         "model.vocab_size=64", "model.n_layers=2", "model.init_std=0.3"]
MAX_NEW = 23  # not a multiple of any chunk below: the last chunk is cut


@pytest.fixture(scope="module")
def params():
    cfg = load_config(None, SMALL)
    return decode_params(build_model(cfg.model, rngs=nnx.Rngs(7)), cfg)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 64, size=n).tolist() for n in (6, 1, 11)]


def _run(params, prompts, **kw):
    return generate_ids(params, prompts, max_new_tokens=MAX_NEW, temperature=0.0,
                        warmup=False, **kw)


@pytest.fixture(scope="module")
def ref(params, prompts):
    return _run(params, prompts, chunk=8, overlap=False)[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_tokens_independent_of_chunking_and_overlap(params, prompts, ref, overlap):
    assert [len(r) for r in ref] == [MAX_NEW] * 3
    streamed = []
    ids, t = _run(params, prompts, chunk=5, overlap=overlap, on_tokens=streamed.append)
    assert ids == ref
    assert t["decode_steps"] == MAX_NEW
    assert np.concatenate(streamed, axis=1).tolist() == ref


@pytest.mark.parametrize("overlap", [True, False])
def test_stops_at_eos(params, prompts, ref, overlap):
    # an EOS id that row 0 produces for the first time in its third or fourth chunk (of
    # five), so that a batch of row 0's prompt alone stops before the limit
    row = ref[0]
    j = next(i for i in range(10, 20) if row[i] not in row[:i])
    eos = row[j]
    # each row is cut at its own first EOS; the loop runs on while any row has none
    ids, t = _run(params, prompts, chunk=5, overlap=overlap, eos_id=eos)
    for got, want in zip(ids, ref):
        assert got == want[:want.index(eos) if eos in want else len(want)]
    # once every row has stopped, no further chunk is read (three copies of one prompt)
    ids, t = _run(params, prompts[:1] * 3, chunk=5, overlap=overlap, eos_id=eos)
    assert ids == [row[:j]] * 3
    assert t["decode_steps"] == 5 * (j // 5 + 1)
