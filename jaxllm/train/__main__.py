"""python -m jaxllm.train --config configs/tiny.yaml [section.key=value ...]"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxllm.train",
                                 description="Train a jaxllm model from a YAML config.")
    ap.add_argument("--config", required=True, help="YAML config file or a run directory")
    ap.add_argument("--no-resume", action="store_true",
                    help="start fresh even if the run directory holds checkpoints")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    args = ap.parse_args(argv)

    from jaxllm.config import ConfigError, load_config
    from jaxllm.train.trainer import NonFiniteLoss, train

    try:
        cfg = load_config(args.config, args.overrides)
        summary = train(cfg, resume=not args.no_resume)
    except (ConfigError, NonFiniteLoss, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eval_loss = summary["eval_loss"]
    print(f"done: step {summary['step']}, loss {summary['loss']:.4f}"
          + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
          + f"; run directory {summary['run_dir']}")
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
