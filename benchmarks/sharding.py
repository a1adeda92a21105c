"""Training throughput per GPU under sharding: one GPU vs FSDP and TP over two, in one run.

    PYTHONPATH=. python benchmarks/sharding.py [--config configs/llama_1b.yaml] [--steps 10]
        [--rounds 3] [--batch 16] [--layouts single,fsdp2,tp2] [--json PATH] [overrides ...]

Every layout trains the same model with the real step (`train.trainer.make_train_fns`:
sharded init, jitted step with in/out shardings, donated state) on random tokens placed
before timing. `--batch` is the batch per data-parallel rank, so FSDP over two GPUs runs
2x that globally and TP one replica of `--batch` on two GPUs. All layouts are built
first (two warm-up steps each: compilation), then timed in interleaved rounds of --steps
steps each; the step time is the median over rounds of each round's median step.
Reported: tokens/s per GPU (global tokens/s / GPUs used), its ratio to the single GPU,
MFU per GPU, and the compiled step's per-device model-state and temporary memory.

On the CPU (tests, a smoke test) `--quick` shrinks the model and
XLA_FLAGS gives the devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu PYTHONPATH=. \
        python benchmarks/sharding.py --quick --steps 1 --batch 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.common import add_args, interleaved, print_table, write_json
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


def setup(config: str, name: str, batch: int, extra: list[str]):
    """(row of the layout's sizes and memory, losses, run(steps) -> median seconds per
    step); two steps already run (compilation, warm-up)."""
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
    state, losses = [params, opt_state], []

    def run(steps: int) -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            params, opt_state, metrics = fns.step(*state, batches[len(losses) % len(batches)])
            state[:] = params, opt_state
            losses.append(float(metrics["loss"]))  # synchronises
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    run(2)
    row = {"layout": name, "devices": n_dev, "global_batch": t.batch_size,
           "tokens_per_step": t.batch_size * t.seq_len,
           "flops_per_token": cfg.model.flops_per_token(t.seq_len),
           "states_gb": mem["states"] / 1e9, "temp_gb": mem["temp"] / 1e9}
    return row, losses, run


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per layout and round")
    ap.add_argument("--batch", type=int, default=16, help="sequences per data-parallel rank")
    ap.add_argument("--layouts", default="single,fsdp2,tp2")
    ap.add_argument("--quick", action="store_true", help="a tiny f32 model (the CPU)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.remat=full")
    args = add_args(ap, rounds=3).parse_args(argv)
    extra = (TINY if args.quick else []) + args.overrides
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"config {args.config} {' '.join(extra)}", flush=True)
    layouts = {name: setup(args.config, name, args.batch, extra)
               for name in args.layouts.split(",")}
    samples = interleaved({name: (lambda run: lambda: run(args.steps))(run)
                           for name, (_, _, run) in layouts.items()}, args.rounds)
    peak = device_peak_flops()
    peak_one = peak / jax.device_count() if peak else None
    rows = []
    for name, (row, losses, _) in layouts.items():
        step_s = statistics.median(samples[name])
        tps_gpu = row["tokens_per_step"] / step_s / row["devices"]
        rows.append({**row, "step_ms": 1e3 * step_s, "tokens_per_s_per_gpu": tps_gpu,
                     "mfu": tps_gpu * row["flops_per_token"] / peak_one if peak_one else None,
                     "loss_first": losses[0], "loss_last": losses[-1]})
    write_json(args.json, rows)
    base = next((r for r in rows if r["layout"] == "single"), None)
    print_table([{
        "layout": r["layout"], "GPUs": r["devices"], "global batch": r["global_batch"],
        "step ms": r["step_ms"], "tokens/s per GPU": r["tokens_per_s_per_gpu"],
        "vs 1 GPU": f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x"
        if base else None,
        "MFU": f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else None,
        "states GB/GPU": r["states_gb"], "temp GB/GPU": r["temp_gb"],
        "loss first -> last": f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}"} for r in rows],
        title=f"sharding, {args.config}, {args.rounds} interleaved rounds of {args.steps} steps",
        markdown=True)
    return rows


if __name__ == "__main__":
    main()
