"""Checkpoint integrity: a damaged latest checkpoint is reported in one line and the newest
intact one is restored instead."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.checkpoint import MANIFEST, Checkpointer, CheckpointError
from jaxllm.config import CheckpointConfig

PARAMS = {"w": jnp.arange(2000.0).reshape(20, 100), "b": jnp.ones(3)}
OPT = {"m": jnp.zeros((20, 100))}


def _damage(step_dir, how):
    files = [f for f in (step_dir / "params").rglob("*") if f.is_file()]
    big = max(files, key=lambda f: f.stat().st_size)
    if how == "deleted":
        big.unlink()
    elif how == "truncated":
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    elif how == "zeroed":
        big.write_bytes(bytes(big.stat().st_size))
    return big


@pytest.fixture
def two_steps(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=3))
    ckpt.save(1, PARAMS, OPT, force=True)
    ckpt.save(2, {**PARAMS, "w": PARAMS["w"] + 1}, OPT, force=True)
    ckpt.close()
    assert (ckpt.step_dir(2) / MANIFEST).exists()
    return tmp_path, ckpt.step_dir(2)


@pytest.mark.parametrize("how,what", [("deleted", "is missing"), ("truncated", "bytes"),
                                      ("zeroed", "SHA-256"), ("no manifest", "cannot be read")])
def test_damaged_latest_falls_back(two_steps, how, what):
    run, latest = two_steps
    if how == "no manifest":  # a save cut off before its manifest: orbax's own checks
        (latest / MANIFEST).unlink()
        how = "truncated"
    _damage(latest, how)
    lines = []
    params, _, step = Checkpointer(run, read_only=True).restore(PARAMS, OPT, report=lines.append)
    assert step == 1
    np.testing.assert_array_equal(params["w"], PARAMS["w"])
    assert len(lines) == 2 and "\n" not in lines[0]
    assert str(latest) in lines[0] and "(step 2)" in lines[0] and what in lines[0]
    assert lines[1] == "using step 1, the newest intact checkpoint"


def test_chosen_damaged_step_is_an_error(two_steps):
    run, latest = two_steps
    _damage(latest, "zeroed")
    ckpt = Checkpointer(run, read_only=True)
    with pytest.raises(CheckpointError, match=r"\(step 2\) is damaged"):
        ckpt.restore_params(PARAMS, step=2)
    with pytest.raises(ValueError, match="no checkpoint for step 7.*available: \\[1, 2\\]"):
        ckpt.restore_params(PARAMS, step=7)
    params, step = ckpt.restore_params(PARAMS, step=1, report=pytest.fail)
    assert step == 1
