"""Multi-token-prediction modules: shapes (an MoE and MLA block in an MoE MLA model), the
per-depth loss against a direct computation, the decode program's drafts against the
training form, MoE balancing of the MTP blocks, training lowers the MTP loss, and the
trained heads draft for speculative decoding (greedy output identical to plain decoding,
some drafts accepted)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.speculative import draft_with_mtp, speculative_generate_ids
from jaxllm.inference.step import forward, init_cache
from jaxllm.model import build_model
from jaxllm.model.mtp import mtp_losses, shift_left
from jaxllm.checkpoint import load_model
from jaxllm.train.trainer import init_state, sharding_plan, train

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
         "model.mlp_dim=64", "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=2",
         "train.progress=false", "train.eval_batches=1"]
# DeepSeek-V3's kind of MTP block: MLA attention, an MoE feed-forward part (sigmoid router
# with a selection bias), after one dense layer
MOE_MLA = ["model.n_kv_heads=2", "model.attention=mla", "model.mla.kv_lora_rank=16",
           "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8",
           "model.mla.v_head_dim=8", "model.mla.q_lora_rank=24", "model.moe.num_experts=4",
           "model.moe.top_k=2", "model.moe.expert_mlp_dim=16", "model.moe.num_shared_experts=1",
           "model.moe.dense_layers=1", "model.moe.router=sigmoid", "model.moe.balance=bias"]
CASES = {"dense": [], "moe_mla": MOE_MLA}


def _ce(logits, targets):
    lse = jax.nn.logsumexp(logits, -1)
    return jnp.mean(lse - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def _perturb(model, seed=3):
    """N(0, 0.3) added to every parameter and selection bias: norm scales, biases and
    routing that differ between modules and layers."""
    leaves, treedef = jax.tree.flatten(nnx.state(model))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [
        x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_mtp_shapes_and_losses(case):
    cfg = load_config(None, SMALL + CASES[case] + ["model.mtp_depth=2"])
    d = cfg.model.d_model
    model = _perturb(build_model(cfg.model, rngs=nnx.Rngs(0)))
    assert len(model.mtp) == 2
    assert build_model(load_config(None, SMALL).model).mtp is None
    for module in model.mtp.layers:
        assert module.proj.kernel.shape == (2 * d, d)
        assert (module.e_norm.scale.shape == module.h_norm.scale.shape
                == module.final_norm.scale.shape == (d,))
        if case == "dense":
            assert module.block.attn.q.kernel.shape == (d, 2, d // 2)
            assert module.block.mlp.gate.kernel.shape == (d, 64)
        else:  # the main MoE stack's kind of block: MLA, routed and shared experts, bias
            assert module.block.attn.q_b.kernel.shape == (24, 2, 16)
            assert module.block.mlp.gate.shape == (4, d, 16)
            assert module.block.mlp.expert_bias.shape == (4,)
    n = lambda tree: sum(x.size for x in jax.tree.leaves(nnx.state(tree, nnx.Param)))  # noqa: E731
    assert n(model.mtp) == cfg.model.mtp_params()  # the planner's and MFU's count
    assert n(model) == cfg.model.num_params() + cfg.model.mtp_params()
    b, s = 3, 12
    targets = jax.random.randint(jax.random.key(1), (b, s), 0, cfg.model.vocab_size)
    inputs = jax.random.randint(jax.random.key(2), (b, s), 0, cfg.model.vocab_size)

    @jax.jit
    def losses_and_direct(params):
        model = nnx.merge(graphdef, params)
        _, h = model(inputs, return_hidden=True)
        # Direct computation: depth k over the first S-k positions only (causal, so the
        # masked tail cannot change them), embedding t_{i+k} and predicting t_{i+k+1};
        # depth 1 reads the main model's normed hidden states (what its head reads)
        pos = lambda n: jnp.broadcast_to(jnp.arange(n), (b, n))
        h0 = model.final_norm(h)
        h1, st1 = model.mtp.layers[0](h0[:, :s - 1], model.embed(targets[:, :s - 1]), pos(s - 1))
        h2, st2 = model.mtp.layers[1](h1[:, :s - 2], model.embed(targets[:, 1:s - 1]), pos(s - 2))
        direct = jnp.stack([_ce(model.head_logits(h1), targets[:, 1:]),
                            _ce(model.head_logits(h2), targets[:, 2:])])
        return mtp_losses(model, h, targets), direct, (st1, st2)

    graphdef, params = nnx.split(model)
    (losses, accs, stats), direct, (st1, st2) = losses_and_direct(params)
    assert losses.shape == accs.shape == (2,)
    assert np.all((np.asarray(accs) >= 0) & (np.asarray(accs) <= 1))
    np.testing.assert_allclose(losses, direct, rtol=1e-5)
    if case == "dense":
        assert stats == st1 == st2 == {}
    else:  # the MTP blocks' routing statistics, stacked [D, ...] like the main stack's
        assert stats["load"].shape == (2, 4)
        np.testing.assert_allclose(stats["load"].sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_drafts_match_the_training_form(case):
    """The decode program's MTP chain (`draft_with_mtp` after a prefill) gives the
    probabilities of the training form's modules at the last position: module 1 fed the
    known next token, module 2 the token module 1 drafted."""
    cfg = load_config(None, SMALL + CASES[case] + ["model.mtp_depth=2", "model.vocab_size=64"])
    model = _perturb(build_model(cfg.model, rngs=nnx.Rngs(0)))
    params = decode_params(model, cfg)
    b, s, k = 2, 10, 2
    tokens = jax.random.randint(jax.random.key(4), (b, s), 0, 64)
    first = jax.random.randint(jax.random.key(5), (b,), 0, 64)  # the token after the prompt
    last = jnp.full((b,), s - 1, jnp.int32)
    _, _, h = forward(params, tokens, init_cache(params, b, 64), jnp.zeros(b, jnp.int32),
                      prefill=True)
    next_tokens = shift_left(tokens, 1).at[:, s - 1].set(first)
    drafts, probs, _ = draft_with_mtp(params, h, next_tokens, last, init_cache(params, b, 64, k),
                                      jnp.zeros(b, jnp.int32), jax.random.key(6), k,
                                      dict(temperature=1.0, top_k=0, top_p=1.0), prefill=True)

    _, h = model(tokens, return_hidden=True)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    h1, _ = model.mtp.layers[0](model.final_norm(h), model.embed(next_tokens), pos)
    ahead = shift_left(next_tokens, 1).at[:, s - 1].set(drafts[:, 0])
    h2, _ = model.mtp.layers[1](h1, model.embed(ahead), pos)
    for i, hk in enumerate((h1, h2)):
        want = jax.nn.softmax(model.head_logits(hk)[:, -1], axis=-1)
        np.testing.assert_allclose(probs[:, i], want, atol=2e-5)
    assert float(jnp.max(probs)) > 2.0 / 64  # not uniform: the comparison says something


def test_mtp_moe_blocks_balance_with_their_own_load():
    """A training step of an MoE model with MTP modules moves each MTP block's selection
    bias by rate x sign(mean - load) of its own routing (not the main layers'), every
    expert by a step or none, and logs the MTP losses and the load over all MoE blocks."""
    rate = 0.1
    cfg = load_config(None, SMALL + MOE_MLA + [
        "model.mtp_depth=2", "model.vocab_size=64", f"model.moe.bias_update_rate={rate}",
        "train.batch_size=4", "train.seq_len=16", "model.remat=none"])
    graphdef, params, opt_state, fns = init_state(cfg, sharding_plan(cfg, jax.devices()[:1]))
    mtp_bias = lambda p: np.stack([np.asarray(p["mtp"]["layers"][k]["block"]["mlp"]
                                              ["expert_bias"]) for k in range(2)])
    # one MTP block's bias favours expert 0, so its load is skewed while the others' differ
    params["mtp"]["layers"][0]["block"]["mlp"]["expert_bias"] = jnp.array([1.0, 0, 0, 0])
    before, main_before = mtp_bias(params), np.asarray(params["blocks"]["mlp"]["expert_bias"])
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, 64, (4, 16), dtype=np.int32))
             for k in ("inputs", "targets")}
    params, opt_state, metrics = fns.step(params, opt_state, batch)
    moved = np.round((mtp_bias(params) - before) / rate, 4)
    assert moved.shape == (2, 4) and np.isin(moved, [-1, 0, 1]).all()
    assert moved[0, 0] == -1  # expert 0 of MTP block 1 takes every token: pushed down
    assert np.isin(np.round((np.asarray(params["blocks"]["mlp"]["expert_bias"])
                             - main_before) / rate, 4), [-1, 0, 1]).all()
    assert {"mtp1_loss", "mtp2_loss", "moe_load_max"} <= set(metrics)
    assert float(metrics["moe_load_max"]) > 1.5  # MTP block 1's skewed load counts

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
