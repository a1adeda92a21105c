"""MoE load balancing: DeepSeek-V3's auxiliary-loss-free bias against the Switch aux loss.

    PYTHONPATH=. python benchmarks/moe_balance.py [--config configs/tiny_moe.yaml]
        [--steps 300] [--balance bias,aux_loss,none] [--json PATH] [config overrides ...]

Each balancing method trains the same model on the embedded corpus with the same data
and seed (`train.trainer.train`, checkpoints off) and the table gives, per method: the
first logged step at which the expert load's max/mean (the worst MoE layer's) is at most
1.2, max/mean at the end and averaged over the second half of the run, max/mean on the
validation batches at the end (their expert loads summed over the batches), the router's
entropy, the final training and validation loss. What to check: "bias" reaches
max/mean <= 1.2 (in training and on the validation batches) within a few hundred steps
and its validation loss is no worse than "aux_loss"'s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import add_args, print_table, write_json
from jaxllm import load_config
from jaxllm.train.trainer import train

BALANCED = 1.2  # max/mean expert load counted as balanced


def run(config: str, overrides: list[str], balance: str, steps: int, log_every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="moe_balance_") as run_dir:
        cfg = load_config(config, overrides + [
            f"model.moe.balance={balance}", f"train.steps={steps}",
            f"train.log_every={log_every}", f"train.eval_every={steps}",
            "train.progress=false", "checkpoint.enabled=false", f"train.run_dir={run_dir}"])
        train(cfg, resume=False)
        recs = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    loads = [r["moe_load_max"] for r in recs]
    reached = next((r["step"] for r in recs if r["moe_load_max"] <= BALANCED), None)
    return {"balance": balance, "steps": recs[-1]["step"],
            f"first step max/mean <= {BALANCED}": reached,
            "max/mean last": loads[-1],
            "max/mean 2nd half": statistics.mean(loads[len(loads) // 2:]),
            "max/mean val": recs[-1]["eval_moe_load_max"],
            "router entropy": recs[-1]["moe_entropy"], "aux loss": recs[-1]["moe_aux_loss"],
            "loss": recs[-1]["loss"], "eval loss": recs[-1]["eval_loss"],
            "tokens/s": statistics.median(r["tokens_per_s"] for r in recs[1:] or recs)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny_moe.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--balance", default="bias,aux_loss",
                    help="comma-separated model.moe.balance values")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. train.batch_size=16")
    args = add_args(ap, rounds=None).parse_args(argv)
    rows = []
    for balance in args.balance.split(","):
        rows.append(run(args.config, args.overrides, balance, args.steps, args.log_every))
        print(rows[-1], flush=True)
    write_json(args.json, rows)
    print_table(rows, title=f"MoE balancing, {args.config} {' '.join(args.overrides)}")
    return rows


if __name__ == "__main__":
    main()
