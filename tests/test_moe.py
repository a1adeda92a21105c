"""Mixture-of-experts layers (model/moe.py): the block against a per-token loop over each
token's experts (forward and gradients, both routers, groups, shared experts, the
selection bias), dropless dispatch at skewed load, auxiliary-loss-free balancing in the
training step (outside the optimizer, kept by checkpoints), the load max/mean figure in
training and evaluation, config errors, and decoding."""
import json
import math
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm
from jaxllm.checkpoint import Checkpointer, load_model
from jaxllm.config import ConfigError, load_config, save_config
from jaxllm.model.moe import MoE, expert_ffn, load_max_over_mean
from jaxllm.train.trainer import evaluate, init_state, sharding_plan, train

D, T = 16, 12
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.expert_mlp_dim=8"]
SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.mlp_dim=48",
         "model.vocab_size=64", "model.n_layers=3", "model.init_std=0.3",
         "model.moe.dense_layers=1", "model.moe.num_shared_experts=1"] + MOE


def _swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _reference_choice(logits, bias, m):
    """Each token's experts by a plain loop: scores (+ bias), group filter, top k."""
    scores = np.asarray(jax.nn.softmax(logits) if m.router == "softmax"
                        else jax.nn.sigmoid(logits))
    ids = []
    for s in scores + (0 if bias is None else np.asarray(bias)):
        groups = s.reshape(m.n_groups, -1)
        best = np.argsort([-np.sort(g)[-2:].sum() for g in groups])[:m.topk_groups]
        allowed = [e for e in range(len(s)) if e // groups.shape[1] in best]
        ids.append(sorted(allowed, key=lambda e: -s[e])[:m.top_k])
    return ids


def _reference(p: dict, x, ids, m):
    """The MoE block token by token: each token's own copy of its experts' weights
    (gathered [T, k, ...]), the weighted sum of their SwiGLUs, + the shared experts."""
    ids = jnp.asarray(ids)  # [T, k]
    logits = x @ p["router"]
    scores = jax.nn.softmax(logits) if m.router == "softmax" else jax.nn.sigmoid(logits)
    w = jnp.take_along_axis(scores, ids, axis=1)
    w = (w / w.sum(1, keepdims=True) if m.norm_topk_prob else w) * m.routed_scaling
    h = (jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, p["gate"][ids]))
         * jnp.einsum("td,tkdf->tkf", x, p["up"][ids]))
    y = jnp.einsum("tk,tkf,tkfd->td", w, h, p["down"][ids])
    if "shared" in p:
        sh = p["shared"]
        y = y + _swiglu(x, sh["gate"]["kernel"], sh["up"]["kernel"], sh["down"]["kernel"])
    return y


@pytest.mark.parametrize("moe", [
    ["model.moe.router=softmax", "model.moe.norm_topk_prob=false"],
    ["model.moe.router=sigmoid", "model.moe.n_groups=4", "model.moe.topk_groups=2",
     "model.moe.num_shared_experts=2", "model.moe.routed_scaling=2.5",
     "model.moe.balance=bias"],
])
def test_moe_block_matches_per_token_loop(moe):
    m = load_config(None, MOE + moe).model.moe
    block = MoE(D, m, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(1), std=0.5,
                out_std=0.5)
    graphdef, state = nnx.split(block)
    p = nnx.to_pure_dict(state)
    if m.balance == "bias":  # a bias that changes the choice of experts
        p["expert_bias"] = 0.3 * jax.random.normal(jax.random.key(2), (m.num_experts,))
    x = jax.random.normal(jax.random.key(3), (T, D))
    ct = jax.random.normal(jax.random.key(4), (T, D))  # a random cotangent
    ids = _reference_choice(x @ p["router"], p.get("expert_bias"), m)

    def ours(p, x):
        y, stats = nnx.merge(graphdef, p)(x[None])
        return jnp.sum(y[0] * ct), (y[0], stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1),
                                                        has_aux=True))(p, x)
    ref = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(_reference(p, x, ids, m) * ct),
                                     argnums=(0, 1), has_aux=False))
    ref_y = jax.jit(lambda p, x: _reference(p, x, ids, m))(p, x)
    ref_grads = ref(p, x)[1]
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    counts = np.bincount(np.ravel(ids), minlength=m.num_experts)
    np.testing.assert_allclose(stats["load"], counts / (T * m.top_k))
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    if m.balance == "bias":  # used for selection only: no gradient reaches it
        assert not np.any(grads[0]["expert_bias"])


