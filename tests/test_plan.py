"""The hardware planner: memory against the compiler, the analytic figures, the CLI.

The key check compiles the train step on 8 CPU devices for a few of
`benchmarks/plan_check.py`'s layouts (the full sweep is that script's `--cpu` mode; it
is too slow for the suite) and wants the planned peak bytes per device within 5% of
what XLA allocates.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.config import load_config
from jaxllm.plan import get_hardware, plan, render
from jaxllm.plan.comm import ring_seconds
from jaxllm.plan.hardware import save_measured
from jaxllm.plan.memory import kv_bytes_per_token, state_bytes
from jaxllm.sharding.rules import Rules

ROOT = Path(__file__).resolve().parents[1]
# MoE over ep x fsdp (a dense layer, then the experts' all-to-all) / a dense pipeline
# (1f1b) over dp at ZeRO-1 / MLA under full remat
CHECKED = ["moe_ep4_fsdp2", "pp2_dp4_z1", "mla_dp8_full"]


def test_planned_memory_matches_compiled_step():
    r = subprocess.run([sys.executable, "benchmarks/plan_check.py", "--cpu", "--configs",
                        *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.split() and l.split()[0] in CHECKED]
    assert [row[0] for row in rows] == CHECKED
    for row in rows:
        assert abs(float(row[3]) - 1) < 0.05, row


def test_states_follow_the_zero_formula():
    """Per device with f32 params and dp=8: 16Ψ, 8Ψ + 8Ψ/8 (Adam / N), 4Ψ + 12Ψ/8, 16Ψ/8."""
    cfg = load_config("configs/tiny.yaml")
    psi = 4 * cfg.model.num_params()
    sizes = (("pp", 1), ("dp", 8), ("fsdp", 1), ("ep", 1), ("cp", 1), ("tp", 1))
    for stage, want in enumerate([4 * psi, 2 * psi + 2 * psi / 8, psi + 3 * psi / 8,
                                  4 * psi / 8]):
        s = state_bytes(cfg, Rules(sizes, stage))
        assert abs(s.params + s.grads + s.opt_state - want) < 0.02 * want, stage


def test_inference_and_roofline_figures():
    cfg = load_config("configs/llama_1b.yaml")  # 16 layers, 8 kv heads of 128, bf16
    assert kv_bytes_per_token(cfg.model) == 2 * 16 * 8 * 128 * 2
    p = plan(cfg, "h100", 8, batches=[1, 64])
    hw = get_hardware("h100")
    weights = cfg.model.num_params() * 2
    assert p.tpot_s[1] == pytest.approx((weights + p.context * 65536) / hw.hbm_bw, rel=1e-6)
    assert p.decode[1].bound(hw) == "memory" and p.prefill.bound(hw) == "compute"
    assert p.tpot_s[64] > p.tpot_s[1] and p.max_batch == int(
        (0.8 * hw.hbm - weights) // 65536) // p.context
    assert p.train_flops.model_per_token == cfg.model.flops_per_token(cfg.train.seq_len)
    # ring formulas: an all-reduce moves twice an all-gather's bytes
    assert ring_seconds("all-reduce", 8e9, 8, 1e9) == 2 * ring_seconds("all-gather", 8e9, 8, 1e9)
    # 16 GPUs: fsdp spans two hosts (network), tp stays on NVLink
    p2 = plan(load_config("configs/llama_1b.yaml", ["parallelism.dp=1", "parallelism.fsdp=8",
                                                    "parallelism.tp=2"]), "h100", 16)
    links = {c.axis: c.link for c in p2.collectives}
    assert links["fsdp"] == "network" and links["tp"] == "nvlink"


def test_measured_ceilings_and_cli(tmp_path, capsys):
    from jaxllm.plan.__main__ import main
    path = tmp_path / "measured.yaml"
    save_measured(path, "h200", flops=7.78e14, hbm_bw=3.31e12)
    hw = get_hardware("h200", path)
    assert hw.flops == 7.78e14 and hw.hbm == get_hardware("h200").hbm and hw.measured
    assert main(["--config", "configs/llama_1b.yaml", "--measured", str(path), "--devices", "8",
                 "--batch", "1,8", "parallelism.tp=8"]) == 0
    out = capsys.readouterr().out
    assert "(measured ceilings)" in out and "tp=8" in out and "decode B=8" in out
    assert main(["--config", "configs/llama_1b.yaml", "--hardware", "tpu9"]) == 2
    assert "unknown" in capsys.readouterr().err
    with pytest.raises(ValueError, match="devices=0"):
        plan(load_config("configs/tiny.yaml"), "h200", 0)
    assert "training memory per device" in render(plan(load_config("configs/tiny.yaml"), "a100", 1))


def test_collectives_per_axis():
    """dp=2 x fsdp=2 x tp=2 at ZeRO-1: parameters gathered twice and gradients
    reduce-scattered over fsdp, gradients all-reduced and updated parameters gathered over
    dp, and two all-reduces of the [4, 2048, 2048] bf16 activations per layer each way."""
    cfg = load_config("configs/llama_1b.yaml", ["parallelism.dp=2", "parallelism.fsdp=2",
                                                "parallelism.tp=2", "train.zero_stage=1"])
    p = plan(cfg, "h200", 8)
    got = {(c.axis, c.op): c for c in p.collectives}
    assert set(got) == {("fsdp", "all-gather"), ("fsdp", "reduce-scatter"),
                        ("dp", "all-reduce"), ("dp", "all-gather"), ("tp", "all-reduce")}
    assert got["fsdp", "all-gather"].count == 2
    assert got["dp", "all-reduce"].bytes == pytest.approx(got["fsdp", "all-gather"].bytes / 2)
    tp = got["tp", "all-reduce"]
    assert tp.bytes == 4 * 2048 * 2048 * 2 and tp.count == 4 * 16
    assert tp.seconds == pytest.approx(64 * ring_seconds("all-reduce", tp.bytes, 2,
                                                         get_hardware("h200").nvlink_bw))
    assert p.step_exposed_s == pytest.approx(max(p.train.compute_s(p.hardware),
                                                 p.train.memory_s(p.hardware)) + p.comm_s)


def test_plots_are_written(tmp_path):
    from jaxllm.plan.__main__ import main
    assert main(["--config", "configs/tiny.yaml", "--devices", "1", "--plot",
                 str(tmp_path)]) == 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 3
    for png in pngs:  # a real PNG each, not an empty file
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
