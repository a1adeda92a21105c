"""Speculative decoding: the acceptance rule keeps the target distribution (goodness of
fit), and greedy speculative decoding reproduces greedy plain decoding token for token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import ConfigError, load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.speculative import speculative_generate_ids, verify
from jaxllm.model import build_model

# Chi-square critical values at significance 0.001, by degrees of freedom.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                 7: 24.322, 8: 26.124, 9: 27.877}


def _chi_square(samples, p):
    """Pearson's statistic of integer `samples` against p; tokens with p = 0 must not occur."""
    counts = np.bincount(samples, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"tokens with zero target probability drawn: {counts}"
    expected = len(samples) * p[p > 0]
    return float(np.sum((counts[p > 0] - expected) ** 2 / expected)), int((p > 0).sum() - 1)


def _random_pq(rng, k, v):
    """Random p (k+1, V) and q (k, V), each with zeros where the other is positive."""
    p = rng.dirichlet(np.ones(v), size=k + 1)
    q = rng.dirichlet(np.ones(v), size=k)
    p[:k, 0] = 0.0  # q puts mass on token 0, the target none
    q[:, 1] = 0.0   # the target puts mass on token 1, the draft none
    p[k, 2] = 0.0   # the bonus distribution has a zero too
    return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_verify_keeps_target_distribution(seed):
    """Emitted token i ~ p_i (given that drafts before it were accepted): chi-square
    goodness of fit at significance 0.001 for the first token, the second and the bonus."""
    k, v, n = 2, 7, 40_000
    rng = np.random.default_rng(seed)
    p, q = _random_pq(rng, k, v)
    key_d, key_v = jax.random.split(jax.random.key(seed))
    drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q)), shape=(n, k)).astype(jnp.int32)
    target = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, k + 1, v))
    draft_p = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, k, v))
    tokens, n_emitted = jax.jit(verify)(drafts, draft_p, target, key_v)
    tokens, n_emitted = np.asarray(tokens), np.asarray(n_emitted)

    assert tokens.shape == (n, k + 1) and n_emitted.min() >= 1 and n_emitted.max() <= k + 1
    j = np.arange(k + 1)[None]
    assert np.all((tokens >= 0) == (j < n_emitted[:, None]))  # emitted, then -1
    accepted_drafts = np.where(j[:, :k] < (n_emitted - 1)[:, None], np.asarray(drafts), -1)
    assert np.array_equal(accepted_drafts, np.where(j[:, :k] < (n_emitted - 1)[:, None],
                                                    tokens[:, :k], -1))
    checks = [(tokens[:, 0], p[0]),  # every row emits a first token
              (tokens[n_emitted >= 2, 1], p[1]),  # first draft accepted -> second ~ p_2
              (tokens[n_emitted == k + 1, k], p[k])]  # all accepted -> bonus ~ p_{k+1}
    for samples, target_p in checks:
        assert len(samples) > 2000
        stat, dof = _chi_square(samples, target_p)
        assert stat < CHI2_CRIT_001[dof], (stat, dof)
    # the acceptance rate of draft 1 is sum_x min(p, q)
    rate = np.mean(n_emitted >= 2)
    assert abs(rate - np.minimum(p[0], q[0]).sum()) < 0.015


def test_verify_greedy_and_identical_distributions():
    rng = np.random.default_rng(3)
    b, k, v = 64, 3, 11
    target_arg = rng.integers(0, v, (b, k + 1))
    drafts = np.where(rng.random((b, k)) < 0.7, target_arg[:, :k], (target_arg[:, :k] + 1) % v)
    one_hot = lambda x: jax.nn.one_hot(x, v, dtype=jnp.float32)
    verify_jit = jax.jit(verify)
    tokens, n = verify_jit(jnp.asarray(drafts, jnp.int32), one_hot(drafts), one_hot(target_arg),
                           jax.random.key(0))
    tokens, n = np.asarray(tokens), np.asarray(n)
    for row in range(b):  # greedy: accept drafts while they are the target argmax
        agree = drafts[row] == target_arg[row, :k]
        n_acc = k if agree.all() else int(np.argmin(agree))
        assert n[row] == n_acc + 1
        np.testing.assert_array_equal(tokens[row, :n_acc + 1], target_arg[row, :n_acc + 1])
    # p == q (a draft model equal to the target): every draft is accepted
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k + 1, v)), jnp.float32))
    drafts = jax.random.categorical(jax.random.key(1), jnp.log(probs[:, :k]))
    _, n = verify_jit(drafts.astype(jnp.int32), probs[:, :k], probs, jax.random.key(2))
    assert np.all(np.asarray(n) == k + 1)


