"""Speculative decoding with MTP heads: tokens/s against plain decoding of the same model.

Trains a ~300M-parameter byte-level model with multi-token-prediction modules (d 1024,
24 layers, 16 heads, mlp 2816, mtp_depth 3) for a few minutes on the embedded corpus
with the real trainer, then decodes held-out prompts with plain decoding
(`generate.generate_ids`) and with MTP speculative decoding
(`speculative.speculative_generate_ids`, k = 1..mtp_depth drafts per step), greedy, at
batch 1, 8 and 32, plus one sampled row (temperature 0.8, k = mtp_depth) at batch 1.

tokens/s = generated tokens of all rows / wall time of prefill + decoding, the same
measure for both paths; every way of a (batch, temperature) is compiled first, then timed
in interleaved rounds (tokens/s: the median over rounds; speed-up: the median per-round
ratio to plain). `same` counts the rows whose greedy speculative output equals plain
decoding token for token (in bf16 a near-tie can resolve differently in a (k+1)-token
verify than in a 1-token step).

    PYTHONPATH=. python benchmarks/speculative.py [--rounds 3] [--json PATH]   # the GPU run
    # or train once, then decode different batches on two GPUs at the same time:
    PYTHONPATH=. python benchmarks/speculative.py --run-dir R --train-only
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. python benchmarks/speculative.py --run-dir R --batches 1
    CUDA_VISIBLE_DEVICES=1 PYTHONPATH=. python benchmarks/speculative.py --run-dir R --batches 8,32
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/speculative.py --quick   # smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import add_args, interleaved, print_table, speedup, write_json
from jaxllm.checkpoint import load_model
from jaxllm.config import load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.speculative import speculative_generate_ids
from jaxllm.tokenizer import load_tokenizer
from jaxllm.train import data as data_lib
from jaxllm.train.trainer import train

FULL = dict(model=["model.d_model=1024", "model.n_layers=24", "model.n_heads=16",
                   "model.n_kv_heads=16", "model.mlp_dim=2816", "model.mtp_depth=3",
                   "model.dtype=bfloat16", "model.remat=none", "model.max_seq_len=2048"],
            train=["train.batch_size=32", "train.seq_len=512", "train.lr=6e-4",
                   "train.warmup_steps=100", "train.log_every=50"],
            steps=1200, batches="1,8,32", prompt_len=128, new_tokens=256)
QUICK = dict(model=["model.d_model=64", "model.n_layers=1", "model.n_heads=2",
                    "model.n_kv_heads=2", "model.mlp_dim=128", "model.mtp_depth=1",
                    "model.remat=none"],
             train=["train.batch_size=8", "train.seq_len=64", "train.lr=3e-3",
                    "train.warmup_steps=2", "train.log_every=5", "train.eval_batches=1"],
             steps=10, batches="1", prompt_len=16, new_tokens=16)


def train_model(sizes: dict, steps: int, run_dir: str | None = None):
    """Train the benchmark model into run_dir, or load it if run_dir already holds it."""
    info_path = Path(run_dir) / "bench_train.json" if run_dir else None
    if info_path is not None and info_path.exists():
        model, cfg, _ = load_model(run_dir)
        return model, cfg, json.loads(info_path.read_text())
    run_dir = run_dir or tempfile.mkdtemp(prefix="bench_spec_")
    cfg = load_config(None, sizes["model"] + sizes["train"] + [
        f"train.steps={steps}", f"train.eval_every={steps}", "train.progress=false",
        f"train.run_dir={run_dir}", f"checkpoint.every={steps}", "checkpoint.keep=1"])
    t0 = time.perf_counter()
    summary = train(cfg, resume=False)
    recs = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    model, cfg, _ = load_model(run_dir)
    info = {"params_M": cfg.model.num_params() / 1e6, "steps": summary["step"],
            "train_s": time.perf_counter() - t0, "eval_loss": summary["eval_loss"],
            **{k: v for k, v in recs[-1].items() if k.startswith("mtp")}}
    (Path(run_dir) / "bench_train.json").write_text(json.dumps(info))
    return model, cfg, info


def held_out_prompts(cfg, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    val = data_lib.load_tokens(cfg.data, load_tokenizer(cfg.data.tokenizer)).val
    starts = np.random.default_rng(seed).integers(0, len(val) - length, batch)
    return [np.asarray(val[s:s + length]).astype(int).tolist() for s in starts]


def compare(ways: dict, rounds: int) -> dict:
    """ways: name -> a function generating once, returning (ids, timings). Each is run
    once (compilation), then all in interleaved rounds. -> name -> (ids of the last
    round, timings of the last round, seconds per generated token per round)."""
    last = {}

    def timer(name):
        def once():
            last[name] = ways[name]()
            return 1 / last[name][1]["tokens_per_s"]
        return once
    for fn in ways.values():
        fn()
    samples = interleaved({name: timer(name) for name in ways}, rounds)
    return {name: (*last[name], samples[name]) for name in ways}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, a few steps (CPU)")
    ap.add_argument("--steps", type=int, default=None, help="training steps")
    ap.add_argument("--batches", default=None, help="comma-separated decode batch sizes")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--run-dir", default=None,
                    help="train into this directory, or reuse the model already trained there")
    ap.add_argument("--train-only", action="store_true", help="stop after training")
    ap.add_argument("--ks", default=None, help="comma-separated draft lengths (default 1..depth "
                    "at batch 1, 1 and depth above)")
    ap.add_argument("--no-sampled", action="store_true", help="skip the T=0.8 rows")
    args = add_args(ap, rounds=3).parse_args()
    sizes = QUICK if args.quick else FULL
    steps = args.steps or sizes["steps"]
    new = args.new_tokens or sizes["new_tokens"]
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}",
          flush=True)

    model, cfg, info = train_model(sizes, steps, args.run_dir)
    print("trained", json.dumps(info), flush=True)
    if args.train_only:
        return
    params = decode_params(model, cfg)
    del model
    depth = cfg.model.mtp_depth
    rows = []
    for b in [int(x) for x in (args.batches or sizes["batches"]).split(",")]:
        prompts = held_out_prompts(cfg, b, sizes["prompt_len"])
        ks = range(1, depth + 1) if b == 1 else sorted({1, depth})
        if args.ks:
            ks = [int(x) for x in args.ks.split(",")]
        sampled = b == 1 and not args.no_sampled
        for temperature in ([0.0, 0.8] if sampled else [0.0]):
            opts = dict(max_new_tokens=new, temperature=temperature, eos_id=None, seed=0)
            ways = {0: lambda: generate_ids(params, prompts, chunk=32, warmup=False, **opts)}
            for k in (ks if temperature == 0 else [max(ks)]):
                ways[k] = (lambda k: lambda: speculative_generate_ids(
                    params, prompts, method="mtp", k=k, **opts))(k)
            got = compare(ways, args.rounds)
            plain_ids, _, plain = got[0]
            for k, (ids, t, ts) in got.items():
                rows.append({
                    "batch": b, "temperature": temperature, "method": "mtp" if k else "plain",
                    "k": k, "tokens_per_s": 1 / statistics.median(ts),
                    "speedup": speedup(plain, ts),
                    "acceptance_length": t.get("mean_acceptance_length", 1.0),
                    "acceptance_rate_per_position": t.get("acceptance_rate_per_position"),
                    "same": (sum(a == p for a, p in zip(ids, plain_ids))
                             if k and temperature == 0 else None)})
                print(rows[-1], flush=True)

    write_json(args.json, rows, train=info)
    table = []
    for r in rows:
        name = f"MTP k={r['k']}" if r["k"] else "plain"
        rates = " ".join(f"{x:.2f}" for x in r["acceptance_rate_per_position"] or [])
        table.append({"batch": r["batch"],
                      "decoding": name + (f" (T={r['temperature']})" if r["temperature"] else ""),
                      "tokens/s": r["tokens_per_s"], "speed-up": f"{r['speedup']:.2f}x",
                      "tokens/step": r["acceptance_length"],
                      "accepted by position": rates or None,
                      "same as plain": None if r["same"] is None else f"{r['same']}/{r['batch']}"})
    print_table(table, title=(
        f"model {info['params_M']:.1f}M parameters, mtp_depth {depth}, {info['steps']} steps in "
        f"{info['train_s']:.0f} s, eval loss {info['eval_loss']:.3f}, "
        + ", ".join(f"{k} {v:.3f}" for k, v in info.items() if k.startswith("mtp"))
        + f"; greedy unless noted, {new} new tokens per row, {args.rounds} interleaved rounds"))


if __name__ == "__main__":
    main()