def test_dropless_at_skewed_load():
    """Every token to the same two experts: every assignment is computed."""
    e, f, k = 4, 8, 2
    keys = jax.random.split(jax.random.key(0), 4)
    gate, up = (jax.random.normal(kk, (e, D, f)) for kk in keys[:2])
    down = jax.random.normal(keys[2], (e, f, D))
    x = jax.random.normal(keys[3], (T, D))
    ids = jnp.tile(jnp.array([[2, 0]], jnp.int32), (T, 1))
    w = jax.random.uniform(jax.random.key(5), (T, k))
    want = (w[:, :1] * _swiglu(x, gate[2], up[2], down[2])
            + w[:, 1:] * _swiglu(x, gate[0], up[0], down[0]))
    np.testing.assert_allclose(jax.jit(expert_ffn)(x, ids, w, gate, up, down), want,
                               rtol=1e-5, atol=1e-4)


def test_bias_balances_load_outside_the_optimizer(tmp_path):
    """A bias that sends (nearly) everything to two experts: each step moves every expert's bias
    by exactly rate x sign(mean - load), down for those two (whatever the optimizer would
    do: weight decay), load max/mean falls, and a checkpoint keeps the bias."""
    rate = 0.1
    cfg = load_config(None, SMALL + [
        "model.n_layers=2", "model.moe.dense_layers=0", "model.moe.num_shared_experts=0",
        "model.moe.router=sigmoid", "model.moe.balance=bias",
        f"model.moe.bias_update_rate={rate}", "train.batch_size=8", "train.seq_len=16",
        "train.lr=1e-3", "train.warmup_steps=0", "train.weight_decay=1.0", "model.remat=none",
        f"train.run_dir={tmp_path}"])
    graphdef, params, opt_state, fns = init_state(cfg, sharding_plan(cfg, jax.devices()[:1]))
    bias = params["blocks"]["mlp"]["expert_bias"]
    params["blocks"]["mlp"]["expert_bias"] = bias.at[:, :2].set(0.5)  # experts 0, 1 favoured
    rng = np.random.default_rng(0)
    loads = []
    for i in range(8):
        before = np.asarray(params["blocks"]["mlp"]["expert_bias"])
        batch = {k: jnp.asarray(rng.integers(0, 64, (8, 16), dtype=np.int32))
                 for k in ("inputs", "targets")}
        params, opt_state, metrics = fns.step(params, opt_state, batch)
        moved = np.asarray(params["blocks"]["mlp"]["expert_bias"]) - before
        steps = np.round(moved / rate, 4)  # +-1, or 0 for an expert at exactly the mean
        assert np.isin(steps, [-1, 0, 1]).all() and np.abs(steps).mean() > 0.5, moved
        if i == 0:  # the favoured experts are overloaded
            assert np.all(moved[:, :2] < 0)
        loads.append(float(metrics["moe_load_max"]))
    assert min(loads[-4:]) < 0.6 * loads[0], loads  # (sign steps oscillate near balance)
    assert "expert_load" not in metrics

    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    ckpt.save(8, params, opt_state, force=True)
    ckpt.close()
    save_config(cfg, tmp_path / "config.yaml")
    model, _, step = load_model(tmp_path)
    assert step == 8
    np.testing.assert_array_equal(model.blocks.mlp.expert_bias[...],
                                  params["blocks"]["mlp"]["expert_bias"])


def test_load_max_over_mean_on_random_counts():
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 50, (5, 8))  # [L, E] token counts
    want = counts.max(-1) / counts.mean(-1)
    np.testing.assert_allclose(load_max_over_mean(counts, per_layer=True), want, rtol=1e-6)
    np.testing.assert_allclose(load_max_over_mean(counts), want.max(), rtol=1e-6)
    # fractions give the same figure as counts; one expert taking all gives E, even load 1
    np.testing.assert_allclose(load_max_over_mean(counts / counts.sum(-1, keepdims=True)),
                               want.max(), rtol=1e-6)
    assert float(load_max_over_mean(np.eye(8)[3])) == pytest.approx(8.0)
    assert float(load_max_over_mean(np.full(8, 5))) == pytest.approx(1.0)


