"""Per-device memory of the model states: the ZeRO formula and what the compiler allocates.

The ZeRO paper counts 16 bytes per parameter for mixed-precision Adam: bf16 parameter and
gradient (2 + 2) and an f32 master copy, m and v (12). Here parameters are stored in
`model.param_dtype` and serve as their own master copy; gradients have the parameter
dtype and optax keeps Adam's m and v in it too. With p bytes per parameter element
(4 for the default f32) the states are p + p + 2p bytes: 4 + 4 + 8 = 16 bytes in f32.

Per device, each state is divided by the number of devices it is sharded over: tp for
the model-parallel matrices (their Ψ counts as Ψ/tp), times its ZeRO axes (`rules.py`):

    stage   params        grads         Adam m, v      f32, fsdp=1, N=dp
    0       pΨ/F          pΨ/F          2pΨ/F          16Ψ
    1       pΨ/F          pΨ/F          2pΨ/N          8Ψ + 8Ψ/N
    2       pΨ/F          pΨ/N          2pΨ/N          4Ψ + 12Ψ/N
    3       pΨ/N          pΨ/N          2pΨ/N          16Ψ/N

with F = fsdp and N = dp x fsdp. The check: the compiled step's memory analysis gives
its argument bytes per device (parameters + optimizer state + the batch shard);
without the batch they should equal the formula's params + Adam columns. Gradients live
among the step's temporaries (with the activations), which are reported beside it.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from jaxllm.sharding.plan import ShardingPlan, shard_bytes

MB = 1 << 20


def zero_formula(plan: ShardingPlan) -> dict[str, float]:
    """Bytes per device of params, grads and Adam moments by the formula above."""
    r = plan.rules
    groups = {k: math.prod(r.size(a) for a in r.zero_axes(k))
              for k in ("params", "grads", "opt_state")}
    psi_bytes = 0.0  # sum over parameters of p * size / (its tp split)
    for a, s in zip(jax.tree.leaves(plan.abstract), jax.tree.leaves(plan.params)):
        split = math.prod(r.size(ax) for spec in s.spec if spec is not None
                          for ax in ((spec,) if isinstance(spec, str) else spec)
                          if ax not in ("dp", "fsdp"))
        psi_bytes += math.prod(a.shape) * np.dtype(a.dtype).itemsize / split
    return {"params": psi_bytes / groups["params"], "grads": psi_bytes / groups["grads"],
            "opt_state": 2 * psi_bytes / groups["opt_state"]}


def step_memory(step, plan: ShardingPlan, tx) -> dict[str, float]:
    """Compile `step` (jitted, with the plan's shardings) for abstract inputs; its memory.

    Returns per-device bytes: the compiler's argument/output/temp/alias sizes, the model
    states among the arguments (`states`: arguments less the batch shard), the exact
    shard sizes of params and optimizer state, and the ZeRO formula's figures.
    """
    compiled = step.lower(plan.abstract_params(), plan.abstract_opt_state(tx),
                          plan.abstract_batch()).compile()
    stats = compiled.memory_analysis()
    batch = plan.abstract_batch()
    batch_bytes = shard_bytes(list(batch.values()), [b.sharding for b in batch.values()])
    formula = zero_formula(plan)
    return {
        "argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
        "temp": stats.temp_size_in_bytes, "alias": stats.alias_size_in_bytes,
        "states": stats.argument_size_in_bytes - batch_bytes,
        "params_shards": shard_bytes(plan.abstract, plan.params),
        "opt_state_shards": shard_bytes(jax.eval_shape(tx.init, plan.abstract),
                                        plan.opt_state_shardings(tx)),
        "formula_params": formula["params"], "formula_grads": formula["grads"],
        "formula_opt_state": formula["opt_state"],
    }


def describe_memory(m: dict, zero_stage: int) -> str:
    """Two lines for the training log."""
    formula = m["formula_params"] + m["formula_opt_state"]
    return (f"memory per device (compiled step): params + optimizer state "
            f"{m['states'] / MB:.2f} MB; ZeRO-{zero_stage} formula {formula / MB:.2f} MB "
            f"(params {m['formula_params'] / MB:.2f} + Adam {m['formula_opt_state'] / MB:.2f}; "
            f"ratio {m['states'] / formula:.3f})\n"
            f"  gradients by the formula {m['formula_grads'] / MB:.2f} MB, held among the "
            f"temporaries: {m['temp'] / MB:.2f} MB (gradients + activations)")
