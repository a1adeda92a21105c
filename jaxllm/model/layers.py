"""Building blocks: parameters with logical axes, linear, embedding, RMSNorm, RoPE, SwiGLU.

Every parameter carries logical axis names (see DESIGN.md: batch, seq, embed, q_heads,
kv_heads, head_dim, mlp, vocab, layers, ...). `jaxllm.sharding.rules` maps them onto the
mesh; model code never sees a mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import RopeScaling
from jaxllm.sharding.constrain import constrain, gathered

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(name) -> jnp.dtype:
    return DTYPES[name] if isinstance(name, str) else name


def param(rngs: nnx.Rngs, shape, axes: tuple, dtype, std: float | None = None,
          value: float | None = None) -> nnx.Param:
    """A parameter of `shape` named by logical `axes`: normal(std) init, or constant `value`.

    Sharding is applied from outside (sharding/rules.py), so eager sharding is off here.
    """
    assert len(shape) == len(axes), (shape, axes)
    if value is not None:
        x = jnp.full(shape, value, dtype)
    else:
        x = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(x, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ W with W [*in_shape, *out_shape]; `spec` is the einsum, e.g. 'bsd,dhk->bshk'.

    `out_major=True` stores W as [*out_shape, *in_shape] instead (each output's weights
    contiguous: the layout of the fused decode kernels, kernels/pallas/gemv_triton.py);
    `axes` and `spec` are still given in the [*in, *out] order.
    """

    def __init__(self, in_shape, out_shape, axes, spec: str, *, dtype, param_dtype,
                 rngs: nnx.Rngs | None = None, std: float | None = None, bias: bool = False,
                 init: tuple | None = None, out_major: bool = False):
        """`init`: (kernel, bias or None) arrays to take instead of a random init."""
        n_in = len(in_shape)
        kernel_axes = tuple(axes[n_in:]) + tuple(axes[:n_in]) if out_major else tuple(axes)
        shape = ((tuple(out_shape) + tuple(in_shape)) if out_major
                 else tuple(in_shape) + tuple(out_shape))
        if init is not None:
            kernel, b = init
            assert kernel.shape == shape, (kernel.shape, shape)
            self.kernel = nnx.Param(kernel, out_sharding=kernel_axes, eager_sharding=False)
            self.bias = (None if b is None else
                         nnx.Param(b, out_sharding=tuple(axes[n_in:]), eager_sharding=False))
        else:
            self.kernel = param(rngs, shape, kernel_axes, param_dtype, std=std)
            self.bias = (param(rngs, tuple(out_shape), axes[n_in:], param_dtype, value=0.0)
                         if bias else None)
        if out_major:  # 'bsd,dhk->bshk' -> 'bsd,hkd->bshk'
            x_part, rest = spec.split(",")
            w_part, y_part = rest.split("->")
            spec = f"{x_part},{w_part[n_in:]}{w_part[:n_in]}->{y_part}"
        self.spec, self.dtype, self.out_major = spec, dtype, out_major
        self.in_axes, self.out_axes = tuple(axes[:n_in]), tuple(axes[n_in:])

    def _few_rows(self, x):
        """x (B, S, *in) @ W as one [B*S, K] x [K, N] product when W contracts several
        axes (the output projection's heads x head_dim), for calls with at most 16 rows
        (decoding); None to leave it to the einsum. A profile showed XLA lowering that
        einsum with one row to an elementwise product the size of the weight plus a
        reduction (docs/benchmarks.md); the batch-1 step time did not measurably change
        with this 2-D form.
        """
        n_in = len(self.in_axes)
        if n_in == 1:
            return None
        w = self.kernel[...].astype(self.dtype)
        n_out = w.ndim - n_in
        out_shape = w.shape[:n_out] if self.out_major else w.shape[n_in:]
        b, s = x.shape[:2]
        x2 = x.reshape(b * s, -1).astype(self.dtype)
        y = (jnp.dot(x2, w.reshape(-1, x2.shape[1]).T) if self.out_major
             else jnp.dot(x2, w.reshape(x2.shape[1], -1)))
        return y.reshape(b, s, *out_shape)

    @classmethod
    def fused(cls, parts: list["Linear"], axis: int, axes, spec: str, stack: bool = False,
              out_major: bool = False):
        """One Linear whose kernel joins the kernels of `parts` along kernel axis `axis`
        (concatenated, or stacked on a new axis there; axes counted in the [*in, *out]
        order): the input is read once and all the weights by one matmul. Biases are
        joined the same way. A single part just changes layout (`out_major`)."""
        first, join = parts[0], (jnp.stack if stack else jnp.concatenate)
        kernel = join([p.in_major_kernel() for p in parts], axis=axis)
        n_in = len(first.in_axes)
        bias = (None if first.bias is None else
                join([p.bias[...] for p in parts], axis=axis - n_in))
        if out_major:
            kernel = jnp.moveaxis(kernel, tuple(range(n_in)),
                                  tuple(range(kernel.ndim - n_in, kernel.ndim)))
        in_shape = kernel.shape[kernel.ndim - n_in:] if out_major else kernel.shape[:n_in]
        out_shape = kernel.shape[:kernel.ndim - n_in] if out_major else kernel.shape[n_in:]
        return cls(in_shape, out_shape, axes, spec, dtype=first.dtype,
                   param_dtype=kernel.dtype, init=(kernel, bias), out_major=out_major)

    def in_major_kernel(self):
        """The kernel as [*in, *out], whatever the stored layout."""
        w = self.kernel[...]
        if not self.out_major:
            return w
        n_out = len(self.out_axes)
        return jnp.moveaxis(w, tuple(range(n_out)), tuple(range(w.ndim - n_out, w.ndim)))

    def __call__(self, x):
        y = self._few_rows(x) if x.shape[0] * x.shape[1] <= 16 else None
        if y is None:
            y = jnp.einsum(self.spec, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return constrain(y, ("batch", "seq") + self.out_axes)  # (B, S, *out_shape)


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, *, dtype, param_dtype, rngs, std: float):
        self.embedding = param(rngs, (vocab_size, d_model), ("vocab", "embed"), param_dtype,
                               std=std)
        self.dtype = dtype

    def __call__(self, tokens):  # (B, S) -> (B, S, d)
        table = gathered(self.embedding[...], ("vocab", "embed"))  # FSDP: all-gather first
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        return constrain(x, ("batch", "seq", "embed"))

    def attend(self, x):  # tied output head: (B, S, d) -> (B, S, V) in f32
        logits = jnp.einsum("bsd,vd->bsv", x.astype(self.dtype),
                            self.embedding[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32, returned in the compute dtype."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, rngs):
        self.scale = param(rngs, (dim,), ("embed",), param_dtype, value=1.0)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None
                     ) -> jax.Array:
    """Rotary inverse frequencies (D/2,). `scaling`: model.rope_scaling, or None."""
    inv = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # (D/2,)
    if scaling is None:
        return inv
    # Llama 3.1 ("llama3"): wavelengths longer than original_len / low_freq_factor are
    # stretched by `factor`, those shorter than original_len / high_freq_factor kept, and
    # those between interpolated linearly in original_len / wavelength.
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * jnp.pi / inv
    keep = jnp.clip((scaling.original_max_position_embeddings / wavelength - lo) / (hi - lo),
                    0, 1)
    return (1 - keep) * inv / scaling.factor + keep * inv


def apply_rope(x, positions, theta: float, scaling=None):
    """Rotary embedding, half-split convention. x (B, S, H, D), positions int (B, S)."""
    d = x.shape[-1]
    freqs = rope_frequencies(d, theta, scaling)
    angles = positions[..., None].astype(jnp.float32) * freqs  # (B, S, D/2)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, mlp_dim: int, *, dtype, param_dtype, rngs, std: float,
                 out_std: float):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = Linear((d_model,), (mlp_dim,), ("embed", "mlp"), "bsd,dm->bsm", std=std, **kw)
        self.up = Linear((d_model,), (mlp_dim,), ("embed", "mlp"), "bsd,dm->bsm", std=std, **kw)
        self.down = Linear((mlp_dim,), (d_model,), ("mlp", "embed"), "bsm,md->bsd", std=out_std,
                           **kw)

        self.gate_up = nnx.data(None)  # decode form, see fuse_projections

    def fuse_projections(self, out_major: bool = False):
        """Decode form: gate and up become one [d, 2, mlp] weight, read by one matmul.
        `out_major`: every weight stored [*out, *in], as the fused decode kernels read it."""
        if self.gate_up is None:
            self.gate_up = Linear.fused([self.gate, self.up], 1, ("embed", None, "mlp"),
                                        "bsd,dtm->bstm", stack=True, out_major=out_major)
            self.gate = self.up = None
            if out_major:
                self.down = Linear.fused([self.down], 0, ("mlp", "embed"), "bsm,md->bsd",
                                         out_major=True)
        return self

    def __call__(self, x):
        if self.gate_up is not None:
            y = self.gate_up(x)  # (B, S, 2, mlp)
            return self.down(jax.nn.silu(y[:, :, 0]) * y[:, :, 1])
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
