import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.inference.sampling import probabilities, sample, top_k_mask, top_p_mask


def test_top_k_keeps_k_largest():
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    masked = top_k_mask(logits, 5)
    kept = np.isfinite(np.asarray(masked))
    assert (kept.sum(-1) == 5).all()
    order = np.argsort(-np.asarray(logits), -1)[:, :5]
    assert all(kept[i, order[i]].all() for i in range(4))


def test_top_p_keeps_smallest_nucleus():
    logits = jax.random.normal(jax.random.key(1), (3, 40)) * 3
    p = 0.7
    masked = np.asarray(top_p_mask(logits, p))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for i in range(3):
        kept = np.isfinite(masked[i])
        srt = np.sort(probs[i])[::-1]
        need = np.searchsorted(np.cumsum(srt), p) + 1  # fewest tokens reaching p
        assert kept.sum() == need
        assert probs[i][kept].min() >= probs[i][~kept].max()


def test_top_p_always_keeps_argmax():
    logits = jnp.array([[10.0, 0.0, -1.0]])
    assert np.isfinite(np.asarray(top_p_mask(logits, 0.01))).sum() == 1


def test_greedy_and_distribution():
    logits = jax.random.normal(jax.random.key(2), (2, 20))
    assert (sample(logits, jax.random.key(0), 0.0) == jnp.argmax(logits, -1)).all()
    probs = probabilities(logits, 0.7, top_k=6)
    assert np.allclose(probs.sum(-1), 1) and ((probs > 0).sum(-1) == 6).all()
    keys = jax.random.split(jax.random.key(3), 4000)
    draws = jax.vmap(lambda k: sample(logits, k, 0.7, top_k=6))(keys)
    freq = np.stack([np.bincount(np.asarray(draws[:, r]), minlength=20) / 4000 for r in range(2)])
    assert np.abs(freq - np.asarray(probs)).max() < 0.04
