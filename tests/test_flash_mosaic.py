"""Pallas FlashAttention (Mosaic GPU lowering) against the jnp reference: forward, LSE, gradients.

On the CPU the kernels run in JAX's Mosaic GPU simulator, which runs the warpgroups as
threads and checks the TMA copies and barriers (every phase observed, no slot reused
early). Its wgmma takes neither register operands nor transposed shared-memory refs, so
there the matmuls read their operands and multiply them as arrays; everything else is
the code that runs on the GPU. The simulator is slow: four small shapes cover causal
and full, Sq < Skv and Sq > Skv (rows that see no key), ragged tails, GQA 1 and 2 and
D 64, 128 and 256 (dK and dV split over two warpgroups by columns; full attention at D
256 too); two more the persistent grid with several tiles a program and the
one-tile-a-CTA, one-product-at-a-time paths; the full-mask default at D 128, a single
key tile and an odd number of query tiles run forward-only on small shapes. The GPU-only
cases run long sequences with the default tiles.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_inputs import flash_inputs
from jaxllm.kernels import flash_attention, reference
from jaxllm.kernels.pallas import flash_mosaic, flash_mosaic_fwd
from jaxllm.kernels.pallas import mosaic_common as mg


def _is_hopper():
    if jax.default_backend() != "gpu":
        return False
    try:
        return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0
    except ValueError:
        return False


hopper_only = pytest.mark.skipif(not _is_hopper(), reason="the compiled kernels need a Hopper GPU")


def _check(b, sq, skv, hq, hkv, d, causal, tol, seed=0, dv=None, **opts):
    dtype = jnp.bfloat16
    q, k, v, do, dlse, seen = flash_inputs(seed, b, sq, skv, hq, hkv, d, causal, dtype, dv=dv)
    kern = functools.partial(flash_mosaic.flash_attention_with_lse, causal=causal, **opts)
    (o, lse), vjp = jax.vjp(kern, q, k, v)
    grads = vjp((do, dlse))
    with jax.default_matmul_precision("highest"):
        ref = functools.partial(reference.flash_attention_with_lse, causal=causal)
        (o_ref, lse_ref), vjp_ref = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
        grads_ref = vjp_ref((do.astype(jnp.float32), dlse))

    assert o.dtype == dtype and lse.dtype == jnp.float32 and lse.shape == (b, hq, sq)
    assert o.shape == (b, sq, hq, v.shape[-1])
    o32 = o.astype(jnp.float32)
    np.testing.assert_allclose(o32[:, seen], o_ref[:, seen], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[:, :, seen], lse_ref[:, :, seen], atol=tol, rtol=tol)
    if not seen.all():
        np.testing.assert_array_equal(o32[:, ~seen], 0.0)
        assert np.isneginf(np.asarray(lse[:, :, ~seen])).all()
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == dtype and g.shape == g_ref.shape, name
        scale = float(jnp.abs(g_ref).max())
        # numpy's max, which keeps NaN (XLA's CPU reduction can drop it)
        err = float(np.abs(np.asarray(g, np.float32) - np.asarray(g_ref)).max())
        assert err <= tol * max(1.0, scale), f"d{name}: max error {err} (scale {scale})"


# (b, sq, skv, hq, hkv, d, causal). Key tiles of 64 give several tiles per stream; the
# 128-row query tile splits into the two warpgroups' 64-row slabs.
CPU_CASES = [
    # causal, Sq < Skv, GQA 2: a tile below the diagonal (no mask) and one crossing it;
    # the second slab is all padded query rows.
    (1, 64, 128, 2, 1, 64, True),
    # causal, Sq > Skv with ragged lengths: 30 rows see no key; padded keys and queries;
    # one slab skips a key tile the other needs.
    (1, 100, 70, 1, 1, 128, True),
    # full attention, ragged key tail.
    (1, 70, 120, 1, 1, 64, False),
    # D 256: dK and dV split over two warpgroups by columns, causal, GQA 2,
    # masked and unmasked query tiles; 3 key tiles: a CTA runs tiles 0 and 2, one tile 1.
    (1, 64, 192, 2, 1, 256, True),
]


def _case_id(c):
    return "sq{1}_skv{2}_hq{3}_hkv{4}_d{5}_".format(*c) + ("causal" if c[6] else "full")


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_matches_reference(case):
    *shape, causal = case
    _check(*shape, causal=causal, tol=2e-2, block_kv=64)


@pytest.mark.parametrize("shape, causal, opts", [
    # persistent forward and dq: 6 causal tiles over the simulator's 2 programs, so a
    # program runs three back to back (ring and Q buffers carried over); dk/dv: 3 tiles
    # of 128 keys, the first and last run by one CTA, their streams one after the other
    ((1, 256, 320, 3, 1, 64), True, dict(persistent_dq=True)),
    # one CTA a tile, each product awaited before the next (the non-default paths)
    ((1, 70, 120, 1, 1, 64), False, dict(persistent=False, persistent_dq=False,
                                         overlap_bwd=False)),
    # D 256 (dk/dv split over two warpgroups, halves exchanged through shared memory),
    # full attention with ragged tails
    ((1, 70, 120, 1, 1, 256), False, {})],
    ids=["persistent_causal_gqa3", "plain_full", "d256_full_ragged"])
def test_grid_and_backward_options(shape, causal, opts):
    _check(*shape, causal=causal, tol=2e-2, block_kv=64, **opts)


@pytest.mark.parametrize("opts, causal, d, sq, skv", [
    # the default full-mask schedule at D = 128 (overlapped, no ping-pong), ragged keys
    (dict(block_kv=64), False, 128, 128, 120),
    # the default 128-key tiles over 100 keys: one tile, a stream shorter than the ring
    ({}, True, 128, 64, 100),
    # 3 query tiles over 2 persistent programs: one runs two, the other one
    (dict(block_kv=64), True, 64, 384, 400),
    # 192-key tiles: 3 query tiles over 2 persistent programs with one Q buffer (two
    # do not fit in shared memory beside the ring)
    (dict(block_kv=192), False, 128, 384, 400),
    # D 192 / Dv 128 with a 2-deep ring: Q double-buffered beside O's own tiles, 3 query
    # tiles over 2 persistent programs
    (dict(num_stages=2, dv=128), True, 192, 384, 400)],
    ids=["default_full_d128", "one_key_tile", "persistent_odd_tiles", "kv192_one_q_buffer",
         "mla_two_q_buffers"])
def test_forward_paths(opts, causal, d, sq, skv):
    # Forward only; the simulator checks the ring's barriers (both slabs, a tile only one
    # of them sees, masked and unmasked tiles).
    b, hq, hkv = 1, 1, 1
    opts = dict(opts)
    q, k, v, *_ = flash_inputs(3, b, sq, skv, hq, hkv, d, causal, jnp.bfloat16,
                               dv=opts.pop("dv", None))
    o, lse = flash_mosaic.flash_attention_with_lse(q, k, v, causal=causal, **opts)
    with jax.default_matmul_precision("highest"):
        o_ref, lse_ref = reference.flash_attention_with_lse(
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
    np.testing.assert_allclose(o.astype(jnp.float32), o_ref, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, lse_ref, atol=2e-2, rtol=2e-2)


# MLA's head dims: D 192 (three 64-column chunks for Q K^T) with Dv 128, the default
# configs (64-key tiles, a 3-deep ring, O staged in its own tiles).
MLA_CASES = [
    # full attention (the overlapped schedule), ragged query and key tails
    ((1, 70, 150, 1, 1), False),
    # causal, 3 query tiles over the simulator's 2 persistent programs: one program
    # stages two tiles' O in the same tiles; Sq > Skv, 30 rows see no key
    ((1, 330, 300, 1, 1), True),
]


@pytest.mark.parametrize("shape, causal", MLA_CASES,
                         ids=["full_ragged", "causal_persistent"])
def test_mla_head_dims_match_reference(shape, causal):
    _check(*shape, 192, causal=causal, tol=2e-2, dv=128)


def test_non_positive_scale():
    # sm_scale <= 0 (scores scaled before masking, -inf kept -inf; fixed_max, the default,
    # then gives way to the running max): forward and LSE as the reference's, causal
    # over a ragged key tail
    q, k, v, *_ = flash_inputs(9, 1, 64, 100, 1, 1, 64, True, jnp.bfloat16)
    for sm_scale in (-0.125, 0.0):
        o, lse = flash_mosaic.flash_attention_with_lse(q, k, v, causal=True, sm_scale=sm_scale,
                                                       block_kv=64)
        with jax.default_matmul_precision("highest"):
            o_ref, lse_ref = reference.flash_attention_with_lse(
                *(x.astype(jnp.float32) for x in (q, k, v)), causal=True, sm_scale=sm_scale)
        np.testing.assert_allclose(o.astype(jnp.float32), o_ref, atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(lse, lse_ref, atol=2e-2, rtol=2e-2)


def _outgrowing_inputs(b, sq, skv, hq, d, causal, seed=7, hot=(128, 256)):
    """Inputs where the query rows hot[0]:hot[1] score the first 64 keys some 45 nats
    below the rest (130 in log2 units): shifted by their first key tile's max, their
    later terms would overflow float32. The other rows are plain random ones."""
    q, k, v, *_, seen = flash_inputs(seed, b, sq, skv, hq, 1, d, causal, jnp.bfloat16)
    u = jnp.ones((d,), jnp.float32) / np.sqrt(d)  # unit vector
    gain = np.sqrt(90.0 * np.sqrt(d) / 2)  # (gain u) . (+-gain u) * d^-0.5 = +-45
    qf = q.astype(jnp.float32).at[:, hot[0]:hot[1]].add(gain * u)
    kf = k.astype(jnp.float32).at[:, :64].add(-gain * u).at[:, 64:].add(gain * u)
    return qf.astype(jnp.bfloat16), kf.astype(jnp.bfloat16), v, seen


@pytest.mark.parametrize("opts, causal", [
    (dict(block_kv=64), True),  # the chained ping-pong
    (dict(block_kv=64, schedule="overlapped"), False)],
    ids=["pingpong_causal", "overlapped_full"])
def test_fixed_max_runs_outgrown_tiles_again(opts, causal, monkeypatch):
    # fixed_max: 3 query tiles of 128 rows over the simulator's 2 persistent programs;
    # the middle tile's rows outgrow their first key tile's max by 130 (log2 units), so
    # that tile runs a second time with the running max once its program is done.
    sq, skv, d = 384, 256, 64
    q, k, v, seen = _outgrowing_inputs(1, sq, skv, 1, d, causal)
    fixed = functools.partial(flash_mosaic.flash_attention_with_lse, q, k, v, causal=causal,
                              fixed_max=True, **opts)
    o, lse = fixed()
    with jax.default_matmul_precision("highest"):
        o_ref, lse_ref = reference.flash_attention_with_lse(
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
    o32 = np.asarray(o, np.float32)
    np.testing.assert_allclose(o32[:, seen], o_ref[:, seen], atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse[:, :, seen], lse_ref[:, :, seen], atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(o32[:, ~seen], 0.0)
    assert np.isneginf(np.asarray(lse[:, :, ~seen])).all()
    # without the second pass those rows are lost (so the case above needed it); the
    # inputs overflow the same way under either schedule, so one shows it
    if causal:
        return
    monkeypatch.setattr(flash_mosaic_fwd, "FIXED_MAX_SUM_LIMIT", float("inf"))
    o_once, lse_once = fixed()
    hot = np.zeros(sq, bool)
    hot[128:256] = True
    assert not np.isfinite(np.asarray(lse_once)[:, :, hot & seen]).all()
    np.testing.assert_allclose(np.asarray(o_once, np.float32)[:, ~hot & seen],
                               o_ref[:, ~hot & seen], atol=2e-2, rtol=2e-2)


def test_dkdv_grid_launches_key_tiles_together_and_pairs_causal_ones():
    """Key tiles are the fastest block index (the grid's last axis); a causal CTA runs two
    (tiles j and n - 1 - j, the middle one alone: the simulator cases cover odd counts)."""
    from jaxllm.kernels.pallas import flash_mosaic_bwd as bwd
    for n_kt, causal, ctas in [(32, True, 16), (7, True, 4), (1, True, 1), (7, False, 7)]:
        grid, names = bwd.dkdv_grid(4, 8, n_kt, causal)
        assert dict(zip(names, grid)) == dict(batch=4, heads=8, kv_seq=ctas)
        assert names[-1] == "kv_seq"


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "grid"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n_t, heads, batch, sms", [(7, 3, 2, 5), (4, 2, 1, 3), (6, 1, 1, 8),
                                                    (5, 4, 3, 132), (12, 5, 3, 8)])
def test_tile_schedule_runs_each_tile_once(n_t, heads, batch, sms, causal, persistent):
    from jaxllm.kernels.pallas.mosaic_common import TileSchedule
    sched = TileSchedule(n_t, heads, batch, causal=causal, persistent=persistent, sim=False,
                         sms=sms)
    seen, loads, first_pairs = [], [], set()
    for pid in range(sched.programs):
        tiles = [tuple(int(x) for x in sched.coords(jnp.int32(pid), jnp.int32(i)))
                 for i in range(int(sched.count(jnp.int32(pid))))]
        seen += tiles
        loads.append(sum(t + 1 for t, _, _ in tiles))  # causal work ~ tile index + 1
        first_pairs |= {(h, b) for _, h, b in tiles[:2]}
    assert sorted(seen) == [(t, h, b) for t in range(n_t) for h in range(heads)
                            for b in range(batch)]
    assert sched.multi == (sched.programs < n_t * heads * batch)
    assert sched.max_count == max(
        int(sched.count(jnp.int32(p))) for p in range(sched.programs))
    if causal and persistent:
        # pairs of tiles n_t - 1 - j and j, n_t + 1 key tiles whatever j: no program runs
        # more than its share of pairs rounded up
        assert max(loads) <= -(-sched.n_pairs // sched.programs) * (n_t + 1), loads
        if sched.n_pairs >= 10 * sched.programs:
            assert max(loads) <= 1.08 * sum(loads) / len(loads), loads
    if causal and persistent and n_t >= 2:
        # pairs run head by head: the programs' first pairs read few heads' K/V
        assert len(first_pairs) <= -(-sched.programs // (n_t // 2)) + 1, first_pairs


def test_default_configs_by_mask():
    # ping-pong, except full attention at D = 128 (overlapped); persistent forward and
    # overlapped backward at D <= 128, a persistent dq when full; fixed_max everywhere;
    # at D 256 a persistent forward only when causal
    assert flash_mosaic.default_fwd_config(128, causal=False).schedule == "overlapped"
    for d, causal in ((128, True), (64, False), (64, True), (256, True), (256, False)):
        assert flash_mosaic.default_fwd_config(d, causal).schedule == "pingpong", (d, causal)
    for d in (64, 128):
        for causal in (True, False):
            fwd = flash_mosaic.default_fwd_config(d, causal)
            bwd = flash_mosaic.default_bwd_config(d, causal)
            assert fwd.persistent and fwd.fixed_max and fwd.block_kv == 128
            assert bwd.overlap_bwd and bwd.persistent_dq == (not causal)
    fwd, bwd = flash_mosaic.default_fwd_config(256, False), flash_mosaic.default_bwd_config(256)
    assert fwd.block_kv == 64 and fwd.fixed_max and not fwd.persistent
    assert flash_mosaic.default_fwd_config(256, True).persistent
    assert bwd.compute_wgs_bwd == 1 and not (bwd.persistent_dq or bwd.overlap_bwd)
    # one warpgroup's dK and dV accumulators spill at D 256: the backward there takes the
    # kernel that splits them over two warpgroups by columns, and only there
    for d in (64, 128, 256):
        x = jax.ShapeDtypeStruct((1, 128, 2, d), jnp.bfloat16)
        loss = lambda q, k, v: flash_mosaic.flash_attention(q, k, v).astype(jnp.float32).sum()
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x))
        assert ("flash_dkdv_split" in jaxpr) == (d == 256), d


def test_default_configs_mla_fit_shared_memory():
    # D 192 / Dv 128: 64-key tiles 3 deep beside Q and O's own tiles; backward with D 128's
    # tiles, its products in turn
    for causal in (True, False):
        fwd = flash_mosaic.default_fwd_config(192, causal, v_head_dim=128)
        assert (fwd.block_kv, fwd.num_stages, fwd.block_q) == (64, 3, 64)
        assert fwd.schedule == flash_mosaic.default_fwd_config(128, causal).schedule
        assert flash_mosaic_fwd.tile_bytes(fwd.block_q, fwd.block_kv, fwd.num_stages, 192,
                                           dv=128) <= mg.SMEM_BUDGET
        bwd = flash_mosaic.default_bwd_config(192, causal, v_head_dim=128)
        assert bwd == dataclasses.replace(flash_mosaic.default_bwd_config(128, causal),
                                          overlap_bwd=False)
    # equal dims: O staged in the spent Q tile, no bytes of its own
    assert flash_mosaic_fwd.tile_bytes(64, 128, 2, 128, dv=128) == (128 + 512) * 128 * 2


def test_bad_inputs_raise():
    q = jnp.ones((1, 8, 2, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim=96"):
        flash_mosaic.flash_attention(q, q[:, :, :1], q[:, :, :1])
    q192 = jnp.ones((1, 8, 2, 192), jnp.bfloat16)
    for dv in (64, 192):  # pairs without a kernel configuration
        with pytest.raises(ValueError, match=f"head_dim=192 with v_head_dim={dv} is not "
                                             r"supported by pallas_mosaic.*\(192, 128\)"):
            flash_mosaic.flash_attention(q192, q192, jnp.ones((1, 8, 2, dv), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"v \[B, Skv, Hkv, Dv\]"):
        flash_mosaic.flash_attention(q192, q192, jnp.ones((1, 9, 2, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="v_head_dim=128; a CTA has"):
        flash_mosaic.flash_attention(q192, q192, jnp.ones((1, 8, 2, 128), jnp.bfloat16),
                                     block_kv=128)
    q = jnp.ones((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        flash_mosaic.flash_attention(q, q, q)
    q = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="block_kv=96 must be a positive multiple of 64"):
        flash_mosaic.flash_attention(q, q, q, block_kv=96)
    with pytest.raises(ValueError, match="KiB of shared memory at head_dim=128"):
        flash_mosaic.flash_attention(jnp.ones((1, 8, 2, 128), jnp.bfloat16),
                                     jnp.ones((1, 8, 2, 128), jnp.bfloat16),
                                     jnp.ones((1, 8, 2, 128), jnp.bfloat16), block_kv=256)
    with pytest.raises(ValueError, match="unknown pallas_mosaic options"):
        flash_mosaic.flash_attention(q, q, q, blok_q=64)
    with pytest.raises(ValueError, match="schedule='ping'"):
        flash_mosaic.flash_attention(q, q, q, schedule="ping")
    with pytest.raises(ValueError, match="num_stages_bwd=1 must be >= 2"):
        flash_mosaic.flash_attention(q, q, q, bwd=flash_mosaic.BwdConfig(num_stages_bwd=1))
    with pytest.raises(ValueError, match="fwd must be a flash_mosaic.FwdConfig"):
        flash_mosaic.flash_attention(q, q, q, fwd=dict(block_kv=64))


_GPU_SHAPES = {"gqa4_d128": (2, 1024, 1024, 8, 2, 128),
               "mla_d192_dv128": (1, 1500, 1500, 8, 8, 192),
               "mqa_d64_sq_lt_skv": (1, 1000, 2500, 8, 1, 64),
               "mha_d256": (1, 777, 777, 4, 4, 256),
               "sq_gt_skv": (1, 2500, 1000, 4, 1, 128)}
_GPU_DV = {"mla_d192_dv128": 128}  # the value head dim where it differs


@hopper_only
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(_GPU_SHAPES))
def test_gpu_long_bf16(name, causal):
    # the default configs
    _check(*_GPU_SHAPES[name], causal=causal, tol=3e-2, dv=_GPU_DV.get(name))


@hopper_only
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(_GPU_SHAPES))
def test_gpu_other_max(name, causal):
    # the forward's other softmax shift: the running max (the default is fixed_max)
    _check(*_GPU_SHAPES[name], causal=causal, tol=3e-2, dv=_GPU_DV.get(name),
           fixed_max=False)


@hopper_only
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_fixed_max_runs_outgrown_tiles_again(causal):
    # many programs, each several tiles; the rows 1024..1279 of every head outgrow their
    # first key tile's max (see _outgrowing_inputs), their tiles run a second time
    q, k, v, seen = _outgrowing_inputs(2, 4096, 4096, 8, 128, causal, hot=(1024, 1280))
    o, lse = flash_mosaic.flash_attention_with_lse(q, k, v, causal=causal, fixed_max=True)
    o0, lse0 = flash_mosaic.flash_attention_with_lse(q, k, v, causal=causal)
    assert np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse0), atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o0, np.float32),
                               atol=2e-2, rtol=2e-2)


@hopper_only
def test_gpu_dispatch():
    q, k, v, *_ = flash_inputs(2, 2, 512, 512, 8, 2, 128, True, jnp.bfloat16)
    out = flash_attention(q, k, v, causal=True, impl="pallas_mosaic")
    with jax.default_matmul_precision("highest"):
        want = reference.flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)
