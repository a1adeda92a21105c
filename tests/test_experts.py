"""Expert parallelism (sharding/experts.py): the all-to-all form of the MoE layer against the
one-device expert_ffn (both exchanges, skewed load), the tiny MoE model's loss and gradients
under ep alone, ep x fsdp x tp, ep x dp and dp x tp (no ep: every device its own tokens)
against one device, and its config errors."""
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import experts_worker as worker
from jaxllm.config import ConfigError, ParallelismConfig, load_config
from jaxllm.model.moe import expert_ffn
from jaxllm.sharding import Rules, make_mesh
from jaxllm.sharding import experts
from jaxllm.sharding.constrain import ShardingContext, active
from jaxllm.train.trainer import sharding_plan

ROOT = Path(__file__).resolve().parents[1]


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
    flags = ("--xla_force_host_platform_device_count=8 "
             "--xla_backend_optimization_level=0")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, worker.__file__, str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.mark.parametrize("name", list(worker.LAYOUTS))
def test_layout_gives_one_device_loss_and_grads(layouts, name):
    want, have = np.load(layouts / "single.npz"), np.load(layouts / f"{name}.npz")
    assert "error" not in have, str(have["error"])
    assert set(want) == set(have)
    np.testing.assert_allclose(have["loss"], want["loss"], rtol=2e-6)
    for key in want:
        scale = np.abs(want[key]).max() + 1e-30
        np.testing.assert_allclose(have[key] / scale, want[key] / scale, atol=2e-5, err_msg=key)


def test_config_errors_and_dense_models():
    """ep must divide the experts; a dense model keeps ep as a data-parallel axis."""
    with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by parallelism.ep=8"):
        sharding_plan(worker.config(["parallelism.dp=1", "parallelism.ep=8",
                                     "model.moe.num_experts=4"]))
    dense = load_config("configs/tiny.yaml", ["parallelism.dp=1", "parallelism.ep=8"])
    assert sharding_plan(dense).rules.batch_axes() == ("ep",)
