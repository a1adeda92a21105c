"""Training throughput (tokens/s, MFU) and decode speed (TTFT, TPOT, % of HBM roofline).

    PYTHONPATH=. python benchmarks/train_and_decode.py [--config configs/llama_1b.yaml]
        [--steps 200] [--variants cudnn:none:16,pallas_triton:none:16] [--decode-batches 1,32]

Training runs the real trainer (`jaxllm.train.trainer.train`) on the embedded corpus with
checkpoints off and reports the median tokens/s of the logged intervals after the first
two (compilation excluded). Decoding times `generate_ids` (prefill + on-device decode
chunks) with a prompt of --prompt-len tokens and --new-tokens generated tokens, greedy,
no EOS stop. The HBM roofline of a decode step is the bytes it must read: every
non-embedding weight plus the output head in the compute dtype, plus the live K/V of every
sequence; its time at the datasheet bandwidth (4.8 TB/s on the H200) is the floor.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import load_config
from jaxllm.inference.decode import generate_ids, inference_params
from jaxllm.model import build_model
from jaxllm.train.trainer import device_peak_flops, train

HBM_DATASHEET = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def hbm_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((bw for name, bw in HBM_DATASHEET.items() if name in kind), None)


def bench_train(config: str, impl: str, remat: str, batch: int, steps: int,
                overrides=()) -> dict:
    run_dir = tempfile.mkdtemp(prefix="bench_train_")
    cfg = load_config(config, list(overrides) + [f"model.attention_impl={impl}", f"model.remat={remat}",
                               f"train.batch_size={batch}", f"train.steps={steps}",
                               "train.log_every=10", f"train.eval_every={10 * steps}",
                               "train.progress=false", "checkpoint.enabled=false",
                               f"train.run_dir={run_dir}"])
    t0 = time.perf_counter()
    summary = train(cfg, resume=False)
    wall = time.perf_counter() - t0
    recs = [json.loads(l) for l in open(Path(run_dir) / "metrics.jsonl")]
    steady = recs[2:] or recs[-1:]
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    peak = device_peak_flops()
    mfu = tps * cfg.model.flops_per_token(cfg.train.seq_len) / peak if peak else float("nan")
    return {"impl": impl, "remat": remat, "batch": batch, "steps": summary["step"],
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"], "tokens_per_s": tps,
            "mfu": mfu, "wall_s": wall}


LAYER_FORMS = {0: "stacked", 1: "per-layer", 2: "per-layer, fused"}


def bench_decode(config: str, batch: int, prompt_len: int, new_tokens: int, form: int,
                 chunk: int, overrides=(), overlap: bool = True) -> dict:
    cfg = load_config(config, list(overrides))
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = inference_params(model, cfg, unstack=form > 0, fuse=form > 1)
    del model
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, size=(batch, prompt_len)).tolist()
    _, t = generate_ids(graphdef, params, prompts, max_new_tokens=new_tokens, temperature=0.0,
                        eos_id=None, chunk=chunk, overlap=overlap)
    m = cfg.model
    weight_bytes = 2 * (m.num_params(embeddings=False) + m.vocab_size * m.d_model)
    ctx = prompt_len + new_tokens / 2  # mean live context during decoding
    kv_bytes = 2 * m.n_layers * ctx * m.n_kv_heads * m.resolved_head_dim * 2 * batch
    bw = hbm_bandwidth()
    floor = (weight_bytes + kv_bytes) / bw if bw else float("nan")
    return {"batch": batch, "layers": LAYER_FORMS[form], "overlap": overlap,
            "ttft_ms": 1e3 * t["ttft_s"], "tpot_ms": 1e3 * t["tpot_s"],
            "tokens_per_s": batch / t["tpot_s"], "roofline_pct": 100 * floor / t["tpot_s"],
            "compile_s": t["compile_s"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default="cudnn:none:16",
                    help="comma-separated impl:remat:batch training variants ('' for none)")
    ap.add_argument("--decode-batches", default="1,32")
    ap.add_argument("--unstack", default="0,2",
                    help="decode with stacked (0), per-layer (1) and/or per-layer weights "
                         "with q/k/v and gate/up joined (2)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--overlap", default="1",
                    help="queue the next decode chunk before reading the current one (1), "
                         "or dispatch it after (0); '0,1' times both")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.decode_impl=xla")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")

    train_rows, decode_rows = [], []
    for i, v in enumerate(filter(None, args.variants.split(","))):
        impl, remat, batch = v.split(":")
        steps = args.steps if i == 0 else min(args.steps, 60)
        row = bench_train(args.config, impl, remat, int(batch), steps, args.overrides)
        print("train", row, flush=True)
        train_rows.append(row)
    for b in filter(None, args.decode_batches.split(",")):
        for u in args.unstack.split(","):
            for o in args.overlap.split(","):
                row = bench_decode(args.config, int(b), args.prompt_len, args.new_tokens,
                                   int(u), args.chunk, args.overrides, overlap=bool(int(o)))
                print("decode", row, flush=True)
                decode_rows.append(row)

    if args.out:
        Path(args.out).write_text(json.dumps({"train": train_rows, "decode": decode_rows},
                                             indent=1))
    print("\n| training | batch | steps | loss first -> last | tokens/s | MFU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in train_rows:
        print(f"| {r['impl']}, remat {r['remat']} | {r['batch']} | {r['steps']} | "
              f"{r['loss_first']:.2f} -> {r['loss_last']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{100 * r['mfu']:.1f}% |")
    print("\n| decode batch | layers | chunks queued ahead | TTFT ms | TPOT ms | tokens/s | "
          "% HBM roofline |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in decode_rows:
        print(f"| {r['batch']} | {r['layers']} | {int(r['overlap'])} | {r['ttft_ms']:.1f} | "
              f"{r['tpot_ms']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['roofline_pct']:.0f}% |")


if __name__ == "__main__":
    main()
