"""Multi-token-prediction modules: shapes, the per-depth loss against a direct
computation, training lowers the MTP loss, and the trained heads draft for speculative
decoding (greedy output identical to plain decoding, some drafts accepted)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.speculative import speculative_generate_ids
from jaxllm.model import build_model
from jaxllm.model.mtp import mtp_losses
from jaxllm.checkpoint import load_model
from jaxllm.train.trainer import train

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
         "model.mlp_dim=64", "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=2",
         "train.progress=false", "train.eval_batches=1"]


def _ce(logits, targets):
    lse = jax.nn.logsumexp(logits, -1)
    return jnp.mean(lse - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def test_mtp_shapes_and_losses():
    cfg = load_config(None, SMALL + ["model.mtp_depth=2"])
    d = cfg.model.d_model
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    assert len(model.mtp) == 2
    assert build_model(load_config(None, SMALL).model).mtp is None
    for module in model.mtp.layers:
        assert module.proj.kernel.shape == (2 * d, d)
        assert module.block.attn.q.kernel.shape == (d, 2, d // 2)
        assert module.h_norm.scale.shape == module.e_norm.scale.shape == (d,)
    b, s = 3, 12
    targets = jax.random.randint(jax.random.key(1), (b, s), 0, cfg.model.vocab_size)
    inputs = jax.random.randint(jax.random.key(2), (b, s), 0, cfg.model.vocab_size)

    @jax.jit
    def losses_and_direct(params):
        model = nnx.merge(graphdef, params)
        _, h = model(inputs, return_hidden=True)
        # Direct computation: depth k over the first S-k positions only (causal, so the
        # masked tail cannot change them), embedding t_{i+k} and predicting t_{i+k+1}.
        pos = lambda n: jnp.broadcast_to(jnp.arange(n), (b, n))
        h1 = model.mtp.layers[0](h[:, :s - 1], model.embed(targets[:, :s - 1]), pos(s - 1))
        h2 = model.mtp.layers[1](h1[:, :s - 2], model.embed(targets[:, 1:s - 1]), pos(s - 2))
        direct = jnp.stack([_ce(model.logits(h1), targets[:, 1:]),
                            _ce(model.logits(h2), targets[:, 2:])])
        return mtp_losses(model, h, targets), direct

    graphdef, params = nnx.split(model)
    (losses, accs), direct = losses_and_direct(params)
    assert losses.shape == accs.shape == (2,)
    assert np.all((np.asarray(accs) >= 0) & (np.asarray(accs) <= 1))
    np.testing.assert_allclose(losses, direct, rtol=1e-5)



def _train(tmp, corpus, *overrides):
    cfg = load_config(None, SMALL + [
        "train.lr=1e-2", "train.log_every=10", f"data.source={corpus}",
        f"data.cache_dir={tmp / 'c'}", f"train.run_dir={tmp / 'run'}", "data.val_fraction=0.2",
        *overrides])
    train(cfg)
    return tmp / "run", [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl")]


@pytest.fixture(scope="module")
def mtp_run(corpus, tmp_path_factory):
    return _train(tmp_path_factory.mktemp("mtp"), corpus, "model.mtp_depth=1",
                  "train.steps=40", "train.eval_every=40", "checkpoint.every=40")


def test_training_lowers_mtp_loss_and_heads_draft(mtp_run):
    run, records = mtp_run
    assert {"mtp1_loss", "mtp1_acc"} <= set(records[-1])
    assert records[-1]["mtp1_loss"] < records[0]["mtp1_loss"] - 1.0
    assert records[-1]["mtp1_acc"] > records[0]["mtp1_acc"]

    model, cfg, _ = load_model(run)
    params = decode_params(model, cfg)
    prompts = [[257, *b"def f(self"], [257, *b"for x in"], [257, *b"import"]]
    plain, _ = generate_ids(params, prompts, max_new_tokens=24, temperature=0, warmup=False)
    ids, stats = speculative_generate_ids(params, prompts, method="mtp", k=1,
                                          max_new_tokens=24, temperature=0, warmup=False)
    assert ids == plain
    assert stats["acceptance_rate"] > 0.2  # the trained head predicts t+2 often


def test_distillation_from_a_run(mtp_run, corpus, tmp_path):
    """A 1-layer draft distilled from the trained model: KL(teacher || draft) falls."""
    _, records = _train(tmp_path, corpus, "model.n_layers=1", f"train.distill_from={mtp_run[0]}",
                        "train.steps=20", "train.log_every=5", "train.eval_every=20",
                        "checkpoint.enabled=false")
    assert {"distill_kl", "loss"} <= set(records[-1])
    assert records[-1]["distill_kl"] < 0.5 * records[0]["distill_kl"]
    assert records[-1]["loss"] < records[0]["loss"]  # the CE follows the teacher's
