"""Training throughput per GPU under sharding: one GPU vs FSDP and TP over two, in one run.

    PYTHONPATH=. python benchmarks/sharding.py [--config configs/llama_1b.yaml] [--steps 30]
        [--batch 16] [--layouts single,fsdp2,tp2]

Every layout trains the same model with the real step (`train.trainer.make_train_fns`:
sharded init, jitted step with in/out shardings, donated state) on random tokens placed
before timing. `--batch` is the batch per data-parallel rank, so FSDP over two GPUs runs
2x that globally and TP one replica of `--batch` on two GPUs. Reported: tokens/s per GPU
(global tokens/s / GPUs used), its ratio to the single GPU, MFU per GPU, and the compiled
step's per-device model-state and temporary memory. Steady state: the median of --steps
timed steps after two warm-up steps (compilation).

On the CPU (tests): `--tiny` shrinks the model; XLA_FLAGS=--xla_force_host_platform_device_count
gives the devices.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxllm.config import load_config
from jaxllm.sharding.memory import step_memory
from jaxllm.train.trainer import device_peak_flops, init_state, sharding_plan

# name -> (devices, parallelism overrides, data-parallel ranks)
LAYOUTS = {
    "single": (1, ["parallelism.dp=1"], 1),
    "dp2": (2, ["parallelism.dp=2"], 2),
    "fsdp2": (2, ["parallelism.dp=1", "parallelism.fsdp=2"], 2),
    "tp2": (2, ["parallelism.dp=1", "parallelism.tp=2"], 1),
    "tp2_seqpar": (2, ["parallelism.dp=1", "parallelism.tp=2",
                       "parallelism.sequence_parallel=true"], 1),
}
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.mlp_dim=128", "model.vocab_size=512", "model.dtype=float32",
        "model.attention_impl=reference", "train.seq_len=64"]


def bench(config: str, name: str, batch: int, steps: int, extra: list[str]) -> dict:
    n_dev, overrides, ranks = LAYOUTS[name]
    if jax.device_count() < n_dev:
        raise SystemExit(f"layout {name} needs {n_dev} devices; {jax.device_count()} present")
    cfg = load_config(config, extra + overrides + [f"train.batch_size={batch * ranks}"])
    plan = sharding_plan(cfg, jax.devices()[:n_dev])
    _, params, opt_state, fns = init_state(cfg, plan)
    mem = step_memory(fns.step, plan, fns.tx)
    t = cfg.train
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        rows = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), np.int32)
        batches.append(plan.place_batch({"inputs": rows[:, :-1], "targets": rows[:, 1:]}))
    times, losses = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        params, opt_state, metrics = fns.step(params, opt_state, batches[i % len(batches)])
        losses.append(float(metrics["loss"]))  # synchronises
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[2:])
    tps_gpu = t.batch_size * t.seq_len / step_s / n_dev
    peak = device_peak_flops()
    peak_one = peak / jax.device_count() if peak else None
    return {"layout": name, "devices": n_dev, "global_batch": t.batch_size,
            "step_ms": 1e3 * step_s, "tokens_per_s_per_gpu": tps_gpu,
            "mfu": tps_gpu * cfg.model.flops_per_token(t.seq_len) / peak_one if peak_one else None,
            "states_gb": mem["states"] / 1e9, "temp_gb": mem["temp"] / 1e9,
            "loss_first": losses[0], "loss_last": losses[-1]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="sequences per data-parallel rank")
    ap.add_argument("--layouts", default="single,fsdp2,tp2")
    ap.add_argument("--tiny", action="store_true", help="a tiny f32 model (CPU tests)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.remat=full")
    args = ap.parse_args(argv)
    extra = (TINY if args.tiny else []) + args.overrides
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"config {args.config} {' '.join(extra)}", flush=True)
    rows = []
    for name in args.layouts.split(","):
        rows.append(bench(args.config, name, args.batch, args.steps, extra))
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["layout"] == "single"), None)
    print("\n| layout | GPUs | global batch | step ms | tokens/s per GPU | vs 1 GPU | MFU | "
          "states GB/GPU | temp GB/GPU | loss first -> last |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"| {r['layout']} | {r['devices']} | {r['global_batch']} | {r['step_ms']:.1f} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {ratio} | {mfu} | {r['states_gb']:.2f} | "
              f"{r['temp_gb']:.2f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
