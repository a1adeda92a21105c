"""python -m jaxllm.train --config configs/tiny.yaml [section.key=value ...]"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxllm.train",
                                 description="Train a jaxllm model from a YAML config.")
    ap.add_argument("--config", required=True, help="YAML config file or a run directory")
    ap.add_argument("--no-resume", action="store_true",
                    help="refuse to resume: fail if the run directory holds checkpoints")
    ap.add_argument("--step", type=int, default=None,
                    help="resume from this checkpoint step (default: the newest intact one); "
                         "later checkpoints are moved to RUN_DIR/set_aside/")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the mesh, every parameter's sharding and the compiled step's "
                         "per-device memory, then exit without training")
    ap.add_argument("--coordinator-address",
                    help="multi-host: host:port of process 0 (else JAX_COORDINATOR_ADDRESS)")
    ap.add_argument("--num-processes", type=int,
                    help="multi-host: number of processes (else JAX_NUM_PROCESSES)")
    ap.add_argument("--process-id", type=int,
                    help="multi-host: this process's index (else JAX_PROCESS_ID)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from jaxllm.config import load_config
    from jaxllm.sharding import initialize_distributed
    from jaxllm.train.trainer import NonFiniteLoss, dry_run, train

    try:
        cfg = load_config(args.config, args.overrides)
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
        if args.dry_run:
            print(dry_run(cfg))
            return 0
        summary = train(cfg, resume=not args.no_resume, from_step=args.step)
    except (ValueError, NonFiniteLoss, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eval_loss = summary["eval_loss"]
    print(f"done: step {summary['step']}, loss {summary['loss']:.4f}"
          + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
          + f"; run directory {summary['run_dir']}")
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
