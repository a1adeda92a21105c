"""One config drives training and generation: frozen dataclasses, YAML, dotted overrides.

    cfg = load_config("configs/tiny.yaml", overrides=["model.n_layers=2", "train.lr=1e-3"])

Sections are frozen dataclasses, some with nested ones (`inference.speculative`,
`model.rope_scaling`, `model.mla`, `model.moe`), built from YAML mappings by one generic
builder: unknown keys are errors with a did-you-mean, types are checked (a `Literal` field
takes one of its values), each section checks its own values when built, and `Config.check`
the ones that span sections. Nothing is silently clamped or ignored.
The `model:` section (`ModelConfig` and its sub-sections) and `ConfigError` live in
`config_model.py`; they are re-exported here.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxllm.config_model import (ATTENTION_IMPLS, DECODE_IMPLS, DTYPES,  # noqa: F401
                                 MATMUL_IMPLS, AttentionImpl, ConfigError, DecodeImpl, DType,
                                 MatmulImpl, MLAConfig, ModelConfig, MoEConfig, RopeScaling,
                                 _positive)



@dataclass(frozen=True)
class ParallelismConfig:
    pp: int = 1
    dp: int = -1  # -1 takes the remaining devices
    fsdp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    cp_impl: Literal["ring", "allgather"] = "ring"  # context-parallel attention
    sequence_parallel: bool = False  # with tp: norms and residuals split over seq on tp
    pp_schedule: Literal["gpipe", "circular", "1f1b"] = "1f1b"  # sharding/pipeline.py
    pp_repeats: int = 1  # stages per device (circular)

    def __post_init__(self):
        axes = ("pp", "dp", "fsdp", "ep", "cp", "tp")
        for name in axes:
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ConfigError(f"parallelism.{name}={v} must be positive or -1 "
                                  f"(remaining devices)")
        if sum(getattr(self, n) == -1 for n in axes) > 1:
            raise ConfigError("at most one parallelism axis may be -1")
        if self.pp_repeats < 1:
            raise ConfigError(f"parallelism.pp_repeats={self.pp_repeats} must be positive")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # global, in sequences
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    run_dir: str = "runs/default"
    seed: int = 0
    zero_stage: int = 0
    mtp_weight: float = 0.3
    distill_from: str | None = None  # a run directory: KL(its logits || ours) replaces CE
    progress: bool = True  # rich progress bar
    microbatches: int = 1  # pipeline parallelism: the batch in this many microbatches

    def __post_init__(self):
        _positive("train", self, ("steps", "batch_size", "seq_len", "log_every", "eval_every",
                                  "eval_batches", "lr", "microbatches"))
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" (the running interpreter's library source) or a path/glob
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json
    cache_dir: str = ".cache/jaxllm"
    val_fraction: float = 0.02  # fraction of files held out for validation
    jsonl_field: str = "text"

    def __post_init__(self):
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must lie in (0, 1)")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500
    keep: int = 3
    async_save: bool = True
    enabled: bool = True  # False: no checkpoints at all (benchmarks)

    def __post_init__(self):
        if self.every <= 0 or self.keep <= 0:
            raise ConfigError(f"checkpoint.every={self.every} and checkpoint.keep={self.keep} "
                              f"must be positive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """inference.speculative: draft `k` tokens a step ("draft": with the model at `draft`,
    a run directory or a config whose train.run_dir holds checkpoints, of the same
    vocabulary; "mtp": with the model's MTP modules) and verify them in one target step."""
    method: Literal["none", "draft", "mtp"] = "none"
    k: int | None = None  # default: model.mtp_depth with "mtp", 4 with "draft"
    draft: str | None = None

    def __post_init__(self):
        if self.k is not None and self.k <= 0:
            raise ConfigError(f"inference.speculative.k={self.k!r} must be a positive integer "
                              f"(drafted tokens per step)")
        if self.method == "draft" and not self.draft:
            raise ConfigError("inference.speculative.method='draft' needs a draft model: set "
                              "inference.speculative.draft to its run directory or config")

    def resolved_k(self, mtp_depth: int) -> int:
        """Drafted tokens per step: `k`, or its default for the method."""
        if self.k is not None:
            return self.k
        return mtp_depth if self.method == "mtp" else 4


@dataclass(frozen=True)
class EngineConfig:
    """inference.engine: the serving engine (inference/engine.py) and its paged KV cache."""
    page_size: int = 16  # tokens per KV page
    # pages in the pool; 0: as many as `memory_fraction` of the device's free memory holds
    # after the weights (on the CPU, enough for max_num_seqs full-length sequences)
    num_pages: int = 0
    memory_fraction: float = 0.8
    max_num_seqs: int = 64  # sequences in one step (the step's row buckets go up to it)
    max_num_batched_tokens: int = 2048  # the per-step token budget (prefill is chunked by it)
    prefix_caching: bool = True  # reuse full KV pages of a shared prompt prefix
    max_waiting: int = 1024  # queued requests beyond which new ones are refused (HTTP 429)
    # decode steps run on the device in one call when every running request is decoding and
    # no waiting one can be admitted (the host schedules once for them); 1: one step a call
    decode_window: int = 8

    def __post_init__(self):
        _positive("inference.engine", self, ("page_size", "max_num_seqs",
                                             "max_num_batched_tokens", "max_waiting",
                                             "decode_window"))
        if self.num_pages < 0:
            raise ConfigError(f"inference.engine.num_pages={self.num_pages} must be >= 0 "
                              f"(0 sizes the pool from free memory)")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"inference.engine.memory_fraction={self.memory_fraction} must "
                              f"lie in (0, 1]")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"inference.engine.max_num_batched_tokens="
                              f"{self.max_num_batched_tokens} must be >= max_num_seqs="
                              f"{self.max_num_seqs} (every running sequence gets a token a step)")


