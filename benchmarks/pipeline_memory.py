"""Activation memory of the pipeline schedules: the compiled step's temporaries per device.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \
        python benchmarks/pipeline_memory.py [--pp 4] [--rows 1] [--schedules gpipe,1f1b]
        [overrides ...]

For each schedule and m = 4p, 8p, 16p microbatches of `--rows` sequences each (the batch
grows with m), compiles the real train step (`train.trainer.make_train_fns`) for abstract
inputs and prints `compiled.memory_analysis()`'s temp bytes per device. GPipe keeps every
microbatch's stage input until the backward, so its temporaries grow with m; 1F1B keeps
at most p, so they stay level. Nothing is allocated or run; on a GPU pass
`JAX_PLATFORMS=cuda` and a larger model through the overrides.
"""
from __future__ import annotations

import argparse

import jax

from benchmarks.common import print_table
from jaxllm.config import load_config
from jaxllm.train.trainer import make_train_fns, sharding_plan

MODEL = ["model.d_model=256", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
         "model.mlp_dim=768", "model.vocab_size=258", "model.remat=full", "train.seq_len=256"]


def temp_bytes(overrides) -> int:
    cfg = load_config(None, overrides)
    plan = sharding_plan(cfg)
    fns = make_train_fns(cfg, plan.graphdef, plan)
    compiled = fns.step.lower(plan.abstract_params(), plan.abstract_opt_state(fns.tx),
                              plan.abstract_batch()).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table for the docs")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    p = args.pp
    dp = jax.device_count() // p
    ms = [4 * p, 8 * p, 16 * p]
    rows = []
    for kind in args.schedules.split(","):
        temps = []
        for m in ms:
            temps.append(temp_bytes(MODEL + [
                f"parallelism.pp={p}", f"parallelism.dp={dp}",
                f"parallelism.pp_schedule={kind}", f"train.microbatches={m}",
                f"train.batch_size={m * args.rows * dp}"] + args.overrides))
        rows.append({"schedule": kind, **{f"m={m}": f"{t / 2**20:,.1f}"
                                          for m, t in zip(ms, temps)},
                     f"m={ms[-1]} / m={ms[0]}": f"{temps[-1] / temps[0]:.2f}x"})
    print_table(rows, title=f"temp MB per device, pp={p}, dp={dp}, {args.rows} sequence(s) "
                            f"per microbatch", markdown=args.markdown)


if __name__ == "__main__":
    main()
