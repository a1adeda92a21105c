"""One config drives training and generation: frozen dataclasses, YAML, dotted overrides.

    cfg = load_config("configs/tiny.yaml", overrides=["model.n_layers=2", "train.lr=1e-3"])

Unknown keys are errors with a did-you-mean; types are checked; sizes must be positive;
head counts must divide. Nothing is silently clamped or ignored.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "reference", "xla", "cudnn", "pallas_triton", "pallas_mosaic")
DECODE_IMPLS = ("auto", "xla", "pallas_triton")
# model.rope_scaling: the keys each rope_type takes (Llama 3.1 frequency scaling)
ROPE_SCALING_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")}


class ConfigError(ValueError):
    """A config value or key is wrong; the message names it and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 258  # the byte tokenizer: 256 bytes + BOS + EOS
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int | None = None  # default d_model // n_heads
    mlp_dim: int = 512
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", ...} (see ROPE_SCALING_KEYS)
    sliding_window: int | None = None  # attend to the last `sliding_window` keys (Mistral)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_impl: str = "auto"
    decode_impl: str = "auto"  # cached decoding: "auto", "xla" or "pallas_triton"
    dtype: str = "float32"  # compute dtype of matmuls
    param_dtype: str = "float32"
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    remat: str = "full"  # per-block rematerialisation: "none", "full" or "dots"
    max_seq_len: int = 2048  # longest sequence generation may build a cache for
    mtp_depth: int = 0  # multi-token-prediction modules (speculative drafting)
    init_std: float = 0.02

    def __hash__(self):  # rope_scaling is a dict; models keep the config in static metadata
        scaling = tuple(sorted((self.rope_scaling or {}).items()))
        return hash(tuple(getattr(self, f.name) if f.name != "rope_scaling" else scaling
                          for f in dataclasses.fields(self)))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count of the decoder (MTP modules excluded)."""
        d, hd = self.d_model, self.resolved_head_dim
        attn = d * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * d
        layer = attn + 3 * d * self.mlp_dim + 2 * d
        n = self.n_layers * layer + d
        if embeddings:
            n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N_non-embedding + 12 L H D S (attention, no causal halving).

        The LM head matmul is counted as part of N when embeddings are untied.
        """
        n = self.num_params(embeddings=False)
        if not self.tie_embeddings:
            n += self.vocab_size * self.d_model
        attn = 12 * self.n_layers * self.n_heads * self.resolved_head_dim * seq_len
        return 6 * n + attn


@dataclass(frozen=True)
class ParallelismConfig:
    pp: int = 1
    dp: int = -1  # -1 takes the remaining devices
    fsdp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    cp_impl: str = "ring"  # context-parallel attention: "ring" or "allgather"
    sequence_parallel: bool = False  # with tp: norms and residuals split over seq on tp


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


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" (the running interpreter's library source) or a path/glob
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json
    cache_dir: str = ".cache/jaxllm"
    val_fraction: float = 0.02  # fraction of files held out for validation
    jsonl_field: str = "text"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500
    keep: int = 3
    async_save: bool = True
    enabled: bool = True  # False: no checkpoints at all (benchmarks)


@dataclass(frozen=True)
class InferenceConfig:
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    speculative: dict = field(default_factory=lambda: {"method": "none"})
    decode_chunk: int = 16  # tokens decoded on the device between host syncs (streaming)
    unstack_layers: bool = True  # decode with per-layer weight arrays and an unrolled loop
    fuse_projections: bool = True  # with unstack_layers: q/k/v and gate/up weights joined
    # decode-form layers: "xla" matmuls, or "pallas_triton": the fused decode kernels
    # (norm, RoPE, cache write, SwiGLU, residuals inside the weight reads) for 1-row steps;
    # "auto": pallas_triton on a GPU where the model's shapes fit, else xla
    matmul_impl: str = "auto"


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


# ---------------------------------------------------------------------------------------
# Building from dicts, with type checks and did-you-mean errors.


def _did_you_mean(key: str, choices) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(choices)}"


