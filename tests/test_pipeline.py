"""Pipeline parallelism: schedule tables, config errors, and every schedule vs one device.

The layouts train in one worker process (tests/pipeline_worker.py: 8 simulated CPU
devices, XLA backend optimisation off) and are compared with pp = 1 at the tolerances
of tests/test_sharding.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import pipeline_worker as worker
from jaxllm.config import ConfigError, load_config
from jaxllm.sharding.pipeline import Pipeline
from jaxllm.sharding.pipeline_schedule import BWD, FWD, IDLE, build, expected_bubble, slots
from processes import run, two_hosts
from test_sharding import _assert_same_training

WORKER = worker.__file__


# ----------------------------------------------------------------------------- tables


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 2, 1, 1), ("gpipe", 4, 7, 1),
                                        ("circular", 2, 4, 3), ("circular", 4, 8, 2),
                                        ("1f1b", 2, 5, 1), ("1f1b", 4, 4, 1),
                                        ("1f1b", 4, 13, 1), ("1f1b", 8, 16, 1)])
def test_schedule_table_is_complete_and_its_bubble_is_the_formula(kind, p, m, v):
    s = build(kind, p, m, v)
    assert s.bubble == pytest.approx(expected_bubble(kind, p, m, v), abs=1e-12)
    done = {}
    for t, row in enumerate(s.ops):
        for d, (op, mb, stage) in enumerate(row):
            if op == IDLE:
                continue
            assert stage % p == d and (op, mb, stage) not in done
            done[op, mb, stage] = t
    stages = p * v
    assert len(done) == 2 * m * stages  # every forward and backward exactly once
    for i in range(m):  # dependencies: forward in stage order, backward after, in reverse
        for st in range(stages):
            if st:
                assert done[FWD, i, st] > done[FWD, i, st - 1]
            later = done[BWD, i, st + 1] if st < stages - 1 else done[FWD, i, st]
            assert done[BWD, i, st] > later


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16), (4, 64)])
def test_1f1b_keeps_at_most_p_minus_d_microbatches_in_flight(p, m):
    ops = build("1f1b", p, m).ops
    for d in range(p):
        live = np.cumsum((ops[:, d, 0] == FWD).astype(int) - (ops[:, d, 0] == BWD))
        assert live.max() == p - d
    gpipe = build("gpipe", p, m).ops
    assert np.cumsum(gpipe[:, 0, 0] == FWD).max() == m  # gpipe holds all of them
    # the executed schedule's buffers: p slots of stage inputs, one of incoming cotangents
    cfg = load_config(None, [f"parallelism.pp={p}", f"train.microbatches={m}",
                             f"train.batch_size={m}"])
    assert slots(Pipeline(cfg, None, None, None).schedule) == (p, 1)


def test_dry_run_schedule_lines():
    """What `--dry-run` prints for pp > 1: the table per device and the counted bubble."""
    from jaxllm.sharding.pipeline import schedule_of
    cfg = load_config(None, ["parallelism.pp=4", "train.microbatches=8"])
    lines = schedule_of(cfg).describe().splitlines()
    assert lines[0] == ("pipeline 1f1b: pp=4 x 1 stage(s) per device, 8 microbatches, 22 ticks; "
                        "bubble 0.273 (formula 0.273)")
    assert lines[1].split()[2:7] == ["F0", "F1", "F2", "F3", "."]
    assert lines[4].split()[2:8] == [".", ".", ".", "F0", "B0", "F1"]


def _plan(*overrides):
    from jaxllm.train.trainer import sharding_plan
    return sharding_plan(load_config(None, worker.base.SMALL + worker.MODEL + list(overrides)))


@pytest.mark.parametrize("overrides,message", [
    (["parallelism.pp=2", "parallelism.pp_repeats=3", "parallelism.pp_schedule=circular",
      "train.microbatches=2"], r"n_layers=8 is not divisible by parallelism.pp=2 x "
                               r"parallelism.pp_repeats=3"),
    (["parallelism.pp=4", "parallelism.pp_schedule=circular", "train.microbatches=6"],
     r"microbatches=6 must be a multiple of parallelism.pp=4"),
    (["parallelism.pp=4", "parallelism.pp_schedule=1f1b", "train.microbatches=2"],
     r"microbatches=2 must be >= parallelism.pp=4"),
    (["parallelism.pp=2", "parallelism.pp_schedule=gpipe", "train.microbatches=3"],
     r"batch_size=8 is not divisible by train.microbatches=3"),
    (["parallelism.pp=2", "parallelism.dp=4", "train.microbatches=4"],
     r"microbatch of train.batch_size=8 / train.microbatches=4 rows is not divisible"),
    (["parallelism.pp=2", "parallelism.pp_repeats=2", "parallelism.pp_schedule=1f1b",
      "train.microbatches=2"], r"pp_repeats=2 .* needs parallelism.pp_schedule=circular"),
    (["parallelism.pp=2", "parallelism.cp=2", "train.microbatches=2", "train.batch_size=8"],
     r"parallelism.cp=2 with parallelism.pp=2 is not supported"),
    (["train.microbatches=2"], r"with parallelism.pp=1 leave them at 1"),
    (["parallelism.pp=2", "parallelism.pp_schedule=1f1b", "train.microbatches=2"]
     + worker.MOE + ["model.moe.balance=aux_loss"],
     r"model.moe.balance=aux_loss with parallelism.pp_schedule=1f1b is not supported"),
    (["parallelism.pp=4", "train.microbatches=4"] + worker.MOE,
     r"n_layers=3 - model.moe.dense_layers=1 = 2 MoE layers is not divisible by "
     r"parallelism.pp=4"),
])
def test_pipeline_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*overrides)


def test_pipeline_needs_a_stack_to_split():
    from flax import nnx

    from jaxllm.sharding import ShardingPlan
    from jaxllm.model.layers import RMSNorm
    cfg = load_config(None, worker.base.SMALL + ["parallelism.pp=2", "train.microbatches=2"])
    flat = lambda: RMSNorm(32, eps=1e-6, dtype="float32", param_dtype="float32",
                           rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="splits the model's `blocks` stack.*none"):
        ShardingPlan.create(cfg, flat)


def test_stack_split_over_pp_and_other_parameters_whole():
    plan = _plan("parallelism.pp=4", "parallelism.tp=2", "parallelism.dp=1",
                 "train.microbatches=4")
    q = plan.params["blocks"]["attn"]["q"]["kernel"]
    assert q.spec[:3] == ("pp", None, "tp") and q.shard_shape((8, 32, 4, 8))[0] == 2
    assert "pp" not in str(plan.params["embed"]["embedding"].spec)


# ------------------------------------------------------------- layouts vs one device


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    run(WORKER, out, timeout=1200)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("name", list(worker.LAYOUTS))
def test_pipeline_trains_like_one_device(trained, name):
    """Loss, gradient norm, parameters and Adam moments after a step equal pp = 1."""
    out, results = trained
    _assert_same_training(results, out, name, out / f"{name}.npz")


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_moe")
    run(WORKER, "moe", out, timeout=600)
    return out


@pytest.mark.parametrize("name", list(worker.MOE_LAYOUTS))
def test_moe_pipeline_trains_like_one_device(trained_moe, name):
    """An MoE model (a dense layer, then MoE layers of 4 experts, top-2) through the
    pipeline: loss, gradients and the state after a step equal pp = 1, and so do the
    balancing figures made of the stats leaving the pipeline (the max/mean expert load,
    router entropy and Switch aux loss; with balance=bias the expert_bias leaves, moved by
    the step's expert_load, are in the compared state)."""
    balance = "aux_loss" if "_aux_loss_" in name else "bias"
    out = trained_moe / balance
    results = json.loads((out / "results.json").read_text())
    _assert_same_training(results, out, name, out / f"{name}.npz")
    got, want = results[name], results["single"]
    for key in ("moe_load_max", "moe_entropy", "moe_aux_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)


@pytest.fixture(scope="module")
def trained_mtp(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_mtp")
    run(WORKER, "mtp", out, timeout=600)
    return out


def test_mtp_pipelines_train_like_one_device(trained_mtp):
    """Models with MTP modules (a dense one with 2, an MoE one with 1 MoE block) through
    the pipeline, the modules on the last stage: loss, gradients and the state after a
    step (the MTP parameters, and with balance=bias the MTP block's expert_bias, moved by
    its row of expert_load) equal pp = 1, and so do each depth's loss and accuracy and the
    MoE figures, which count the MTP block after the main layers. One test for all the
    layouts, so that test processes do not each repeat their worker run."""
    for name in worker.MTP_LAYOUTS:
        out = trained_mtp / name.split("_")[0]
        results = json.loads((out / "results.json").read_text())
        got, want = results[name], results["single"]
        depth = 2 if name.startswith("dense") else 1
        keys = [f"mtp{k}_{x}" for k in range(1, depth + 1) for x in ("loss", "acc")]
        keys += ["moe_load_max", "moe_entropy", "moe_aux_loss"] if "moe" in name else []
        try:
            _assert_same_training(results, out, name, out / f"{name}.npz")
            assert set(keys) <= set(want), sorted(want)
            for key in keys:
                np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None


def test_pipeline_across_two_hosts_trains_like_one_device(trained, tmp_path):
    """2 processes x 4 devices, pp across them (1f1b, with dp and tp inside each host)."""
    out, results = trained
    two_hosts(WORKER, tmp_path, timeout=600)
    got = json.loads((tmp_path / "multihost.json").read_text())
    hosts = np.array(got["hosts"])  # mesh-shaped (pp, dp, fsdp, ep, cp, tp)
    assert (hosts[0] == 0).all() and (hosts[1] == 1).all()
    _assert_same_training({**results, "multihost": got}, out, "multihost",
                          tmp_path / "multihost.npz")
