"""The `model:` section (`ModelConfig`: shape, attention, dtypes, kernels, parameter and FLOP
counts) and its sub-sections (`model.rope_scaling`, `model.mla`, `model.moe`), with the
config's error type and the small value checks every section shares.

`jaxllm.config` builds these from YAML and re-exports every name here; import them from there.
"""
from __future__ import annotations

from dataclasses import dataclass
import typing
from typing import Literal


class ConfigError(ValueError):
    """A config value or key is wrong; the message names it and the fix."""


def _positive(section: str, obj, names) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{section}.{name}={getattr(obj, name)} must be positive")


DType = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["auto", "reference", "xla", "cudnn", "pallas_triton", "pallas_mosaic"]
DecodeImpl = Literal["auto", "xla", "pallas_triton"]
MatmulImpl = Literal["auto", "xla", "pallas_triton"]

DTYPES = typing.get_args(DType)
ATTENTION_IMPLS = typing.get_args(AttentionImpl)
DECODE_IMPLS = typing.get_args(DecodeImpl)
MATMUL_IMPLS = typing.get_args(MatmulImpl)
GmmImpl = Literal["auto", "reference", "xla", "pallas_triton", "pallas_mosaic"]
GMM_IMPLS = typing.get_args(GmmImpl)
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


@dataclass(frozen=True)
class RopeScaling:
    """model.rope_scaling, one of two kinds of long-context frequency scaling.

    "llama3" (Llama 3.1): wavelengths longer than original_max_position_embeddings /
    low_freq_factor are stretched by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor are kept.
    "yarn" (YaRN, as DeepSeek and transformers define it): frequencies that turn fewer than
    beta_slow times over original_max_position_embeddings are divided by `factor`, those
    turning more than beta_fast times are kept, a linear ramp between; cos and sin are
    multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and MLA's softmax
    scale by mscale(factor, mscale_all_dim)^2, with mscale(s, m) = 0.1 m ln(s) + 1 (1 for
    s <= 1). Unset yarn fields take transformers' defaults (32, 1, 1, 0); each kind takes
    only its own fields.
    """
    rope_type: Literal["llama3", "yarn"]
    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        own = (("low_freq_factor", "high_freq_factor") if self.rope_type == "llama3"
               else tuple(_YARN_DEFAULTS))
        other = [n for n in ("low_freq_factor", "high_freq_factor", *_YARN_DEFAULTS)
                 if n not in own and getattr(self, n) is not None]
        if other:
            raise ConfigError(f"model.rope_scaling.rope_type={self.rope_type!r} takes no "
                              f"{', '.join(other)}; delete them or change rope_type")
        required = (*own, "factor", "original_max_position_embeddings")
        missing = [n for n in required if self.resolved(n) is None]
        if missing:
            raise ConfigError(f"model.rope_scaling ({self.rope_type}) lacks "
                              f"{', '.join(missing)}")
        for name in required:
            value, at_least = self.resolved(name), ("0" if name.startswith("mscale") else "")
            if value < 0 or value == 0 and not at_least:
                raise ConfigError(f"model.rope_scaling.{name}={value!r} must be "
                                  + ("at least 0" if at_least else "a positive number"))
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} "
                              f"must exceed low_freq_factor={self.low_freq_factor}")
        if self.rope_type == "yarn" and self.resolved("beta_fast") <= self.resolved("beta_slow"):
            raise ConfigError(f"model.rope_scaling.beta_fast={self.resolved('beta_fast')} must "
                              f"exceed beta_slow={self.resolved('beta_slow')}")

    def resolved(self, name: str) -> float:
        """A field's value, yarn's defaults filled in."""
        value = getattr(self, name)
        return _YARN_DEFAULTS[name] if value is None and self.rope_type == "yarn" else value


