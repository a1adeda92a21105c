"""Expert parallelism (sharding/experts.py): the all-to-all form of the MoE layer against the
one-device expert_ffn (both exchanges, skewed load), the tiny MoE model's (with an MoE MTP
module) loss and gradients
under ep alone, ep x fsdp x tp, ep x dp and dp x tp (no ep: every device its own tokens)
against one device, the same over 2 processes x 4 devices (ep across them, and ep inside
each with fsdp or dp across them), and its config errors."""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import experts_worker as worker
from jaxllm.config import ConfigError, ParallelismConfig, load_config
from jaxllm.model.moe import expert_ffn
from jaxllm.sharding import AXES, Rules, make_mesh
from jaxllm.sharding import experts
from jaxllm.sharding.constrain import ShardingContext, active
from jaxllm.train.trainer import sharding_plan
from processes import run, two_hosts


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
def layouts(tmp_path_factory):
    """Loss and gradients of one device and of every layout, from tests/experts_worker.py."""
    out = tmp_path_factory.mktemp("experts")
    run(worker.__file__, out, timeout=600)
    return out


def _assert_like_one_device(want, have):
    assert "error" not in have, str(have["error"])
    assert set(want) == set(have)
    np.testing.assert_allclose(have["loss"], want["loss"], rtol=2e-6)
    for key in want:
        scale = np.abs(want[key]).max() + 1e-30
        np.testing.assert_allclose(have[key] / scale, want[key] / scale, atol=2e-5, err_msg=key)


@pytest.mark.parametrize("name", list(worker.LAYOUTS))
def test_layout_gives_one_device_loss_and_grads(layouts, name):
    _assert_like_one_device(np.load(layouts / "single.npz"), np.load(layouts / f"{name}.npz"))


@pytest.fixture(scope="module")
def two_host_layouts(tmp_path_factory):
    """The MULTIHOST layouts' results from 2 worker processes of 4 devices each."""
    out = tmp_path_factory.mktemp("experts_multihost")
    two_hosts(worker.__file__, out, timeout=300)
    return out


@pytest.mark.parametrize("name", list(worker.MULTIHOST))
def test_two_hosts_give_one_device_loss_and_grads(layouts, two_host_layouts, name):
    """The layout's mesh puts its named axis across the 2 processes and every other axis
    inside one; its loss and gradients are those of one device."""
    hosts = np.array(json.loads((two_host_layouts / "multihost.json").read_text())[name])
    axis = AXES.index(worker.MULTIHOST[name][1])
    by_axis = np.moveaxis(hosts, axis, 0).reshape(hosts.shape[axis], -1)  # [axis, the rest]
    half = len(by_axis) // 2  # the first half of the axis on process 0, the rest on 1
    assert (by_axis[:half] == 0).all() and (by_axis[half:] == 1).all(), hosts.tolist()
    _assert_like_one_device(np.load(layouts / "single.npz"),
                            np.load(two_host_layouts / f"multihost_{name}.npz"))


def test_config_errors_and_dense_models():
    """ep must divide the experts; a dense model keeps ep as a data-parallel axis."""
    with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by parallelism.ep=8"):
        sharding_plan(worker.config(["parallelism.dp=1", "parallelism.ep=8",
                                     "model.moe.num_experts=4"]))
    dense = load_config("configs/tiny.yaml", ["parallelism.dp=1", "parallelism.ep=8"])
    assert sharding_plan(dense).rules.batch_axes() == ("ep",)
