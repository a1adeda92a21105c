"""Checkpoints through orbax: periodic async saves, keep-last-k, restore of the newest
intact checkpoint; `load_model` for everything that runs a trained model (generation, serving).

A checkpoint holds two items, `params` and `opt_state`, under its step; generation restores
`params` alone. Batches are a pure function of the step, so the step is the data cursor.
Once a save has completed, a manifest (each file's size and SHA-256) is written into its
step directory; a restore checks it first, so a deleted, truncated or overwritten file is
named in one line and the newest intact checkpoint is used instead.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import jax
import orbax.checkpoint as ocp

from jaxllm.config import CheckpointConfig

ITEMS = ("params", "opt_state")
MANIFEST = "jaxllm_manifest.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be read: its files are missing, truncated or altered."""


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _stderr(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _files(step_dir: Path) -> list[Path]:
    return sorted(f for f in step_dir.rglob("*") if f.is_file() and f.name != MANIFEST)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(step_dir: Path) -> None:
    """Record the size and SHA-256 of every file of a completed save."""
    files = {str(f.relative_to(step_dir)): [f.stat().st_size, _sha256(f)]
             for f in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}))
    tmp.replace(step_dir / MANIFEST)


def verify_manifest(step_dir: Path) -> str | None:
    """What is wrong with a step directory against its manifest, or None (also when it
    has no manifest: a save cut off before the manifest is left to orbax's checks)."""
    path = step_dir / MANIFEST
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"its manifest {MANIFEST} is unreadable ({e})"
    for rel, (size, digest) in files.items():
        f = step_dir / rel
        if not f.exists():
            return f"file {rel} is missing"
        if f.stat().st_size != size:
            return f"file {rel} has {f.stat().st_size} bytes, {size} were written"
        if _sha256(f) != digest:
            return f"file {rel} differs from what was written (SHA-256 mismatch)"
    return None


def _brief(e: Exception) -> str:
    """One line from an exception of orbax / TensorStore (which may run to many lines)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    text = lines[0].split(" See full TensorStore details")[0] if lines else ""
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig | None = None, *,
                 read_only: bool = False):
        cfg = cfg or CheckpointConfig()
        self.dir = Path(run_dir).absolute() / "checkpoints"
        self.read_only = read_only
        if read_only and not self.dir.exists():
            raise FileNotFoundError(f"no checkpoints in {self.dir.parent}")
        if read_only:
            self._options = ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, max_to_keep=None, create=False)
        else:
            self._options = ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_save)
        self.manager = self._new_manager()
        self._unsealed: list[int] = []  # saved, manifest not yet written

    def _new_manager(self):
        return ocp.CheckpointManager(self.dir, options=self._options, item_names=ITEMS)

    def step_dir(self, step: int) -> Path:
        return self.dir / str(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, *, force: bool = False) -> bool:
        self._seal()  # orbax finishes the previous save before starting this one anyway
        args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                                  opt_state=ocp.args.StandardSave(opt_state))
        saved = self.manager.save(step, args=args, force=force)
        if saved:
            self._unsealed.append(step)
        return saved

    def _seal(self):
        """Wait for pending saves, then write the manifest of each completed one."""
        self.manager.wait_until_finished()
        if jax.process_index() == 0:
            kept = set(self.manager.all_steps())
            for step in self._unsealed:
                if step in kept:
                    write_manifest(self.step_dir(step))
        self._unsealed.clear()

    def _read(self, step: int, args) -> dict:
        where = f"checkpoint {self.step_dir(step)} (step {step})"
        problem = verify_manifest(self.step_dir(step))
        if problem:
            raise CheckpointError(f"{where} is damaged: {problem}")
        try:
            return self.manager.restore(step, args=args)
        except Exception as e:  # orbax / TensorStore raise many types for unreadable files
            self.manager = self._new_manager()  # a failed restore can leave it unusable
            raise CheckpointError(f"{where} cannot be read: {_brief(e)}") from None

    def _restore(self, args, step: int | None, report: Callable[[str], None]):
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise ValueError(f"no checkpoint for step {step} in {self.dir}; "
                                 f"available: {steps}")
            return self._read(step, args), step
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.dir}")
        problems = []
        for s in reversed(steps):
            try:
                out = self._read(s, args)
            except CheckpointError as e:
                report(f"warning: {e}")
                problems.append(s)
                continue
            if problems:
                report(f"using step {s}, the newest intact checkpoint")
            return out, s
        raise CheckpointError(f"no intact checkpoint in {self.dir} (steps {steps} all "
                              f"failed, see above)")

    def restore(self, params_like, opt_state_like, step: int | None = None, *,
                report: Callable[[str], None] = _stderr):
        """(params, opt_state, step) restored into the structure and shardings given: from
        `step`, or else the newest checkpoint that reads intact (each one skipped is
        reported in one line through `report`)."""
        out, step = self._restore(ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state_like))), step, report)
        return out["params"], out["opt_state"], step

    def restore_params(self, params_like, step: int | None = None, *,
                       report: Callable[[str], None] = _stderr):
        """(params, step): the parameters alone, e.g. for generation."""
        out, step = self._restore(ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like))), step, report)
        return out["params"], step

    def set_aside_after(self, step: int, report: Callable[[str], None] = _stderr) -> None:
        """Move the checkpoints later than `step` (damaged ones, or those a resume from an
        earlier step will write again) to run_dir/set_aside/, so nothing is deleted."""
        later = [s for s in self.all_steps() if s > step]
        if not later or jax.process_index() != 0:
            return
        dest = self.dir.parent / "set_aside"
        dest.mkdir(exist_ok=True)
        for s in later:
            target = dest / str(s)
            n = 1
            while target.exists():
                target, n = dest / f"{s}.{n}", n + 1
            shutil.move(str(self.step_dir(s)), str(target))
        self.manager = self._new_manager()
        report(f"resuming from step {step}: moved the later checkpoint(s) {later} to {dest}")

    def wait(self):
        self._seal()

    def close(self):
        self._seal()
        self.manager.close()


def has_checkpoints(run_dir: str | Path) -> bool:
    """Whether run_dir/checkpoints holds a step directory (not only a cut-off save's tmp)."""
    d = Path(run_dir) / "checkpoints"
    return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())


def check_run_dir(run_dir: str | Path) -> Path:
    """The run directory if it holds a trained run (config.yaml and checkpoints), else a
    FileNotFoundError saying what is missing and how to train one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        why = "the directory does not exist"
    elif not (run_dir / "config.yaml").is_file():
        why = "it has no config.yaml"
    elif not has_checkpoints(run_dir):
        why = "it has no checkpoints"
    else:
        return run_dir
    raise FileNotFoundError(f"no trained run in {str(run_dir)!r} ({why}); train one with "
                            f"`python -m jaxllm.train --config CONFIG train.run_dir={run_dir}`")


def load_model(run_dir: str | Path, step: int | None = None, overrides: list[str] | None = None,
               *, report: Callable[[str], None] = _stderr):
    """(model, cfg, step): a run directory's resolved config and checkpointed parameters
    (from `step`, or else the newest intact checkpoint)."""
    from flax import nnx

    from jaxllm.config import load_config
    from jaxllm.model import build_model

    run_dir = check_run_dir(run_dir)
    cfg = load_config(run_dir / "config.yaml", overrides)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params, step = Checkpointer(run_dir, read_only=True).restore_params(
        nnx.to_pure_dict(state), step, report=report)
    return nnx.merge(graphdef, params), cfg, step
