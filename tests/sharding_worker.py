"""Runs the sharded training layouts for tests/test_sharding.py in a fresh process.

    python tests/sharding_worker.py all OUT                 # every layout + memory figures
    python tests/sharding_worker.py multihost OUT PID PORT  # one of 2 processes, 4 devices each

Its own process so that XLA compiles without backend optimisation (3x faster compiles
on the CPU; the numbers are the same to float tolerance) and, for multihost, so that each
process owns 4 CPU devices. Writes results.json (losses per layout, errors) and one .npz of
gradients per layout into OUT.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import processes

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.mlp_dim=64", "model.remat=none", "train.batch_size=8", "train.seq_len=16",
         "train.lr=3e-3", "train.warmup_steps=1", "train.steps=10"]
STEPS = 3

LAYOUTS = {
    "dp8": ["parallelism.dp=8"],
    "fsdp8": ["parallelism.dp=1", "parallelism.fsdp=8"],
    "zero1_dp8": ["parallelism.dp=8", "train.zero_stage=1"],
    "zero2_dp8": ["parallelism.dp=8", "train.zero_stage=2"],
    "zero3_dp8": ["parallelism.dp=8", "train.zero_stage=3"],
    "tp2_fsdp4": ["parallelism.dp=1", "parallelism.fsdp=4", "parallelism.tp=2"],
    "tp2_dp4_seqpar": ["parallelism.dp=4", "parallelism.tp=2",
                       "parallelism.sequence_parallel=true"],
    "cp4_fsdp2_ring": ["parallelism.dp=1", "parallelism.fsdp=2", "parallelism.cp=4"],
    "cp4_fsdp2_allgather": ["parallelism.dp=1", "parallelism.fsdp=2", "parallelism.cp=4",
                            "parallelism.cp_impl=allgather"],
    "dp2_fsdp2_tp2": ["parallelism.dp=2", "parallelism.fsdp=2", "parallelism.tp=2"],
}
MULTIHOST = LAYOUTS["dp2_fsdp2_tp2"]

# ZeRO memory check: stages 0-3 with dp=8, on the layouts' tiny model (from their compiled
# steps) and on a larger model (~21M parameters, compile only).
ZERO_LAYOUTS = {"dp8": 0, "zero1_dp8": 1, "zero2_dp8": 2, "zero3_dp8": 3}
LARGER = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
          "model.mlp_dim=1536", "model.vocab_size=8192", "model.remat=full",
          "train.batch_size=8", "train.seq_len=64"]


def batches(seed: int = 0):
    """STEPS random token batches [8, 17]."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 258, size=(8, 17)).astype(np.int32) for _ in range(STEPS)]


def run_layout(overrides, devices=None, host_params=None, rows=slice(None)):
    """Train STEPS steps. Returns (record, flat state, plan).

    record: per-step loss and gradient norm; flat state: every leaf of the parameters and
    of the optimizer state after the steps. Adam's first moment is then a fixed linear
    combination of each step's (clipped) gradients and its second moment one of their
    squares, so equal states mean equal gradients, with no extra compile.
    """
    import jax
    import numpy as np

    from jaxllm.config import load_config
    from jaxllm.train.trainer import init_state, make_train_fns, sharding_plan

    cfg = load_config(None, SMALL + overrides)
    plan = sharding_plan(cfg, devices)
    if host_params is None:
        graphdef, params, opt_state, fns = init_state(cfg, plan)
    else:  # same initial values, placed in this layout (saves an init compile per layout)
        graphdef, params = plan.graphdef, jax.device_put(host_params, plan.params)
        fns = make_train_fns(cfg, graphdef, plan)
        opt_state = plan.init_opt_state(fns.tx, params)
    record = {"losses": [], "grad_norms": []}
    for b in batches()[:STEPS]:
        batch = plan.place_batch({"inputs": b[rows, :-1], "targets": b[rows, 1:]})
        params, opt_state, metrics = fns.step(params, opt_state, batch)
        record["losses"].append(float(metrics["loss"]))
        record["grad_norms"].append(float(metrics["grad_norm"]))
        for k in sorted(k for k in metrics if k.startswith(("moe_", "mtp"))):  # MoE, MTP
            record.setdefault(k, []).append(float(metrics[k]))
    state = processes.fetch({"params": params, "opt_state": opt_state})
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    return record, flat, plan