def _coerce(where: str, value: Any, annotation) -> Any:
    """Check `value` against a field annotation (int, float, bool, str, dict, X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
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
    elif annotation is dict or typing.get_origin(annotation) is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    raise ConfigError(f"{where}={value!r} has type {type(value).__name__}; "
                      f"expected {getattr(annotation, '__name__', annotation)}")


def _build_section(cls, name: str, raw: dict) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"config section {name!r} must be a mapping; got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown config key {name}.{key}" + _did_you_mean(key, fields))
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {"model": ModelConfig, "parallelism": ParallelismConfig,
                    "train": TrainConfig, "data": DataConfig,
                    "checkpoint": CheckpointConfig, "inference": InferenceConfig}


def config_from_dict(raw: dict | None) -> Config:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections; got {type(raw).__name__}")
    sections = {}
    for name, value in raw.items():
        if name not in _SECTION_CLASSES:
            raise ConfigError(f"unknown config section {name!r}"
                              + _did_you_mean(name, _SECTION_CLASSES))
        sections[name] = _build_section(_SECTION_CLASSES[name], name, value or {})
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """Apply `section.key=value` strings (values parsed as YAML scalars) to a raw dict."""
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override key {dotted!r} must be section.key, e.g. train.lr")
        section = parts[0]
        if section not in _SECTION_CLASSES:
            raise ConfigError(f"unknown config section {section!r} in override {item!r}"
                              + _did_you_mean(section, _SECTION_CLASSES))
        target = raw.setdefault(section, {})
        for p in parts[1:-1]:  # nested dict fields, e.g. inference.speculative.k=4
            target = target.setdefault(p, {}) if isinstance(target.get(p, {}), dict) else None
            if target is None:
                raise ConfigError(f"override {item!r}: {p!r} is not a mapping")
        target[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply overrides."""
    raw = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():  # a run directory holds its resolved config
            path = path / "config.yaml"
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
    if overrides and "speculative" in raw.get("inference", {}):
        raw["inference"]["speculative"] = dict(raw["inference"]["speculative"])
    return config_from_dict(apply_overrides(raw, overrides))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _validate_rope_scaling(scaling: dict) -> None:
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(f"model.rope_scaling.rope_type={kind!r} is not supported; "
                          f"choose one of {sorted(ROPE_SCALING_KEYS)} (or rope_scaling: null)")
    keys = ROPE_SCALING_KEYS[kind]
    for key in scaling:
        if key != "rope_type" and key not in keys:
            raise ConfigError(f"unknown key model.rope_scaling.{key} for rope_type {kind!r}"
                              + _did_you_mean(key, keys))
    for key in keys:
        v = scaling.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"model.rope_scaling.{key}={v!r} must be a positive number")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"model.rope_scaling.high_freq_factor={scaling['high_freq_factor']} "
                          f"must exceed low_freq_factor={scaling['low_freq_factor']}")


