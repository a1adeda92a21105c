"""Runs the pipeline layouts for tests/test_pipeline.py in a fresh process.

    python tests/pipeline_worker.py OUT     # pp = 1 and every pipeline layout
    python tests/pipeline_worker.py moe OUT # an MoE model: pp = 1 and its pipeline layouts
    python tests/pipeline_worker.py mtp OUT # models with MTP modules: pp = 1 and pipelines
    python tests/pipeline_worker.py multihost OUT PID PORT  # one of 2 processes, 4 devices each

As tests/sharding_worker.py (whose training loop it reuses): XLA without backend
optimisation, one training step per layout (the Adam moments after one step are linear
in the gradients, so equal states mean equal gradients), results.json and one .npz of
the state per layout in OUT.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharding_worker as base  # noqa: E402

base.STEPS = 1
MODEL = ["model.n_layers=8"]  # 8 layers: 2 or 4 devices x 2 stages each for circular

LAYOUTS = {
    "gpipe_pp2_dp2_tp2_remat": ["parallelism.pp=2", "parallelism.dp=2", "parallelism.tp=2",
                                "parallelism.pp_schedule=gpipe", "train.microbatches=2",
                                "model.remat=full"],
    "gpipe_pp4_fsdp2": ["parallelism.pp=4", "parallelism.dp=1", "parallelism.fsdp=2",
                        "parallelism.pp_schedule=gpipe", "train.microbatches=4"],
    "circular_pp2_v2_dp4": ["parallelism.pp=2", "parallelism.dp=4",
                            "parallelism.pp_schedule=circular", "parallelism.pp_repeats=2",
                            "train.microbatches=2"],
    "circular_pp4_v2_tp2": ["parallelism.pp=4", "parallelism.dp=1", "parallelism.tp=2",
                            "parallelism.pp_schedule=circular", "parallelism.pp_repeats=2",
                            "train.microbatches=4"],
    "1f1b_pp2_dp2_tp2": ["parallelism.pp=2", "parallelism.dp=2", "parallelism.tp=2",
                         "parallelism.pp_schedule=1f1b", "train.microbatches=4"],
    "1f1b_pp4_fsdp2_zero1": ["parallelism.pp=4", "parallelism.dp=1", "parallelism.fsdp=2",
                             "parallelism.pp_schedule=1f1b", "train.microbatches=4",
                             "train.zero_stage=1"],
    # pp alone: a mesh of pp devices only (the schedules' other layouts cover gpipe and
    # circular)
    "1f1b_pp4_alone": ["parallelism.pp=4", "parallelism.dp=1",
                       "parallelism.pp_schedule=1f1b", "train.microbatches=4"],
}
ALONE = {"1f1b_pp4_alone": 4}  # devices

# An MoE model: one dense layer (run by the first stage), then 2 MoE layers of 4 experts,
# top-2, one shared expert; 1 MoE layer per stage, compared with its own pp = 1 run.
MOE = ["model.n_layers=3", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.expert_mlp_dim=32", "model.moe.num_shared_experts=1",
       "model.moe.dense_layers=1", "model.moe.router=sigmoid"]
MOE_LAYOUTS = {
    "moe_aux_loss_gpipe_pp2_dp2_tp2": ["model.moe.balance=aux_loss", "parallelism.pp=2",
                                       "parallelism.dp=2", "parallelism.tp=2",
                                       "parallelism.pp_schedule=gpipe", "train.microbatches=2"],
    "moe_bias_1f1b_pp2_dp2_ep2": ["model.moe.balance=bias", "parallelism.pp=2",
                                  "parallelism.dp=2", "parallelism.ep=2",
                                  "parallelism.pp_schedule=1f1b", "train.microbatches=2"],
}

# Models with MTP modules, each compared with its own pp = 1 run: a dense one of 4 layers
# and 2 modules (mtp_weight 0.5, so the objective's MTP share differs from its default),
# and the MoE model above with one module (an MoE block, whose routing stats follow the
# main layers' and whose expert_bias moves with them).
MTP_MODELS = {
    "dense": ["model.n_layers=4", "model.mtp_depth=2", "train.mtp_weight=0.5"],
    "moe": MOE + ["model.moe.balance=bias", "model.mtp_depth=1"],
}
MTP_LAYOUTS = {
    "dense_mtp_gpipe_pp2_dp2_tp2": ["parallelism.pp=2", "parallelism.dp=2", "parallelism.tp=2",
                                    "parallelism.pp_schedule=gpipe", "train.microbatches=2"],
    "dense_mtp_circular_pp2_v2_dp4": ["parallelism.pp=2", "parallelism.dp=4",
                                      "parallelism.pp_schedule=circular",
                                      "parallelism.pp_repeats=2", "train.microbatches=2"],
    "moe_mtp_1f1b_pp2_dp2_ep2": ["parallelism.pp=2", "parallelism.dp=2", "parallelism.ep=2",
                                 "parallelism.pp_schedule=1f1b", "train.microbatches=2"],
}


def run_all(out: Path):
    import jax
    import numpy as np

    from jaxllm.config import load_config
    from jaxllm.train.trainer import sharding_plan

    host_init = jax.device_get(sharding_plan(load_config(None, base.SMALL + MODEL),
                                             jax.devices()[:1]).init_params())
    results = {}
    for name, overrides in [("single", ["parallelism.dp=1"])] + list(LAYOUTS.items()):
        t0 = time.time()
        try:
            devices = (jax.devices()[:1] if name == "single" else
                       jax.devices()[:ALONE[name]] if name in ALONE else None)
            record, flat, plan = base.run_layout(MODEL + overrides, devices, host_init)
            np.savez(out / f"{name}.npz", **flat)
            results[name] = {**record, "seconds": time.time() - t0}
        except Exception:  # reported by the test of this layout
            results[name] = {"error": traceback.format_exc()}
    (out / "results.json").write_text(json.dumps(results, indent=1))


def run_moe(out: Path):
    """The MoE layouts, each against pp = 1 with the same balancing, into OUT/<balance>/."""
    for balance in ("aux_loss", "bias"):  # the expert_bias leaves exist with "bias" only
        _run_model(out / balance, MOE + [f"model.moe.balance={balance}"],
                   {k: v for k, v in MOE_LAYOUTS.items() if f"_{balance}_" in k})


def run_mtp(out: Path):
    """The MTP layouts, each against pp = 1 of its model, into OUT/<model>/."""
    for kind, model in MTP_MODELS.items():
        _run_model(out / kind, model,
                   {k: v for k, v in MTP_LAYOUTS.items() if k.startswith(f"{kind}_")})


def _run_model(sub: Path, model: list[str], layouts: dict[str, list[str]]):
    """One model on one device ("single") and in each layout, from the same initial
    parameters: each run's flattened state into SUB/<name>.npz, records into results.json."""
    import jax
    import numpy as np

    from jaxllm.config import load_config
    from jaxllm.train.trainer import sharding_plan

    host_init = jax.device_get(sharding_plan(load_config(None, base.SMALL + model),
                                             jax.devices()[:1]).init_params())
    sub.mkdir()
    results = {}
    for name, overrides in [("single", ["parallelism.dp=1"])] + list(layouts.items()):
        t0 = time.time()
        try:
            devices = jax.devices()[:1] if name == "single" else None
            record, flat, _ = base.run_layout(model + overrides, devices, host_init)
            np.savez(sub / f"{name}.npz", **flat)
            results[name] = {**record, "seconds": time.time() - t0}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    (sub / "results.json").write_text(json.dumps(results, indent=1))


MULTIHOST = LAYOUTS["1f1b_pp2_dp2_tp2"]  # pp, the outermost mesh axis, across the 2 hosts


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1] == "multihost":
        # pp spans the hosts, so each loads every batch row
        base.run_multihost(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                           MODEL + MULTIHOST, rows=slice(None))
    elif sys.argv[1] == "moe":
        run_moe(Path(sys.argv[2]))
    elif sys.argv[1] == "mtp":
        run_mtp(Path(sys.argv[2]))
    else:
        run_all(Path(sys.argv[1]))
