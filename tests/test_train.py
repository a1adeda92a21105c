import json
import subprocess
import sys

import numpy as np
import pytest

from jaxllm.config import load_config
from jaxllm.tokenizer import ByteTokenizer
from jaxllm.train import data as data_lib
from jaxllm.train.trainer import NonFiniteLoss, train

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
         "model.mlp_dim=64", "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=2",
         "train.progress=false", "train.eval_batches=2"]



def _cfg(corpus, tmp_path, *extra):
    return load_config(None, SMALL + [f"data.source={corpus}",
                                      f"data.cache_dir={tmp_path / 'cache'}",
                                      f"train.run_dir={tmp_path / 'run'}", "data.val_fraction=0.2"]
                       + list(extra))


def test_data_split_and_batches_are_deterministic(corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    data = data_lib.load_tokens(cfg.data, ByteTokenizer())
    assert len(data.train) > 0 and len(data.val) > 0
    a = data_lib.get_batch(data.train, 16, 4, seed=1, step=7)
    b = data_lib.get_batch(data.train, 16, 4, seed=1, step=7)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    # each of 2 hosts gets its half of the same global batch
    halves = [data_lib.get_batch(data.train, 16, 4, 1, 7, host_id=h, num_hosts=2) for h in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), a["inputs"])
    # the cache is reused: same files -> same memory-mapped arrays
    again = data_lib.load_tokens(cfg.data, ByteTokenizer())
    np.testing.assert_array_equal(again.val, data.val)


def test_jsonl_source(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"doc {i} " * 20}) for i in range(50)))
    cfg = load_config(None, [f"data.source={path}", f"data.cache_dir={tmp_path}/c",
                             "data.val_fraction=0.5"])
    with pytest.raises(ValueError, match="empty"):  # a single file cannot be split by file
        data_lib.load_tokens(cfg.data, ByteTokenizer())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    cfg = load_config(None, [f"data.source={bad}", f"data.cache_dir={tmp_path}/c"])
    with pytest.raises(ValueError, match="no 'text' field"):
        data_lib.load_tokens(cfg.data, ByteTokenizer())


def test_training_lowers_loss(corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path, "train.steps=40", "train.lr=1e-2", "train.log_every=10",
               "train.eval_every=20")
    summary = train(cfg)
    records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert records[0]["loss"] > records[-1]["loss"] + 1.0
    assert {"step", "loss", "lr", "tokens_per_s", "mfu", "eval_loss"} <= set(records[-1])
    assert summary["eval_loss"] < 4.0
    assert (tmp_path / "run" / "config.yaml").exists()


def test_resume_continues_identically(corpus, tmp_path):
    """Stopped on a periodic save, between two, and on the last step (by stop_at and a
    signal at once), a run saves once at each stop and logs an uninterrupted run's losses."""
    import os
    import signal
    from jaxllm.checkpoint import Checkpointer
    from jaxllm.train.trainer import sharding_plan
    common = ["train.steps=12", "train.log_every=1", "train.eval_every=100",
              "checkpoint.every=5", "train.lr=5e-3"]
    full = _cfg(corpus, tmp_path / "a", *common)
    train(full)
    part = _cfg(corpus, tmp_path / "b", *common)
    saved = lambda: Checkpointer(tmp_path / "b" / "run", read_only=True).all_steps()
    assert train(part, stop_at=5)["step"] == 5 and saved() == [5]
    assert train(part, stop_at=8)["step"] == 8 and saved() == [5, 8]
    put, calls = sharding_plan(part).place_batch, []

    def place(batch):  # SIGTERM while the last step's batch (step 12, resumed at 8) is placed
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return put(batch)

    summary = train(part, stop_at=12, place_batch=place)
    assert summary["interrupted"] and summary["step"] == 12 and saved() == [8, 10, 12]
    losses = lambda d: [json.loads(l)["loss"] for l in open(d / "run" / "metrics.jsonl")]
    np.testing.assert_allclose(losses(tmp_path / "b"), losses(tmp_path / "a"), rtol=1e-6)


def test_nonfinite_loss_stops_and_keeps_checkpoint(corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path, "train.steps=30", "train.lr=1e6", "train.grad_clip=1e9",
               "train.warmup_steps=0", "checkpoint.every=1", "train.log_every=1")
    with pytest.raises(NonFiniteLoss, match="last good checkpoint"):
        train(cfg)
    from jaxllm.checkpoint import Checkpointer
    steps = Checkpointer(tmp_path / "run", read_only=True).all_steps()
    assert steps and max(steps) < 30


def test_cli_train_then_generate(corpus, tmp_path):
    args = SMALL + [f"data.source={corpus}", f"data.cache_dir={tmp_path}/c",
                    f"train.run_dir={tmp_path}/run", "train.steps=4", "data.val_fraction=0.2"]
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", "--config", "configs/tiny.yaml",
                        *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "done: step 4" in r.stdout
    r = subprocess.run([sys.executable, "-m", "jaxllm.generate", "--run", f"{tmp_path}/run",
                        "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and "TTFT" in r.stderr and "TPOT" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxllm.train", "--config", "configs/tiny.yaml",
                        "model.n_layer=3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "did you mean 'n_layers'" in r.stderr


def test_sigterm_saves_and_resumes(corpus, tmp_path):
    import signal
    import time
    args = SMALL + [f"data.source={corpus}", f"data.cache_dir={tmp_path}/c",
                    f"train.run_dir={tmp_path}/run", "train.steps=100000", "train.log_every=1",
                    "checkpoint.every=100000", "data.val_fraction=0.2", "train.eval_every=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.train", "--config",
                             "configs/tiny.yaml", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or
                                      len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stopped by SIGTERM" in out
    from jaxllm.checkpoint import Checkpointer
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert Checkpointer(tmp_path / "run", read_only=True).latest_step() >= last >= 3
