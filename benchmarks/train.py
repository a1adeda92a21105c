"""Training throughput: tokens/s and MFU of the trainer's loop for a config.

    PYTHONPATH=. python benchmarks/train.py [--config configs/llama_1b.yaml] [--steps 80]
        [--batch 16] [--attention cudnn,pallas_mosaic] [--remat none,dots] [--json PATH]
        [config overrides ...]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/train.py --quick     # smoke test

Every variant (each --attention impl with each --remat policy; default: the config's)
runs the loop `python -m jaxllm.train` runs (`train.trainer.train`) on the embedded
corpus for --steps steps, checkpoints off, logging every --log-every steps. tokens/s is
the median over the logged intervals after the first two (compilation and warm-up left
out); MFU = tokens/s x the model's training FLOPs per token / the devices' peak bf16
FLOP/s (none on the CPU). Variants run one after the other, each in a fresh run directory.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import add_args, fill_defaults, print_table, write_json
from jaxllm import load_config
from jaxllm.train.trainer import device_peak_flops, train

FULL = dict(config="configs/llama_1b.yaml", steps=80, log_every=10)
QUICK = dict(config="configs/tiny.yaml", steps=8, log_every=2, batch=4)
QUICK_OVERRIDES = ["model.n_layers=2", "train.seq_len=64", "train.eval_batches=1"]


def bench(config: str, overrides: list[str], steps: int, log_every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_train_") as run_dir:
        cfg = load_config(config, overrides + [
            f"train.steps={steps}", f"train.log_every={log_every}",
            f"train.eval_every={steps}", "train.progress=false", "checkpoint.enabled=false",
            f"train.run_dir={run_dir}"])
        train(cfg, resume=False)
        recs = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    tps = statistics.median(r["tokens_per_s"] for r in (recs[2:] or recs[-1:]))
    peak = device_peak_flops()
    t, m = cfg.train, cfg.model
    return {"attention": m.attention_impl, "remat": m.remat, "batch": t.batch_size,
            "seq_len": t.seq_len, "steps": recs[-1]["step"],
            "loss first": recs[0]["loss"], "loss last": recs[-1]["loss"],
            "step ms": 1e3 * t.batch_size * t.seq_len / tps, "tokens/s": tps,
            "MFU %": 100 * tps * m.flops_per_token(t.seq_len) / peak if peak else None}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="configs/tiny.yaml, a few steps (the CPU)")
    ap.add_argument("--config", help=f"default {FULL['config']}")
    ap.add_argument("--steps", type=int, help=f"steps per variant (default {FULL['steps']})")
    ap.add_argument("--log-every", type=int, help=f"steps per timed interval "
                                                   f"(default {FULL['log_every']})")
    ap.add_argument("--batch", type=int, help="train.batch_size (default: the config's)")
    ap.add_argument("--attention", help="comma-separated model.attention_impl values "
                                        "(default: the config's)")
    ap.add_argument("--remat", help="comma-separated model.remat values (default: the config's)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. train.seq_len=4096")
    args = add_args(ap, rounds=None).parse_args(argv)
    fill_defaults(args, FULL, QUICK, QUICK_OVERRIDES)
    base = args.overrides + ([f"train.batch_size={args.batch}"] if args.batch else [])
    attention = [f"model.attention_impl={a}" for a in args.attention.split(",")] \
        if args.attention else [None]
    remat = [f"model.remat={r}" for r in args.remat.split(",")] if args.remat else [None]
    rows = []
    for variant in itertools.product(attention, remat):
        rows.append(bench(args.config, base + [o for o in variant if o], args.steps,
                          args.log_every))
        print(rows[-1], flush=True)
    write_json(args.json, rows)
    print_table(rows, title=f"training, {args.config} {' '.join(base)}")
    return rows


if __name__ == "__main__":
    main()