def test_speculative_config_errors():
    ok = load_config(None, ["model.mtp_depth=2", "inference.speculative.method=mtp"])
    assert ok.inference.speculative.method == "mtp"
    bad = {"is unknown": ["inference.speculative.method=medusa"],
           "positive integer": ["inference.speculative.method=draft",
                                "inference.speculative.draft=runs/d", "inference.speculative.k=0"],
           "exceeds model.mtp_depth=1": ["model.mtp_depth=1", "inference.speculative.method=mtp",
                                         "inference.speculative.k=2"],
           "mtp_depth >= 1": ["inference.speculative.method=mtp"],
           "needs a draft model": ["inference.speculative.method=draft"],
           "did you mean 'method'": ["inference.speculative.methd=mtp"]}
    for message, overrides in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


# -- greedy speculative == greedy plain decoding ----------------------------------------

SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.mlp_dim=64",
         "model.vocab_size=64", "model.init_std=0.3"]
PROMPTS = {1: [[3, 14, 15, 9, 26]], 3: [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8]]}
MAX_NEW = 24


def _model(*overrides, seed=0):
    cfg = load_config(None, SMALL + list(overrides))
    return build_model(cfg.model, rngs=nnx.Rngs(seed)), cfg


@pytest.fixture(scope="module")
def target_model():
    return _model("model.n_layers=2", "model.mtp_depth=2")


@pytest.fixture(scope="module")
def target(target_model):
    return decode_params(*target_model)


@pytest.fixture(scope="module")
def plain(target):
    return {b: generate_ids(target, PROMPTS[b], max_new_tokens=MAX_NEW, temperature=0,
                            warmup=False)[0] for b in PROMPTS}


def _early_exit_draft(target_model):
    """A 1-layer draft sharing the target's embedding, first block and head: it agrees
    with the target on some tokens and not others."""
    draft, cfg = _model("model.n_layers=1")
    graphdef, state = nnx.split(draft)
    tgt = nnx.to_pure_dict(nnx.state(target_model[0]))
    params = dict(nnx.to_pure_dict(state), embed=tgt["embed"], final_norm=tgt["final_norm"],
                  head=tgt["head"], blocks=jax.tree.map(lambda x: x[:1], tgt["blocks"]))
    nnx.replace_by_pure_dict(state, params)
    return decode_params(nnx.merge(graphdef, state), cfg)


@pytest.mark.parametrize("method,batch", [("mtp", 1), ("draft", 3), ("self", 1)])
def test_greedy_speculative_matches_plain(target_model, target, plain, method, batch):
    k = 2 if method == "mtp" else 3
    draft = {"mtp": None, "draft": _early_exit_draft(target_model), "self": target}[method]
    ids, stats = speculative_generate_ids(
        target, PROMPTS[batch], method="mtp" if method == "mtp" else "draft", k=k, draft=draft,
        max_new_tokens=MAX_NEW, temperature=0, warmup=False)
    assert ids == plain[batch]
    assert all(len(r) == MAX_NEW for r in ids)
    rates = stats["acceptance_rate_per_position"]
    assert len(rates) == k and all(0 <= r <= 1 for r in rates)
    assert rates == sorted(rates, reverse=True)  # draft i+1 accepted only after draft i
    assert stats["mean_acceptance_length"] == pytest.approx(1 + sum(rates))
    if method == "self":  # the target drafting for itself: every draft accepted
        assert stats["mean_acceptance_length"] == k + 1
    if method == "draft":  # a partly agreeing draft: rows accept different counts
        assert 0 < stats["acceptance_rate"] < 1
