"""python -m jaxllm.plan --config X [--hardware NAME] [--devices N] [--measured FILE]
[--plot DIR] [--batch B,B,...] [--prompt-len S] [section.key=value ...]"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from jaxllm.plan.hardware import HARDWARE
    ap = argparse.ArgumentParser(prog="python -m jaxllm.plan",
                                 description="Memory, FLOPs, roofline times and communication "
                                             "of a config on a given machine, without a GPU.")
    ap.add_argument("--config", required=True, help="YAML config file or a run directory")
    ap.add_argument("--hardware", default="h200", help=f"one of {sorted(HARDWARE)}")
    ap.add_argument("--devices", type=int, default=8, help="GPUs in all (8 per host)")
    ap.add_argument("--measured", help="YAML/JSON file of measured ceilings (flops, hbm_bw, ...)")
    ap.add_argument("--plot", metavar="DIR", help="write the figures as PNGs into DIR")
    ap.add_argument("--batch", default="1,32,64",
                    help="decode batch sizes for TPOT, comma-separated (default 1,32,64)")
    ap.add_argument("--microbatches", type=int,
                    help="microbatches per step (pipeline parallelism; default "
                         "train.microbatches, else 1)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens for TTFT (default train.seq_len)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallelism.tp=8")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxllm.config import load_config
    from jaxllm.plan.report import plan, render
    try:
        cfg = load_config(args.config, args.overrides)
        try:
            batches = [int(b) for b in args.batch.split(",")]
        except ValueError:
            raise ValueError(f"--batch {args.batch!r} must be comma-separated integers, "
                             f"e.g. 1,32,64") from None
        p = plan(cfg, args.hardware, args.devices, measured=args.measured, batches=batches,
                 prompt_len=args.prompt_len, microbatches=args.microbatches)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(p))
    if args.plot:
        from jaxllm.plan.plot import plot_all
        for path in plot_all(p, args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