@dataclass(frozen=True)
class InferenceConfig:
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    decode_chunk: int = 16  # tokens decoded on the device between host syncs (streaming)
    # decode-step matmuls: "xla", or "pallas_triton": the fused decode kernels (norm, RoPE,
    # cache write, SwiGLU, residuals inside the weight reads) for 1-row steps;
    # "auto": pallas_triton on a GPU where the model's shapes fit, else xla
    matmul_impl: MatmulImpl = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        _positive("inference", self, ("max_new_tokens", "decode_chunk"))
        if self.temperature < 0:
            raise ConfigError(f"inference.temperature={self.temperature} must be >= 0 "
                              f"(0 is greedy)")
        if self.top_k < 0:
            raise ConfigError(f"inference.top_k={self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"inference.top_p={self.top_p} must lie in (0, 1]")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)

    def check(self) -> None:
        """The checks that span sections (each section checks its own values when built).
        Not run on construction: code builds partial configs, e.g. Config(model=m)."""
        m, t, spec = self.model, self.train, self.inference.speculative
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds "
                              f"model.max_seq_len={m.max_seq_len}")
        if spec.method == "mtp":
            depth = m.mtp_depth
            if depth == 0:
                raise ConfigError("inference.speculative.method='mtp' needs a model trained "
                                  "with MTP modules (model.mtp_depth >= 1); or use method "
                                  "'draft'")
            if spec.resolved_k(depth) > depth:
                raise ConfigError(f"inference.speculative.k={spec.k} exceeds "
                                  f"model.mtp_depth={depth}: the MTP modules draft at most "
                                  f"{depth} tokens; set k <= {depth}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


# ---------------------------------------------------------------------------------------
# Building from dicts, with type checks and did-you-mean errors.

# keys that were removed, with what replaced them (a config of an older run names them)
_REMOVED = {"inference.unstack_layers": "decoding always uses per-layer weights",
            "inference.fuse_projections": "decoding always joins q/k/v and gate/up"}


def _close_match(word, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _did_you_mean(key: str, choices) -> str:
    return _close_match(key, choices) or f"; valid keys: {sorted(choices)}"


def _coerce(where: str, value: Any, annotation) -> Any:
    """Check `value` against a field annotation: bool, int, float, str, a Literal, a
    dataclass (a nested section, built from a mapping), or X | None."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise ConfigError(f"{where}={value!r} is unknown (not a known {where.split('.')[-1]}); "
                          f"choose one of {choices}" + _close_match(value, choices))
    if dataclasses.is_dataclass(annotation):
        return _build_section(annotation, where, value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{where}: no config builder for the annotation {annotation!r}")
    raise ConfigError(f"{where}={value!r} has type {type(value).__name__}; "
                      f"expected {annotation.__name__}")


def _build_section(cls, where: str, raw: dict | None) -> Any:
    """An instance of the dataclass `cls` from a mapping (None: the defaults); `where` is
    its dotted place in the config ("" for the whole config)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config section {where!r} must be a mapping; got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{where}.{key}" if where else key
        if key not in fields:
            if dotted in _REMOVED:
                raise ConfigError(f"{dotted} was removed ({_REMOVED[dotted]}); delete it "
                                  f"from the config")
            unknown = f"config key {dotted}" if where else f"config section {key!r}"
            raise ConfigError(f"unknown {unknown}" + _did_you_mean(key, fields))
        kwargs[key] = _coerce(dotted, value, hints[key])
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; set every one of "
                          f"{list(fields)}")
    return cls(**kwargs)


def config_from_dict(raw: dict | None) -> Config:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections; got {type(raw).__name__}")
    cfg = _build_section(Config, "", raw)
    cfg.check()
    return cfg


_SECTIONS = {f.name for f in dataclasses.fields(Config)}


def apply_overrides(raw: dict | None, overrides: list[str] | None) -> dict:
    """Apply `section.key=value` strings (values parsed as YAML scalars) to a copy of a raw
    dict; keys of nested sections have more dots: `inference.speculative.k=2`."""
    raw = copy.deepcopy(raw or {})
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections; got {type(raw).__name__}")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override key {dotted!r} must be section.key, e.g. train.lr")
        if parts[0] not in _SECTIONS:
            raise ConfigError(f"unknown config section {parts[0]!r} in override {item!r}"
                              + _did_you_mean(parts[0], _SECTIONS))
        target = raw
        for p in parts[:-1]:  # a null (or absent) section starts empty
            if target.get(p) is None:
                target[p] = {}
            target = target[p]
            if not isinstance(target, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a mapping")
        target[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply overrides."""
    raw = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():  # a run directory holds its resolved config
            if not (path / "config.yaml").is_file():
                raise ConfigError(f"{str(path)!r} is a directory without config.yaml: not a "
                                  f"run directory; give a YAML config file or a trained run")
            path = path / "config.yaml"
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
    return config_from_dict(apply_overrides(raw, overrides))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
