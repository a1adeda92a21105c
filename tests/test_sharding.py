"""Sharding: mesh, rules, context-parallel attention, and every layout vs one device.

The layouts train in one worker process (tests/sharding_worker.py; 8 simulated CPU
devices, XLA backend optimisation off for 3x faster compiles) and multi-host runs as two
such processes of 4 devices each over gloo; the tests here compare their results.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import sharding_worker as worker
from jaxllm.config import ConfigError, ParallelismConfig, load_config
from jaxllm.sharding import Rules, constrain, make_mesh, mesh_shape
from jaxllm.sharding.mesh import AXES, _host_split
from processes import ROOT, env, run, two_hosts

WORKER = Path(worker.__file__)


# ----------------------------------------------------------------------------- mesh


def test_mesh_shape_fills_and_checks():
    p = ParallelismConfig(dp=-1, fsdp=2, tp=2)
    assert mesh_shape(p, 8) == {"pp": 1, "dp": 2, "fsdp": 2, "ep": 1, "cp": 1, "tp": 2}
    with pytest.raises(ConfigError, match=r"needs 6 devices but 8 are present"):
        mesh_shape(ParallelismConfig(dp=3, tp=2), 8)
    with pytest.raises(ConfigError, match=r"take 3 devices.*8 devices present"):
        mesh_shape(ParallelismConfig(dp=-1, tp=3), 8)


def test_make_mesh_axes_are_auto():
    mesh = make_mesh(ParallelismConfig(dp=2, cp=2, tp=2))
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"pp": 1, "dp": 2, "fsdp": 1, "ep": 1, "cp": 2, "tp": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_host_split_keeps_inner_axes_in_a_host():
    sizes = {"pp": 1, "dp": 2, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}
    assert _host_split(sizes, 4) == {"pp": 1, "dp": 2, "fsdp": 2, "ep": 1, "cp": 1, "tp": 1}
    only_cp = {"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "cp": 8, "tp": 1}
    assert _host_split(only_cp, 2)["cp"] == 2  # no outer axis left: cp spans hosts
    with pytest.raises(ConfigError, match="cannot spread"):
        _host_split({**only_cp, "cp": 4, "tp": 2}, 3)


# ----------------------------------------------------------------------------- rules


def _rules(stage=0, sp=False, **sizes):
    full = {a: sizes.get(a, 1) for a in AXES}
    return Rules(tuple(full.items()), stage, sp)


def test_param_specs_by_zero_stage():
    q = (("layers", "embed", "q_heads", "head_dim"), (2, 32, 4, 8))
    r0, r1, r2, r3 = (_rules(s, dp=2, fsdp=2, tp=2) for s in range(4))
    assert r0.param_spec(*q) == P(None, "fsdp", "tp", None)
    assert r3.param_spec(*q) == P(None, ("dp", "fsdp"), "tp", None)
    assert r1.param_spec(*q, kind="opt_state") == P(None, ("dp", "fsdp"), "tp", None)
    assert r1.param_spec(*q, kind="grads") == P(None, "fsdp", "tp", None)
    assert r2.param_spec(*q, kind="grads") == P(None, ("dp", "fsdp"), "tp", None)
    assert r3.param_spec(*q, kind="compute") == P(None, None, "tp", None)
    # vocab-parallel embedding; one KV head cannot be split over tp=2 and stays whole
    assert r0.param_spec(("vocab", "embed"), (258, 32)) == P("tp", "fsdp")
    assert r0.param_spec(("embed", "kv_heads", "head_dim"), (32, 1, 8)) == P("fsdp", None, None)
    # no embed axis: ZeRO takes the largest divisible dimension that is not `layers`
    assert r3.param_spec(("layers", None, "latent"), (4, 6, 64)) == P(None, None, ("dp", "fsdp"))


def test_activation_specs_and_sequence_parallel():
    r = _rules(dp=2, fsdp=2, cp=2)
    assert r.activation_spec(("batch", "seq", "embed"), (8, 16, 32)) == P(("dp", "fsdp"), "cp",
                                                                          None)
    sp = _rules(sp=True, dp=4, tp=2)
    assert sp.activation_spec(("batch", "seq", "embed"), (8, 16, 32)) == P("dp", "tp", None)
    # heads claim tp first, so q/k/v keep their sequence whole on tp
    assert sp.activation_spec(("batch", "seq", "q_heads", "head_dim"),
                              (8, 16, 4, 8)) == P("dp", None, "tp", None)
    assert sp.activation_spec(("batch", "seq", "vocab"), (8, 16, 258)) == P("dp", None, "tp")
    with pytest.raises(ValueError, match="unknown logical axes.*'hidden'"):
        r.activation_spec(("batch", "hidden"), (8, 4))


def test_plan_rejects_bad_layouts():
    from jaxllm.train.trainer import sharding_plan
    small = worker.SMALL
    with pytest.raises(ConfigError, match="batch_size=4 is not divisible.*= 8"):
        sharding_plan(load_config(None, small + ["train.batch_size=4"]))
    with pytest.raises(ConfigError, match="microbatches=1 must be >= parallelism.pp=2"):
        sharding_plan(load_config(None, small + ["parallelism.pp=2", "parallelism.dp=4"]))
    with pytest.raises(ValueError, match="divisible by 2 x cp = 8"):
        sharding_plan(load_config(None, small + ["parallelism.cp=4", "parallelism.dp=2",
                                                 "train.seq_len=12"]))
    with pytest.raises(ConfigError, match="attention_impl='cudnn'"):
        sharding_plan(load_config(None, small + ["parallelism.cp=2", "parallelism.dp=4",
                                                 "model.attention_impl=cudnn"]))


def test_constrain_is_a_noop_without_context():
    x = jnp.ones((2, 4, 8))
    assert constrain(x, ("batch", "seq", "embed")) is x


# ------------------------------------------------------------- layouts vs one device


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    run(WORKER, "all", out, timeout=1200)
    return out, json.loads((out / "results.json").read_text())


def _assert_same_training(results, out, name, npz):
    base, got = results["single"], results[name]
    assert "error" not in got, got["error"]
    np.testing.assert_allclose(got["losses"], base["losses"], rtol=2e-6)
    np.testing.assert_allclose(got["grad_norms"], base["grad_norms"], rtol=1e-5)
    want, have = np.load(out / "single.npz"), np.load(npz)
    assert set(want) == set(have)
    for key in want:  # params and Adam moments (linear in the gradients) after the steps
        scale = np.abs(want[key]).max() + 1e-30
        np.testing.assert_allclose(have[key] / scale, want[key] / scale, atol=2e-5, err_msg=key)


@pytest.mark.parametrize("name", list(worker.LAYOUTS))
def test_layout_trains_like_one_device(trained, name):
    out, results = trained
    _assert_same_training(results, out, name, out / f"{name}.npz")


def test_context_parallel_attention_in_sequence_order(trained):
    """Ring attention outside the balanced region (MTP modules) over cp=4 x tp=2 with one
    KV head, forward and gradients vs the reference (the layouts cover both impls in the
    balanced order)."""
    errors = trained[1]["cp_attention"]
    assert errors["value"] < 1e-5 and errors["grads"] < 1e-5, errors


def test_sharded_init_equals_single_device_init(trained):
    assert trained[1]["sharded_init_max_diff"] == 0.0


@pytest.mark.parametrize("model", ["tiny", "larger"])
def test_zero_memory_follows_formula(trained, model):
    """Per device, params + Adam bytes in the compiled step's arguments match the formula
    (f32: 4 + 8 bytes per parameter, the Adam part / N from stage 1, params / N at 3)."""
    mem = trained[1]["memory"]
    stages = [mem[f"{model}_zero{s}"] for s in range(4)]
    for s, m in enumerate(stages):
        assert "error" not in m, m["error"]
        formula = m["formula_params"] + m["formula_opt_state"]
        assert abs(m["states"] / formula - 1) < 0.10, (s, m)
    psi, n = stages[0]["n_params"], 8
    expect = [12 * psi, 4 * psi + 8 * psi / n, 4 * psi + 8 * psi / n, 12 * psi / n]
    for s, (m, e) in enumerate(zip(stages, expect)):
        assert abs(m["formula_params"] + m["formula_opt_state"] - e) < 0.01 * e, s
    if model == "larger":  # where gradients, not activations, dominate the temporaries
        # ZeRO-2 reduce-scatters the gradients: its temporaries shrink by at least half
        # the gradient bytes it saves over ZeRO-1.
        saved = stages[1]["formula_grads"] - stages[2]["formula_grads"]
        assert stages[1]["temp"] - stages[2]["temp"] > 0.5 * saved


def test_two_hosts_train_like_one_device(trained, tmp_path):
    out, results = trained
    two_hosts(WORKER, tmp_path, timeout=600)
    got = json.loads((tmp_path / "multihost.json").read_text())
    hosts = np.array(got["hosts"])  # mesh-shaped process indices: tp pairs share a host
    assert hosts.shape == (1, 2, 2, 1, 1, 2) and (hosts[..., 0] == hosts[..., 1]).all()
    assert set(hosts.flat) == {0, 1}
    _assert_same_training({**results, "multihost": got}, out, "multihost",
                          tmp_path / "multihost.npz")


def test_dry_run_prints_layouts_and_memory():
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", "--config", "configs/tiny.yaml",
                        "--dry-run", "parallelism.dp=2", "parallelism.fsdp=2", "parallelism.tp=2",
                        "train.zero_stage=1", "train.batch_size=8"],
                       env=env(8), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "mesh pp=1 x dp=2 x fsdp=2 x ep=1 x cp=1 x tp=2 (8 x cpu); ZeRO stage 1" in out
    q = next(line for line in out.splitlines() if line.startswith("blocks.attn.q.kernel"))
    assert "(-, fsdp, tp, -)" in q and "(4, 64, 2, 32)" in q and "(-, dp+fsdp, tp, -)" in q
    ratio = float(out.split("ratio ")[1].split(")")[0])
    assert abs(ratio - 1) < 0.10
    planned = float(out.split("planned / compiled ")[1].split()[0])  # jaxllm.plan's figure
    assert abs(planned - 1) < 0.05


def test_sharding_benchmark_runs_on_cpu():
    """benchmarks/sharding.py (1 GPU vs fsdp=2 vs tp=2) end to end on a tiny model."""
    r = subprocess.run([sys.executable, "benchmarks/sharding.py", "--quick", "--steps", "1",
                        "--batch", "4"], env=env(8), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split(" | ") for l in r.stdout.splitlines() if l.startswith("| ") and "---" not in l]
    assert [row[0] for row in rows[1:]] == ["| single", "| fsdp2", "| tp2"]
    assert rows[1][5] == "1.00x" and all(float(row[4].replace(",", "")) > 0 for row in rows[1:])
    # tp=2 runs the single GPU's batch: the same first loss
    assert rows[1][9].split(" -> ")[0] == rows[3][9].split(" -> ")[0]