@dataclass(frozen=True)
class MLAConfig:
    """model.mla, multi-head latent attention (DeepSeek-V2/V3). Queries: x -> q_lora_rank
    (RMSNorm) -> per head [nope | rope], or x -> per head directly (q_lora_rank 0 / null).
    Keys and values: x -> [latent (kv_lora_rank, RMSNorm) | k_rope (qk_rope_head_dim, one
    for all heads)], the latent -> per head [k_nope (qk_nope_head_dim) | v (v_head_dim)].
    Decoding caches kv_lora_rank + qk_rope_head_dim values per token and layer."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self):
        _positive("model.mla", self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                      "v_head_dim"))
        if self.q_lora_rank is not None and self.q_lora_rank < 0:
            raise ConfigError(f"model.mla.q_lora_rank={self.q_lora_rank} must be positive, or "
                              f"0 / null for full-rank queries")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be "
                              f"even for rotary embeddings")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def num_params(self, d_model: int, n_heads: int) -> int:
        """Parameters of one MLA layer, its two latent norms included."""
        ql, r = self.q_lora_rank, self.kv_lora_rank
        q_out = n_heads * self.qk_head_dim
        q = d_model * ql + ql + ql * q_out if ql else d_model * q_out
        kv = d_model * self.latent_dim + r + r * n_heads * (self.qk_nope_head_dim
                                                             + self.v_head_dim)
        return q + kv + n_heads * self.v_head_dim * d_model


@dataclass(frozen=True)
class MoEConfig:
    """model.moe, mixture-of-experts feed-forward blocks (DeepSeek-V3, Qwen3-MoE, Mixtral).

    Each token goes through the `top_k` of `num_experts` routed SwiGLU experts (width
    `expert_mlp_dim`) its router picks, weighted by the router's scores, plus the dense
    SwiGLU of `num_shared_experts` x expert_mlp_dim that every token takes (DeepSeek). The
    first `dense_layers` layers keep the dense MLP of model.mlp_dim. With n_groups > 1 the
    experts fall into groups and a token picks among the `topk_groups` groups of highest
    summed top-2 scores (DeepSeek-V3's group-limited routing). Balancing: "aux_loss" adds
    aux_loss_weight x the Switch load-balancing loss to the objective; "bias" adds a
    per-expert bias to the scores for choosing (not weighting) experts and moves it by
    bias_update_rate x sign(mean load - load) after every step (DeepSeek-V3's
    auxiliary-loss-free balancing); "none" does neither. `gmm_impl` picks the grouped-matmul
    kernel of the routed experts (`kernels.grouped_matmul`; "auto": the fastest that runs).
    """
    num_experts: int
    top_k: int
    expert_mlp_dim: int
    num_shared_experts: int = 0
    router: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0  # factor on the routed experts' weights
    dense_layers: int = 0
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_weight: float = 0.01
    bias_update_rate: float = 1e-3
    gmm_impl: GmmImpl = "auto"

    def __post_init__(self):
        w = "model.moe"
        _positive(w, self, ("num_experts", "top_k", "expert_mlp_dim", "n_groups",
                            "topk_groups", "routed_scaling"))
        for name in ("num_shared_experts", "dense_layers", "aux_loss_weight",
                     "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{w}.{name}={getattr(self, name)} must be >= 0")
        if self.top_k > self.num_experts:
            raise ConfigError(f"{w}.top_k={self.top_k} exceeds {w}.num_experts="
                              f"{self.num_experts}; choose top_k <= num_experts")
        if self.num_experts % self.n_groups:
            raise ConfigError(f"{w}.n_groups={self.n_groups} does not divide {w}.num_experts="
                              f"{self.num_experts}; choose a divisor")
        if self.topk_groups > self.n_groups:
            raise ConfigError(f"{w}.topk_groups={self.topk_groups} exceeds {w}.n_groups="
                              f"{self.n_groups}")
        reachable = self.topk_groups * (self.num_experts // self.n_groups)
        if self.top_k > reachable:
            raise ConfigError(f"{w}.top_k={self.top_k} exceeds the {reachable} experts of the "
                              f"topk_groups={self.topk_groups} chosen groups; raise "
                              f"{w}.topk_groups or lower top_k")
        if self.balance == "bias" and self.bias_update_rate == 0:
            raise ConfigError(f"{w}.balance='bias' needs {w}.bias_update_rate > 0; or choose "
                              f"balance 'none'")


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
    rope_scaling: RopeScaling | None = None
    attention: Literal["gqa", "mla"] = "gqa"  # mla: multi-head latent attention, model.mla
    mla: MLAConfig | None = None
    sliding_window: int | None = None  # attend to the last `sliding_window` keys (Mistral)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_impl: AttentionImpl = "auto"
    decode_impl: DecodeImpl = "auto"  # attention of cached decoding
    dtype: DType = "float32"  # compute dtype of matmuls
    param_dtype: DType = "float32"
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head before RoPE (Qwen3)
    remat: Literal["none", "full", "dots"] = "full"  # per-block rematerialisation
    # the scan over the layer stack unrolled in the compiled step (model/decoder.py): faster
    # on GPUs, compile time growing with depth; the planner counts its memory apart
    # (plan/unrolled.py: outside a pipeline, without MTP modules)
    unroll_layers: bool = False
    max_seq_len: int = 2048  # longest sequence generation may build a cache for
    mtp_depth: int = 0  # multi-token-prediction modules (speculative drafting)
    init_std: float = 0.02
    moe: MoEConfig | None = None  # mixture-of-experts feed-forward blocks

    def __post_init__(self):
        _positive("model", self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                  "mlp_dim", "max_seq_len"))
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError(f"model.head_dim={self.head_dim} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} is not divisible by "
                              f"model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by "
                              f"model.n_heads={self.n_heads}; set model.head_dim explicitly")
        if self.resolved_head_dim % 2:
            raise ConfigError(f"head_dim={self.resolved_head_dim} must be even for rotary "
                              f"embeddings")
        if self.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model.sliding_window={self.sliding_window} must be positive "
                              f"(or null for full attention)")
        if self.mtp_depth < 0:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} must be >= 0")
        if (self.attention == "mla") != (self.mla is not None):
            raise ConfigError(f"model.attention={self.attention!r} "
                              + ("needs a model.mla section (kv_lora_rank, qk_nope_head_dim, "
                                 "qk_rope_head_dim, v_head_dim)" if self.mla is None else
                                 "takes no model.mla section; set model.attention=mla or "
                                 "delete model.mla"))
        if self.mla is not None:
            unused = [f"{n}={getattr(self, n)}" for n, off in (
                ("n_kv_heads", self.n_heads), ("head_dim", None), ("qkv_bias", False),
                ("qk_norm", False), ("sliding_window", None)) if getattr(self, n) != off]
            if unused:
                raise ConfigError(f"model.attention='mla' sets its own head shapes (model.mla) "
                                  f"and takes no {', '.join(unused)}: set n_kv_heads = n_heads"
                                  f" and leave the others unset")

        if self.moe is not None and self.moe.dense_layers >= self.n_layers:
            raise ConfigError(f"model.moe.dense_layers={self.moe.dense_layers} leaves no MoE "
                              f"layer of model.n_layers={self.n_layers}; lower it or drop "
                              f"model.moe")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def _layer_params(self, moe: bool, active: bool) -> int:
        """One block: attention (GQA or MLA), the dense SwiGLU or, with `moe`, the router,
        the routed experts (`active`: top_k of them) and the shared ones; two norms."""
        d, hd = self.d_model, self.resolved_head_dim
        attn = d * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * d
        if self.mla is not None:
            attn = self.mla.num_params(d, self.n_heads)
        if not moe:
            return attn + 3 * d * self.mlp_dim + 2 * d
        m = self.moe
        routed = (m.top_k if active else m.num_experts) * 3 * d * m.expert_mlp_dim
        shared = 3 * d * m.num_shared_experts * m.expert_mlp_dim
        return attn + d * m.num_experts + routed + shared + 2 * d

    def num_params(self, *, embeddings: bool = True, active: bool = False) -> int:
        """Parameter count of the decoder (MTP modules excluded: `mtp_params`); `active`:
        those one token uses, its top_k routed experts of each MoE layer instead of all."""
        n_moe = 0 if self.moe is None else self.n_layers - self.moe.dense_layers
        n = (self.n_layers - n_moe) * self._layer_params(False, active) + self.d_model
        if n_moe:
            n += n_moe * self._layer_params(True, active)
        if embeddings:
            n += self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return n

    def mtp_params(self, *, active: bool = False) -> int:
        """Parameters of the `mtp_depth` MTP modules (model/mtp.py): each its two input norms,
        the projection [2d -> d], one block of the main layers' kind (MoE in an MoE model)
        and its final norm; they share the main model's embedding and head."""
        d = self.d_model
        block = self._layer_params(self.moe is not None, active)
        return self.mtp_depth * (3 * d + 2 * d * d + block)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N_non-embedding + 12 L H D S (attention, no causal halving;
        with MLA 6 L H (D_qk + D_v) S: scores over the query-key dim, values over D_v).

        N counts active parameters (an MoE token runs its top_k experts only); the LM head
        matmul is counted as part of N when embeddings are untied. MTP modules (trained
        beside the model) add their active parameters and one head matmul each to N and
        their blocks to L.
        """
        n = self.num_params(embeddings=False, active=True) + self.mtp_params(active=True)
        heads = 1 + self.mtp_depth
        if not self.tie_embeddings:
            n += heads * self.vocab_size * self.d_model
        dims = (2 * self.resolved_head_dim if self.mla is None
                else self.mla.qk_head_dim + self.mla.v_head_dim)
        attn = 6 * (self.n_layers + self.mtp_depth) * self.n_heads * dims * seq_len
        return 6 * n + attn
