"""Runs the expert-parallel layouts of tests/test_experts.py in a fresh process.

    python tests/experts_worker.py OUT   # one device + every layout -> OUT/<name>.npz

Its own process, as tests/sharding_worker.py, so that XLA compiles without backend
optimisation (3x faster compiles on the CPU; the numbers are the same to float tolerance).
Each .npz holds the loss ("loss") and every gradient leaf of the tiny MoE model on one
batch, or the traceback ("error") of a layout that failed.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

# one MoE layer (8 experts, top-2, the selection bias), small enough to compile fast
MODEL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.n_layers=1",
         "model.moe.dense_layers=0", "model.moe.num_shared_experts=0",
         "model.moe.expert_mlp_dim=16", "model.init_std=0.3", "train.batch_size=8",
         "train.seq_len=16"]
LAYOUTS = {  # ep alone, with fsdp and tp (the expert width split), with dp; no ep
    "ep8": ["parallelism.dp=1", "parallelism.ep=8"],
    "ep2_fsdp2_tp2": ["parallelism.dp=1", "parallelism.fsdp=2", "parallelism.ep=2",
                      "parallelism.tp=2"],
    "ep4_dp2": ["parallelism.dp=2", "parallelism.ep=4"],
    "dp4_tp2": ["parallelism.dp=4", "parallelism.tp=2"],  # every expert on each device
}


def config(overrides):
    from jaxllm.config import load_config
    return load_config("configs/tiny_moe.yaml", MODEL + overrides)


def loss_and_grads(plan, params, batch) -> dict:
    """{"loss", every gradient leaf by its path} of the model's objective on `batch`."""
    import jax
    import numpy as np

    from jaxllm.sharding.constrain import traced_in
    from jaxllm.train.trainer import loss_fn

    fn = jax.value_and_grad(lambda p, b: loss_fn(plan.graphdef, p, b)[0])
    step = jax.jit(traced_in(plan.context, fn), in_shardings=(plan.params, plan.batch),
                   out_shardings=(plan.replicated, plan.shardings("grads")))
    loss, grads = step(jax.device_put(params, plan.params), plan.place_batch(batch))
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]
    return {"loss": np.asarray(loss), **{jax.tree_util.keystr(p): g for p, g in flat}}


def run(out: Path):
    import jax
    import numpy as np

    from jaxllm.train.trainer import sharding_plan

    tokens = np.random.default_rng(0).integers(0, 258, size=(8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    single = sharding_plan(config(["parallelism.dp=1"]), jax.devices()[:1])
    params = jax.device_get(single.init_params())
    np.savez(out / "single.npz", **loss_and_grads(single, params, batch))
    for name, overrides in LAYOUTS.items():
        try:
            plan = sharding_plan(config(overrides))
            # [L, E, d, f]: the experts on ep
            ep = plan.mesh.shape["ep"]
            assert plan.params["blocks"]["mlp"]["gate"].spec[1] == ("ep" if ep > 1 else None)
            np.savez(out / f"{name}.npz", **loss_and_grads(plan, params, batch))
        except Exception:  # reported by the test of this layout
            np.savez(out / f"{name}.npz", error=traceback.format_exc())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    run(Path(sys.argv[1]))