def test_evaluate_sums_loads_over_validation_batches():
    """eval_moe_load_max is max/mean of the loads summed over the batches: two batches
    skewed in opposite directions balance each other (1.0), which a mean of per-batch
    figures would not (1.5). The loss is the batches' mean."""
    rng = np.random.default_rng(3)
    loads = [np.array([[0.75, 0.25], [0.5, 0.5]]), np.array([[0.25, 0.75], [0.5, 0.5]])]
    loads += [rng.dirichlet(np.ones(2), size=2) for _ in range(2)]
    losses = rng.uniform(1, 3, 4)
    outs = iter([{"loss": l, "expert_load": w} for l, w in zip(losses, loads)])
    fns = types.SimpleNamespace(plan=types.SimpleNamespace(data_shard=lambda: (0, 1)),
                                eval=lambda params, batch: next(outs))
    cfg = load_config(None, ["train.eval_batches=4", "train.seq_len=8", "train.batch_size=2"])
    rec = evaluate(fns, None, cfg, np.arange(200, dtype=np.int32), place=lambda b: b)
    total = np.sum(loads, axis=0)
    assert rec["eval_loss"] == pytest.approx(losses.mean())
    assert rec["eval_moe_load_max"] == pytest.approx(
        np.max(total.max(-1) / total.mean(-1)), rel=1e-6)
    outs = iter([{"loss": l, "expert_load": w} for l, w in zip(losses, loads)])
    cfg = load_config(None, ["train.eval_batches=2", "train.seq_len=8", "train.batch_size=2"])
    rec = evaluate(fns, None, cfg, np.arange(200, dtype=np.int32), place=lambda b: b)
    assert rec["eval_moe_load_max"] == pytest.approx(1.0)  # per-batch mean: 1.5


def test_train_run_logs_eval_load_max(corpus, tmp_path):
    """A short tiny_moe run logs eval_moe_load_max at its evaluations (beside eval_loss),
    and moe_load_max at every logged step."""
    run = tmp_path / "run"
    cfg = load_config("configs/tiny_moe.yaml", [
        "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.n_layers=2",
        "model.mlp_dim=48", "model.moe.expert_mlp_dim=16", "train.steps=2",
        "train.batch_size=8", "train.seq_len=16", "train.warmup_steps=1", "train.log_every=1",
        "train.eval_every=2", "train.eval_batches=2", "train.progress=false",
        "checkpoint.enabled=false", f"data.source={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2", f"train.run_dir={run}"])
    train(cfg, resume=False)
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]
    assert "eval_moe_load_max" not in recs[0] and "eval_loss" in recs[1]
    assert all("moe_load_max" in r for r in recs)
    assert 1.0 <= recs[1]["eval_moe_load_max"] <= cfg.model.moe.num_experts


@pytest.mark.parametrize("override,match", [
    ("model.moe.top_k=9", "model.moe.top_k=9 exceeds model.moe.num_experts=8"),
    ("model.moe.n_groups=3", "model.moe.n_groups=3 does not divide"),
    ("model.moe.topk_groups=2", "model.moe.topk_groups=2 exceeds model.moe.n_groups=1"),
    ("model.moe.dense_layers=3", "model.moe.dense_layers=3 leaves no MoE layer"),
    ("model.moe.router=relu", "model.moe.router='relu' is unknown"),
    ("model.moe.bias_update_rate=-1", "model.moe.bias_update_rate=-1.0 must be >= 0"),
    ("model.moe.n_groups=8", "top_k=2 exceeds the 1 experts of the topk_groups=1"),
    ("model.moe.num_expert=4", "did you mean 'num_experts'"),
])
def test_moe_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, SMALL + [override])


def test_num_params_counts_all_and_active():
    cfg = load_config(None, SMALL).model
    state = nnx.state(nnx.eval_shape(lambda: jaxllm.build_model(cfg)), nnx.Param)
    assert sum(math.prod(a.shape) for a in jax.tree.leaves(state)) == cfg.num_params()
    m = cfg.moe  # two MoE layers, each running 2 of its 8 routed experts
    assert cfg.num_params() - cfg.num_params(active=True) == 2 * 6 * 3 * 32 * m.expert_mlp_dim


def test_generate_equals_greedy_forward():
    """jaxllm.generate (prefill + cached decode through the MoE layers) gives the training
    forward's greedy argmax at every step."""
    cfg = load_config("configs/tiny_moe.yaml", ["model.d_model=32", "model.n_heads=2",
                                                "model.n_kv_heads=1", "model.n_layers=2",
                                                "model.init_std=0.3"])
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(4))
    graphdef, state = nnx.split(model)
    bias = state["blocks"]["mlp"]["expert_bias"]
    bias[...] = 0.2 * jax.random.normal(jax.random.key(1), bias[...].shape)
    model = nnx.merge(graphdef, state)
    prompt = [1, 40, 41, 42, 43]
    out = jaxllm.generate(model, cfg, [prompt], max_new_tokens=8, temperature=0.0,
                          return_result=True).tokens[0]
    tokens = prompt + list(out)
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray([tokens[:-1]], jnp.int32))[0]
    np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:], -1), out)
