"""Checkpoints through orbax: periodic async saves, keep-last-k, restore of the latest;
`load_model` for everything that runs a trained model (generation, serving).

A checkpoint holds two items, `params` and `opt_state`, under its step; generation restores
`params` alone. Batches are a pure function of the step, so the step is the data cursor.
"""
from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxllm.config import CheckpointConfig

ITEMS = ("params", "opt_state")


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig | None = None, *,
                 read_only: bool = False):
        cfg = cfg or CheckpointConfig()
        self.dir = Path(run_dir).absolute() / "checkpoints"
        if read_only and not self.dir.exists():
            raise FileNotFoundError(f"no checkpoints in {self.dir.parent}")
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0,
                                                   max_to_keep=None, create=False)
        else:
            options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                                   enable_async_checkpointing=cfg.async_save)
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_names=ITEMS)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, *, force: bool = False) -> bool:
        args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                                  opt_state=ocp.args.StandardSave(opt_state))
        return self.manager.save(step, args=args, force=force)

    def _step(self, step):
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.dir}")
        if step not in self.all_steps():
            raise ValueError(f"no checkpoint for step {step} in {self.dir}; "
                             f"available: {self.all_steps()}")
        return step

    def restore(self, params_like, opt_state_like, step: int | None = None):
        """(params, opt_state, step) restored into the structure and shardings given."""
        step = self._step(step)
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state_like))))
        return out["params"], out["opt_state"], step

    def restore_params(self, params_like, step: int | None = None):
        """(params, step): the parameters alone, e.g. for generation."""
        step = self._step(step)
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like))))
        return out["params"], step

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def load_model(run_dir: str | Path, step: int | None = None, overrides: list[str] | None = None):
    """(model, cfg, step): a run directory's resolved config and checkpointed parameters."""
    from flax import nnx

    from jaxllm.config import load_config
    from jaxllm.model import build_model

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml", overrides)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params, step = Checkpointer(run_dir, read_only=True).restore_params(
        nnx.to_pure_dict(state), step)
    return nnx.merge(graphdef, params), cfg, step
