"""Grouped matmul (MoE experts): the pallas_triton kernels (interpret mode on the CPU)
against the jnp reference, forward and the gradients of lhs and rhs; its input checks;
and its lowering for the GPU (the interpreter never sees the Triton lowering rules)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import grouped_matmul, pick
from jaxllm.kernels.pallas import gmm_triton

# 16-row tiles: group 1 (37 rows) spans three tiles, no boundary falls on a tile edge,
# groups 0 and 3 are empty and rows 82..99 are past the last group (zeros, no gradient);
# N = 48 leaves the last 32-column tile of the forward and of d rhs half outside.
SIZES = (0, 37, 5, 0, 40)
M, K, N = 100, 32, 48
TILES = dict(block_m=16, block_n=32, block_k=16, t_block_m=16, t_block_k=16, t_block_n=32)


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((M, K))
    rhs = rng.standard_normal((len(SIZES), K, N)) / np.sqrt(K)
    dout = rng.standard_normal((M, N))
    return (jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(SIZES, jnp.int32),
            jnp.asarray(dout, dtype))


def _out_and_grads(impl, lhs, rhs, sizes, dout, **kw):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, impl=impl, **kw), lhs, rhs)
    return (out, *vjp(dout))


def test_kernel_matches_reference_forward_and_gradients():
    lhs, rhs, sizes, dout = _inputs(jnp.float32)
    got = jax.jit(lambda *a: _out_and_grads("pallas_triton", *a, **TILES))(lhs, rhs, sizes,
                                                                            dout)
    want = jax.jit(lambda *a: _out_and_grads("reference", *a))(lhs, rhs, sizes, dout)
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)
    end = sum(SIZES)
    np.testing.assert_array_equal(got[0][end:], 0.0)  # rows past the sum
    np.testing.assert_array_equal(got[1][end:], 0.0)
    np.testing.assert_array_equal(np.asarray(got[2])[[0, 3]], 0.0)  # empty groups


def test_bfloat16_inputs_with_float32_output():
    lhs, rhs, sizes, _ = _inputs(jnp.bfloat16)
    def fn(impl, **kw):
        return jax.jit(lambda a, b, g: grouped_matmul(
            a, b, g, impl=impl, preferred_element_type=jnp.float32, **kw))(lhs, rhs, sizes)
    got, want = fn("pallas_triton", **TILES), fn("reference")
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-3)


def test_work_items_cover_each_row_once_with_its_group():
    """Every (group, row tile) item covers only rows its group owns, each row exactly
    once, and items past the real ones are marked -1 (the grid's static bound holds)."""
    sizes = jnp.asarray([0, 37, 5, 0, 40, 16, 0], jnp.int32)
    m, bm = 130, 16
    starts, ends = gmm_triton._group_bounds(sizes, m)
    n_items = -(-m // bm) + len(sizes)
    items = jax.jit(gmm_triton._work_items, static_argnums=(2, 3))(starts, ends, bm, n_items)
    group, tile = (np.asarray(x) for x in items)
    starts, ends = np.asarray(starts), np.asarray(ends)
    owner = np.searchsorted(np.cumsum(np.append(np.asarray(sizes), m - sizes.sum())),
                            np.arange(m), side="right")
    seen = np.zeros(m, int)
    for g, t in zip(group, tile):
        if g < 0:
            continue
        rows = np.arange(t * bm, min((t + 1) * bm, m))
        rows = rows[(rows >= starts[g]) & (rows < ends[g])]
        assert rows.size and (owner[rows] == g).all()
        seen[rows] += 1
    np.testing.assert_array_equal(seen, 1)
    assert (group[np.argmax(group < 0):] < 0).all() and (group < 0).any()


def test_work_items_run_no_device_loop():
    """No while loop among the work items' ops: XLA's GPU runtime steps a device loop from
    the host, and a decode step runs three grouped matmuls a layer."""
    starts, ends = gmm_triton._group_bounds(jnp.ones(64, jnp.int32), 70)
    jaxpr = jax.make_jaxpr(gmm_triton._work_items, static_argnums=(2, 3))(starts, ends, 16, 69)
    assert "while" not in str(jaxpr) and "scan" not in str(jaxpr)


def test_row_tiles_follow_the_rows_per_group():
    """16-row tiles for a decode step's few rows per expert; block_m for training's many."""
    assert gmm_triton.tiles(6, 64, 1408) == (16, 256)  # one token, top 6 of 64
    assert gmm_triton.tiles(64 * 6, 64, 2048) == (16, 256)  # 64 tokens: 6 rows an expert
    assert gmm_triton.tiles(1024 * 6, 64, 1408) == (128, 256)  # a 1024-token prefill
    assert gmm_triton.tiles(8 * 2048 * 6, 64, 1408) == (128, 256)  # a training batch
    assert gmm_triton.tiles(100, 5, 48, gmm_triton.BlockSizes(**TILES)) == (16, 32)


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_ffn_with_the_kernel_equals_the_reference(tokens):
    """The MoE layer's dispatch, grouped matmuls and combine with the kernel (as a GPU runs
    the decode program) against the jnp reference, at decode and prefill token counts."""
    from jaxllm.model.moe import expert_ffn
    e, d, f, k = 8, 32, 48, 2
    keys = jax.random.split(jax.random.key(tokens), 6)
    x = jax.random.normal(keys[0], (tokens, d), jnp.float32)
    ids = jax.random.randint(keys[1], (tokens, k), 0, e)
    ids = ids.at[:, 1].set((ids[:, 0] + 1 + ids[:, 1] % (e - 1)) % e)  # distinct per token
    w = jax.random.uniform(keys[2], (tokens, k))
    gate, up = (jax.random.normal(kk, (e, d, f)) / d**0.5 for kk in keys[3:5])
    down = jax.random.normal(keys[5], (e, f, d)) / f**0.5
    run = jax.jit(lambda impl: expert_ffn(x, ids, w, gate, up, down, impl=impl),
                  static_argnums=0)
    np.testing.assert_allclose(run("pallas_triton"), run("reference"), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_value_error():
    lhs, rhs, sizes, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
        grouped_matmul(lhs[:, :16], rhs, sizes, impl="pallas_triton")
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        grouped_matmul(lhs, rhs, sizes.astype(jnp.float32), impl="pallas_triton")
    with pytest.raises(ValueError, match="dtypes differ"):
        grouped_matmul(lhs, rhs.astype(jnp.bfloat16), sizes, impl="pallas_triton")
    with pytest.raises(ValueError, match="N=40 must be multiples of 16"):
        grouped_matmul(lhs, rhs[..., :40], sizes, impl="pallas_triton")
    with pytest.raises(ValueError, match=r"block_m=24 must be a power of two"):
        gmm_triton.grouped_matmul(lhs, rhs, sizes, block_m=24)
    with pytest.raises(ValueError, match=r"unknown pallas_triton options \['block_q'\]"):
        gmm_triton.grouped_matmul(lhs, rhs, sizes, block_q=64)


def test_auto_falls_back_where_the_kernel_cannot_run():
    lhs, rhs, sizes, _ = _inputs(jnp.float32)
    assert pick("gmm", "auto", lhs, rhs[..., :40], sizes).name == "xla"
    assert pick("gmm", "auto", lhs, rhs, sizes).name == (
        "pallas_triton" if jax.default_backend() == "gpu" else "xla")


def test_forward_and_backward_lower_for_the_gpu():
    def loss(lhs, rhs, sizes):
        out = gmm_triton.grouped_matmul(lhs, rhs, sizes, interpret=False)
        return out.astype(jnp.float32).sum()
    shapes = [((200, 64), jnp.bfloat16), ((3, 64, 48), jnp.bfloat16), ((3,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",))
