"""The CLIs refuse every user mistake in one `error:` line with exit code 2, before any
expensive work and without touching the run directory; a damaged latest checkpoint falls
back to the previous one in train and in generate; signals act within one step."""
import hashlib
import importlib
import os
import shutil
import signal

import pytest

from jaxllm.checkpoint import Checkpointer
from jaxllm.config import load_config
from jaxllm.train import __main__ as train_cli
from jaxllm.train.trainer import train

generate_cli = importlib.import_module("jaxllm.generate")  # the CLI (a callable module)

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.mlp_dim=64", "model.max_seq_len=64", "train.batch_size=8", "train.seq_len=16",
        "train.warmup_steps=1", "train.progress=false", "train.eval_batches=1",
        "data.val_fraction=0.2", "train.log_every=2", "train.eval_every=100",
        "checkpoint.every=2", "checkpoint.keep=3"]


def _args(corpus, tmp, run, *extra):
    return TINY + [f"data.source={corpus}", f"data.cache_dir={tmp}/cache",
                   f"train.run_dir={run}", *extra]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A run of 4 steps with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trained")
    assert train_cli.main(["--config", "configs/tiny.yaml",
                           *_args(corpus, tmp, tmp / "run", "train.steps=4")]) == 0
    assert Checkpointer(tmp / "run", read_only=True).all_steps() == [2, 4]
    return tmp / "run"


@pytest.fixture
def run(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _snapshot(d):
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.rglob("*")) if f.is_file()}


def _error(capsys, rc):
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_resume_with_another_model_is_refused_untouched(run, corpus, tmp_path, capsys):
    before = _snapshot(run)
    rc = train_cli.main(["--config", "configs/tiny.yaml",
                         *_args(corpus, tmp_path, run, "train.steps=6", "model.d_model=64")])
    line = _error(capsys, rc)
    assert "model.d_model=64 (checkpoints: 32)" in line and "new train.run_dir" in line
    assert _snapshot(run) == before


def test_damaged_latest_falls_back_in_train_and_generate(run, corpus, tmp_path, capsys):
    """(Each kind of damage, deleted, truncated or zeroed, is in test_checkpoint.py.)"""
    from test_checkpoint import _damage
    bad = Checkpointer(run, read_only=True).step_dir(4)
    _damage(bad, "truncated")
    capsys.readouterr()
    assert generate_cli.main(["--run", str(run), "--prompt", "def", "--max-new-tokens", "2",
                              "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert f"warning: checkpoint {bad} (step 4)" in err
    assert "using step 2, the newest intact checkpoint" in err and "step 2]" in err
    assert "Traceback" not in err
    assert train_cli.main(["--config", "configs/tiny.yaml",
                           *_args(corpus, tmp_path, run, "train.steps=4")]) == 0
    out, err = capsys.readouterr()
    assert f"warning: checkpoint {bad} (step 4)" in err and "resumed at step 2" in out
    assert (run / "set_aside" / "4").is_dir()  # the damaged one is kept aside, not deleted
    assert Checkpointer(run, read_only=True).all_steps() == [2, 4]


def test_train_resumes_from_a_chosen_step(run, corpus, tmp_path, capsys):
    assert train_cli.main(["--config", "configs/tiny.yaml", "--step", "2",
                           *_args(corpus, tmp_path, run, "train.steps=6")]) == 0
    out, err = capsys.readouterr()
    assert "resumed at step 2" in out and "moved the later checkpoint(s) [4]" in err
    assert Checkpointer(run, read_only=True).all_steps() == [2, 4, 6]
    rc = train_cli.main(["--config", "configs/tiny.yaml", "--step", "5",
                         *_args(corpus, tmp_path, run, "train.steps=6")])
    assert "no checkpoint for step 5" in _error(capsys, rc)


def _no_load(*_a, **_k):
    raise AssertionError("the checkpoint was loaded before the inputs were checked")


@pytest.mark.parametrize("argv,message", [
    (["--top-p", "2"], "inference.top_p=2.0 must lie in (0, 1]"),
    (["--temperature", "-1"], "inference.temperature=-1.0"),
    (["--prompt", "x" * 70], "exceeds model.max_seq_len=64"),
    (["--max-new-tokens", "100"], "exceeds model.max_seq_len=64"),
    (["model.n_layer=2"], "did you mean 'n_layers'"),
])
def test_generate_refuses_bad_inputs_before_loading(run, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(generate_cli, "load_model", _no_load, raising=False)
    import jaxllm.checkpoint
    monkeypatch.setattr(jaxllm.checkpoint, "load_model", _no_load)
    argv = ["--run", str(run)] + (["--prompt", "def"] if "--prompt" not in argv else []) + argv
    assert message in _error(capsys, generate_cli.main(argv))


def test_generate_without_a_trained_run(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, why in [(["--run", str(tmp_path / "nope")], "the directory does not exist"),
                      (["--run", str(empty)], "it has no config.yaml"),
                      (["--config", "configs/tiny.yaml", f"train.run_dir={empty}"],
                       "it has no config.yaml")]:
        line = _error(capsys, generate_cli.main(argv + ["--prompt", "def"]))
        assert "no trained run in" in line and why in line and "python -m jaxllm.train" in line


def test_train_refuses_bad_inputs_without_stray_files(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    cases = [
        ([f"data.source={tmp_path}/missing/*.py"], "matches no files"),
        (["train.seq_len=128"], "exceeds model.max_seq_len=64"),
        (["train.stepz=3"], "did you mean 'steps'"),
        (["train.steps=-1"], "train.steps"),
        (["parallelism.dp=3"], "needs 3 devices but 8 are present"),
    ]
    for extra, message in cases:
        rc = train_cli.main(["--config", "configs/tiny.yaml", *_args(corpus, tmp_path, run),
                             *extra])
        assert message in _error(capsys, rc)
        assert not run.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "without config.yaml" in _error(capsys, train_cli.main(["--config", str(empty)]))
    assert "does not exist" in _error(capsys, train_cli.main(["--config", "nope.yaml"]))


def test_signal_acts_within_one_step(corpus, tmp_path):
    """SIGTERM (or a first Ctrl-C, the same handler) arrives while step 3's batch is placed;
    the run saves and stops after that step, not at the next log step."""
    cfg = load_config("configs/tiny.yaml", _args(corpus, tmp_path, tmp_path / "run",
                                                 "train.steps=1000", "train.log_every=1000",
                                                 "checkpoint.every=1000"))
    calls = []

    def place(batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    summary = train(cfg, place_batch=place)
    assert summary["interrupted"] and summary["step"] == 3
    assert Checkpointer(tmp_path / "run", read_only=True).latest_step() == 3