def run_all(out: Path):
    import jax
    import numpy as np

    from jaxllm.config import load_config
    from jaxllm.train.trainer import sharding_plan

    results = {"memory": {}, "cp_attention": cp_attention_errors()}
    host_init = jax.device_get(sharding_plan(load_config(None, SMALL), jax.devices()[:1])
                               .init_params())
    for name, overrides in [("single", ["parallelism.dp=1"])] + list(LAYOUTS.items()):
        t0 = time.time()
        try:
            devices = jax.devices()[:1] if name == "single" else None
            record, flat, plan = run_layout(overrides, devices, host_init)
            np.savez(out / f"{name}.npz", **flat)
            results[name] = {**record, "seconds": time.time() - t0,
                             "mesh": dict(plan.mesh.shape)}
            if name in ZERO_LAYOUTS:  # its step is compiled already: the analysis is free
                results["memory"][f"tiny_zero{ZERO_LAYOUTS[name]}"] = memory(plan)
        except Exception:  # reported by the test of this layout
            results[name] = {"error": traceback.format_exc()}
    # The trainer's sharded init gives the same values as the single-device one.
    try:
        plan = sharding_plan(load_config(None, SMALL + LAYOUTS["dp2_fsdp2_tp2"]))
        sharded = jax.device_get(plan.init_params())
        results["sharded_init_max_diff"] = max(
            float(np.abs(a - b).max())
            for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(host_init)))
    except Exception:
        results["sharded_init_max_diff"] = traceback.format_exc()
    for stage in range(4):  # the larger model: compile only
        try:
            cfg = load_config(None, LARGER + ["parallelism.dp=8", f"train.zero_stage={stage}"])
            results["memory"][f"larger_zero{stage}"] = memory(sharding_plan(cfg), cfg)
        except Exception:
            results["memory"][f"larger_zero{stage}"] = {"error": traceback.format_exc()}
    (out / "results.json").write_text(json.dumps(results, indent=1))


def cp_attention_errors() -> dict:
    """Ring attention in sequence order (as MTP modules call it) over cp=4 x tp=2, one KV
    head (repeated for tp), vs the reference: relative errors of the value and gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.config import ParallelismConfig
    from jaxllm.kernels.reference import flash_attention
    from jaxllm.sharding import Rules, make_mesh
    from jaxllm.sharding.constrain import ShardingContext, active
    from jaxllm.sharding.context import causal_attention

    mesh = make_mesh(ParallelismConfig(dp=1, cp=4, tp=2))
    ctx = ShardingContext(mesh, Rules.for_mesh(mesh), "ring")
    kq, kk, kv, kw = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(kq, (2, 32, 4, 16))
    k, v = jax.random.normal(kk, (2, 32, 1, 16)), jax.random.normal(kv, (2, 32, 1, 16))
    w = jax.random.normal(kw, q.shape)

    def sharded(q, k, v):
        with active(ctx):
            return jnp.sum(causal_attention(q, k, v, impl="reference") * w)

    ref = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True) * w)
    val, grads = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(q, k, v)
    val_r, grads_r = jax.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    rel = lambda a, b: float(np.abs(np.asarray(a - b)).max() / np.abs(np.asarray(b)).max())
    return {"value": rel(val, val_r), "grads": max(rel(g, r) for g, r in zip(grads, grads_r))}


def memory(plan, cfg=None) -> dict:
    """The compiled step's per-device memory and the ZeRO formula's figures."""
    from jaxllm.config import load_config
    from jaxllm.sharding.memory import step_memory
    from jaxllm.train.trainer import make_train_fns

    cfg = cfg or load_config(None, SMALL + [f"train.zero_stage={plan.rules.zero_stage}"])
    fns = make_train_fns(cfg, plan.graphdef, plan)
    m = step_memory(fns.step, plan, fns.tx)
    m["n_params"] = sum(a.size for a in __import__("jax").tree.leaves(plan.abstract))
    return m


def run_multihost(out: Path, pid: int, port: int, overrides=MULTIHOST, rows=None):
    """One of 2 processes of 4 devices training `overrides`; `rows`: the batch rows this
    process loads (default: its half of each global batch). Process 0 writes the state."""
    import jax
    import numpy as np

    processes.join(pid, port)
    rows = slice(4 * pid, 4 * pid + 4) if rows is None else rows
    record, flat, plan = run_layout(overrides, rows=rows)
    if pid == 0:
        np.savez(out / "multihost.npz", **flat)
        hosts = processes.hosts(plan.mesh)
        (out / "multihost.json").write_text(json.dumps({**record, "hosts": hosts}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "all":
        run_all(out)
    else:
        run_multihost(out, int(sys.argv[3]), int(sys.argv[4]))
