"""Expert parallelism (sharding/experts.py): the all-to-all form of the MoE layer against the
one-device expert_ffn (both exchanges, skewed load), the tiny MoE model's loss and gradients
under ep alone and ep x fsdp / tp / dp against one device, and its config errors."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxllm.config import ConfigError, ParallelismConfig, load_config
from jaxllm.model.moe import expert_ffn
from jaxllm.sharding import Rules, make_mesh
from jaxllm.sharding import experts
from jaxllm.sharding.constrain import ShardingContext, active, traced_in
from jaxllm.train.trainer import loss_fn, sharding_plan

MODEL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.mlp_dim=64",
         "model.n_layers=2", "model.moe.expert_mlp_dim=16", "model.init_std=0.3",
         "train.batch_size=8", "train.seq_len=16"]
LAYOUTS = {
    "ep8": ["parallelism.dp=1", "parallelism.ep=8"],
    "ep4_fsdp2": ["parallelism.dp=1", "parallelism.fsdp=2", "parallelism.ep=4"],
    "ep4_tp2": ["parallelism.dp=1", "parallelism.ep=4", "parallelism.tp=2"],
    "ep2_dp2_tp2": ["parallelism.dp=2", "parallelism.ep=2", "parallelism.tp=2"],
}


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all by its definition, from all-gathers (the CPU has none):
    source s's rows [input_offsets[s, me], + send_sizes[s, me]) land at output_offsets[s, me]."""
    del recv_sizes  # implied by the senders' sizes
    me = lax.axis_index(axis_name)
    ops = lax.all_gather(operand, axis_name)
    ins, sizes, outs = (lax.all_gather(a, axis_name)[:, me]
                        for a in (input_offsets, send_sizes, output_offsets))
    r = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        here = (r >= outs[s]) & (r < outs[s] + sizes[s])
        rows = jnp.take(ops[s], jnp.clip(ins[s] + r - outs[s], 0, operand.shape[0] - 1), axis=0)
        output = jnp.where(here[:, None], rows, output)
    return output


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
def test_all_to_all_equals_one_device(exchange, monkeypatch):
    """ep=4 over 2 experts each: random routing, and every token to experts 4 and 5 (all
    assignments of all devices to device 2: the full receive buffer, nothing dropped);
    forward and gradients. The ragged exchange runs on the CPU emulated by its definition
    after its real form is lowered."""
    t, d, f, e, k = 32, 8, 8, 8, 2
    mesh = make_mesh(ParallelismConfig(dp=2, ep=4))
    ctx = ShardingContext(mesh, Rules.for_mesh(mesh))
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (t, d))
    gate, up = (jax.random.normal(kk, (e, d, f)) for kk in keys[1:3])
    down = jax.random.normal(keys[3], (e, f, d))
    w = jax.random.uniform(keys[4], (t, k))
    ct = jax.random.normal(keys[5], (t, d))
    spread = jnp.argsort(jax.random.uniform(jax.random.key(7), (t, e)), axis=1)[:, :k]
    skewed = jnp.tile(jnp.array([[5, 4]], jnp.int32), (t, 1))

    def sharded(x, w, gate, up, down, ids):
        with active(ctx):
            y = experts.expert_ffn(x, ids, w, gate, up, down, local=expert_ffn,
                                   exchange=exchange)
        return jnp.sum(y * ct), y

    def single(x, w, gate, up, down, ids):
        y = expert_ffn(x, ids, w, gate, up, down)
        return jnp.sum(y * ct), y

    grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4), has_aux=True))
    if exchange == "ragged":
        grad(sharded).lower(x, w, gate, up, down, skewed)  # the real collective traces
        monkeypatch.setattr(lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    for ids in (spread.astype(jnp.int32), skewed):
        (_, y), g = grad(sharded)(x, w, gate, up, down, ids)
        (_, y_ref), g_ref = grad(single)(x, w, gate, up, down, ids)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_device():
    """A batch and the tiny MoE model's parameters, loss and gradients on one device."""
    tokens = np.random.default_rng(0).integers(0, 258, size=(8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    plan = sharding_plan(_config(["parallelism.dp=1"]), jax.devices()[:1])
    params = jax.device_get(plan.init_params())
    return params, batch, _loss_and_grads(plan, params, batch)


def _config(overrides):
    return load_config("configs/tiny_moe.yaml", MODEL + overrides)


def _loss_and_grads(plan, params, batch):
    fn = jax.value_and_grad(lambda p, b: loss_fn(plan.graphdef, p, b)[0])
    step = jax.jit(traced_in(plan.context, fn), in_shardings=(plan.params, plan.batch),
                   out_shardings=(plan.replicated, plan.shardings("grads")))
    loss, grads = step(jax.device_put(params, plan.params), plan.place_batch(batch))
    return float(loss), jax.device_get(grads)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_gives_one_device_loss_and_grads(one_device, name):
    params, batch, (loss_ref, grads_ref) = one_device
    plan = sharding_plan(_config(LAYOUTS[name]))
    assert plan.params["blocks"]["mlp"]["gate"].spec[1] == "ep"  # [L, E, d, f]: E on ep
    loss, grads = _loss_and_grads(plan, params, batch)
    np.testing.assert_allclose(loss, loss_ref, rtol=2e-6)
    for g, g_ref in zip(*(jax.tree_util.tree_flatten_with_path(tree)[0]
                                for tree in (grads, grads_ref))):
        scale = np.abs(g_ref[1]).max() + 1e-30
        np.testing.assert_allclose(g[1] / scale, g_ref[1] / scale, atol=2e-5,
                                   err_msg=jax.tree_util.keystr(g_ref[0]))


def test_config_errors_and_dense_models():
    """ep must divide the experts; a dense model keeps ep as a data-parallel axis."""
    with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by parallelism.ep=8"):
        sharding_plan(_config(["parallelism.dp=1", "parallelism.ep=8",
                               "model.moe.num_experts=4"]))
    dense = load_config("configs/tiny.yaml", ["parallelism.dp=1", "parallelism.ep=8"])
    assert sharding_plan(dense).rules.batch_axes() == ("ep",)
