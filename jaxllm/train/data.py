"""Training data: a corpus of files, tokenized once into cached memory-mapped token files.

The embedded default corpus is the Python standard library source of the running
interpreter, present on every machine. Users may give text files, folders, globs or JSONL
(one object per line with a text field). Files are split into train/validation by a hash
of their path, so the split never depends on the order files are found in.

Batches are a pure function of (seed, step): a resumed run sees exactly the batches it
would have seen, and each host materialises only its own rows of the global batch.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxllm.config import DataConfig

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts",
                 ".html", ".css", ".yaml", ".yml", ".toml", ".cfg", ".sh", ".tex", ""}


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)]
    return root, sorted(files)


def corpus_files(source: str) -> tuple[Path, list[Path]]:
    """(root, files) for a source: 'stdlib', a file, a folder (searched recursively) or a glob."""
    if source == "stdlib":
        return stdlib_files()
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        root = path
    else:
        files = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path(".")
    if not files:
        raise ValueError(f"data.source={source!r} matches no files; give 'stdlib', a text file, "
                         f"a folder, a glob or a .jsonl file")
    return root, files


def read_texts(path: Path, jsonl_field: str):
    """Yield the documents of one file (a .jsonl file holds one per line)."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if jsonl_field not in obj:
                    raise ValueError(f"{path}:{n}: no {jsonl_field!r} field (data.jsonl_field)")
                yield str(obj[jsonl_field])
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def is_validation(relpath: str, val_fraction: float) -> bool:
    return zlib.crc32(relpath.encode()) % 100_000 < val_fraction * 100_000


@dataclass
class TokenData:
    """Memory-mapped token streams: train and validation, documents separated by EOS."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int

    def split(self, name: str) -> np.ndarray:
        return {"train": self.train, "val": self.val}[name]


def _cache_key(cfg: DataConfig, root: Path, files: list[Path], tokenizer) -> str:
    h = hashlib.sha256()
    h.update(f"{tokenizer.name}|{tokenizer.vocab_size}|{cfg.val_fraction}|{cfg.jsonl_field}|v1"
             .encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def load_tokens(cfg: DataConfig, tokenizer, log=print) -> TokenData:
    """Tokenize the corpus once (cached under data.cache_dir) and memory-map it."""
    root, files = corpus_files(cfg.source)
    cache = Path(cfg.cache_dir) / _cache_key(cfg, root, files, tokenizer)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    if not (cache / "meta.json").exists():
        log(f"tokenizing {len(files)} files from {root} into {cache} ...")
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        counts = {}
        outs = {s: open(tmp / f"{s}.bin", "wb") for s in ("train", "val")}
        eos = np.array([tokenizer.eos_id], dtype)
        for f in files:
            split = "val" if is_validation(str(f.relative_to(root)), cfg.val_fraction) else "train"
            for text in read_texts(f, cfg.jsonl_field):
                if hasattr(tokenizer, "encode_bytes"):
                    ids = tokenizer.encode_bytes(text.encode("utf-8")).astype(dtype)
                else:
                    ids = np.asarray(tokenizer.encode(text), dtype)
                outs[split].write(ids.tobytes())
                outs[split].write(eos.tobytes())
                counts[split] = counts.get(split, 0) + ids.size + 1
        for o in outs.values():
            o.close()
        (tmp / "meta.json").write_text(json.dumps({"dtype": np.dtype(dtype).name,
                                                   "files": len(files), **counts}))
        try:
            tmp.rename(cache)
        except OSError:  # another process finished first; its files are identical
            pass
    meta = json.loads((cache / "meta.json").read_text())
    arrays = {}
    for s in ("train", "val"):
        if not meta.get(s):
            raise ValueError(f"the {s} split of data.source={cfg.source!r} is empty; "
                             f"add files or change data.val_fraction={cfg.val_fraction}")
        arrays[s] = np.memmap(cache / f"{s}.bin", dtype=meta["dtype"], mode="r")
    return TokenData(arrays["train"], arrays["val"], tokenizer.vocab_size)


def batch_starts(n_tokens: int, seq_len: int, batch_size: int, seed: int, step: int,
                 stream: int = 0) -> np.ndarray:
    """The global batch's window starts: a pure function of (seed, step, stream)."""
    if n_tokens <= seq_len + 1:
        raise ValueError(f"the token stream has {n_tokens} tokens, too few for "
                         f"train.seq_len={seq_len}")
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=batch_size)


def get_batch(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, step: int, *,
              stream: int = 0, host_id: int = 0, num_hosts: int = 1) -> dict:
    """This host's rows of the global batch: {'inputs', 'targets'} int32 [B/hosts, S]."""
    if batch_size % num_hosts:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by {num_hosts} hosts")
    starts = batch_starts(len(tokens), seq_len, batch_size, seed, step, stream)
    per_host = batch_size // num_hosts
    mine = starts[host_id * per_host:(host_id + 1) * per_host]
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in mine]).astype(np.int32)
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


TRAIN_STREAM, EVAL_STREAM = 0, 1