def validate(cfg: Config) -> None:
    m = cfg.model
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim",
                 "max_seq_len"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.head_dim is not None and m.head_dim <= 0:
        raise ConfigError(f"model.head_dim={m.head_dim} must be positive")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by "
                          f"model.n_kv_heads={m.n_kv_heads}")
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by "
                          f"model.n_heads={m.n_heads}; set model.head_dim explicitly")
    if m.resolved_head_dim % 2:
        raise ConfigError(f"head_dim={m.resolved_head_dim} must be even for rotary embeddings")
    if m.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be positive")
    if m.rope_scaling is not None:
        _validate_rope_scaling(m.rope_scaling)
    if m.sliding_window is not None and m.sliding_window <= 0:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be positive "
                          f"(or null for full attention)")
    if m.mtp_depth < 0:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} must be >= 0")
    for name in ("dtype", "param_dtype"):
        if getattr(m, name) not in DTYPES:
            raise ConfigError(f"model.{name}={getattr(m, name)!r} is not a known dtype; "
                              f"choose one of {DTYPES}")
    if m.remat not in ("none", "full", "dots"):
        raise ConfigError(f"model.remat={m.remat!r}; choose 'none', 'full' or 'dots'")
    if m.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(f"model.attention_impl={m.attention_impl!r} is unknown; "
                          f"choose one of {ATTENTION_IMPLS}")
    if m.decode_impl not in DECODE_IMPLS:
        raise ConfigError(f"model.decode_impl={m.decode_impl!r} is unknown; "
                          f"choose one of {DECODE_IMPLS}")

    p = cfg.parallelism
    for name in ("pp", "dp", "fsdp", "ep", "cp", "tp"):
        v = getattr(p, name)
        if v == 0 or v < -1:
            raise ConfigError(f"parallelism.{name}={v} must be positive or -1 (remaining devices)")
    if sum(getattr(p, n) == -1 for n in ("pp", "dp", "fsdp", "ep", "cp", "tp")) > 1:
        raise ConfigError("at most one parallelism axis may be -1")
    if p.cp_impl not in ("ring", "allgather"):
        raise ConfigError(f"parallelism.cp_impl={p.cp_impl!r}; choose 'ring' or 'allgather'")

    t = cfg.train
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1]")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage={t.zero_stage} must be 0, 1, 2 or 3")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")

    d = cfg.data
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must lie in (0, 1)")

    c = cfg.checkpoint
    if c.every <= 0 or c.keep <= 0:
        raise ConfigError(f"checkpoint.every={c.every} and checkpoint.keep={c.keep} must be "
                          f"positive")

    i = cfg.inference
    if i.max_new_tokens <= 0:
        raise ConfigError(f"inference.max_new_tokens={i.max_new_tokens} must be positive")
    if i.temperature < 0:
        raise ConfigError(f"inference.temperature={i.temperature} must be >= 0 (0 is greedy)")
    if i.top_k < 0:
        raise ConfigError(f"inference.top_k={i.top_k} must be >= 0 (0 turns it off)")
    if not 0 < i.top_p <= 1:
        raise ConfigError(f"inference.top_p={i.top_p} must lie in (0, 1]")
    if i.decode_chunk <= 0:
        raise ConfigError(f"inference.decode_chunk={i.decode_chunk} must be positive")
    if i.matmul_impl not in ("auto", "xla", "pallas_triton"):
        raise ConfigError(f"inference.matmul_impl={i.matmul_impl!r} is unknown; choose "
                          f"'auto', 'xla' or 'pallas_triton'")
    speculative_options(cfg)  # raises on a bad inference.speculative


SPECULATIVE_METHODS = ("none", "draft", "mtp")


def speculative_options(cfg: Config) -> tuple[str, int, str | None]:
    """(method, k, draft) of `inference.speculative`, checked, with defaults filled in:
    k = 4 with a draft model, model.mtp_depth with MTP; `draft` is a run directory (or a
    config whose train.run_dir holds checkpoints) of a model with the same vocabulary."""
    spec = dict(cfg.inference.speculative)
    for key in spec:
        if key not in ("method", "k", "draft"):
            raise ConfigError(f"unknown config key inference.speculative.{key}"
                              + _did_you_mean(key, ("method", "k", "draft")))
    method = spec.get("method", "none")
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"inference.speculative.method={method!r} is unknown; choose one of "
                          f"{SPECULATIVE_METHODS}")
    depth = cfg.model.mtp_depth
    if method == "mtp" and depth == 0:
        raise ConfigError("inference.speculative.method='mtp' needs a model trained with MTP "
                          "modules (model.mtp_depth >= 1); or use method 'draft'")
    k = spec.get("k", depth if method == "mtp" else 4)
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ConfigError(f"inference.speculative.k={k!r} must be a positive integer "
                          f"(drafted tokens per step)")
    if method == "mtp" and k > depth:
        raise ConfigError(f"inference.speculative.k={k} exceeds model.mtp_depth={depth}: "
                          f"the MTP modules draft at most {depth} tokens; set k <= {depth}")
    draft = spec.get("draft")
    if method == "draft" and not draft:
        raise ConfigError("inference.speculative.method='draft' needs a draft model: set "
                          "inference.speculative.draft to its run directory or config")
    if draft is not None and not isinstance(draft, str):
        raise ConfigError(f"inference.speculative.draft={draft!r} must be a path (a run "
                          f"directory or a config file)")
    return method, k, draft
