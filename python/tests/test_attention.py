"""flashattn's Python API against the NumPy references, mirroring upstream
FlashAttention's tests/test_flash_attn.py on the CPU: forward and backward over
sequence-length pairs, head dims, MHA/GQA/MQA, Dv != D and every variant (causal,
sliding window, softcap, ALiBi, dropout) in float32, float16 and bfloat16; packed,
variable-length and strided inputs; deterministic backward.

Tolerances (upstream's rule, see reference.check_close): float32 out within 1e-5 and
gradients within 1e-4 of the float64 reference; float16/bfloat16 errors at most 2x
(out) / 3x (gradients) the error of the same-precision reference, plus 1e-5 / 1e-4.
Every failure message carries the seed of its inputs.
"""

import numpy as np
import pytest

import flashattn
import reference as ref
from conftest import BF16, Snapshot, alibi, dtype_param, make_dout, make_qkv, randn, seed_for

F32 = np.dtype(np.float32)
REF_KEYS = ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes")


# --------------------------------------------------------------------------- helpers


def materialize(variant, seed, batch, heads_q):
    """A variant spec (alibi=True / "batch" placeholders) -> keyword arguments."""
    kw = {k: x for k, x in variant.items() if k != "alibi"}
    if variant.get("alibi"):
        kw["alibi_slopes"] = alibi(seed, batch, heads_q, per_batch=variant["alibi"] == "batch")
    return kw


def ref_kwargs(kw):
    return {k: x for k, x in kw.items() if k in REF_KEYS}


def describe(seed, **parts):
    return "(seed=%d, %s)" % (seed, ", ".join(f"{k}={v}" for k, v in parts.items()))


def check_lse(lse, ref_lse, ctx):
    lse = np.asarray(lse)
    assert lse.dtype == F32, f"softmax_lse dtype {lse.dtype} {ctx}"
    assert lse.shape == ref_lse.shape, f"softmax_lse shape {lse.shape} != {ref_lse.shape} {ctx}"
    assert not np.isnan(lse).any(), f"NaN in softmax_lse {ctx}"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse),
                                  err_msg=f"rows without visible keys must have lse -inf {ctx}")
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-4,
                               err_msg=f"softmax_lse {ctx}")


def run_forward_and_check(q, k, v, kw, ctx, *, check_probs=True):
    """flash_attn_func vs the references; returns (out, lse, S_dmask, ref_p)."""
    dtype = q.dtype
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, dim_v = v.shape[1], v.shape[3]
    snap = Snapshot(q=q, k=k, v=v, alibi_slopes=kw.get("alibi_slopes"))
    out = flashattn.flash_attn_func(q, k, v, **kw)
    assert isinstance(out, np.ndarray), f"out is {type(out)} {ctx}"
    assert out.dtype == dtype and out.shape == (batch, seqlen_q, heads_q, dim_v), \
        f"out {out.dtype} {out.shape} {ctx}"
    ref_out, ref_lse, ref_p = ref.attention_ref(q, k, v, **ref_kwargs(kw))
    naive = None if dtype == F32 else ref.attention_naive(q, k, v, **ref_kwargs(kw))
    ref.check_close("out", out, ref_out, naive, dtype, context=ctx)
    lse = s_dmask = None
    if check_probs:
        res = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        assert isinstance(res, tuple) and len(res) == 3, f"return_attn_probs gives {type(res)} {ctx}"
        out2, lse, s_dmask = res
        ref.check_close("out (return_attn_probs)", out2, ref_out, naive, dtype, context=ctx)
        check_lse(lse, ref_lse, ctx)
        s_dmask = np.asarray(s_dmask)
        assert s_dmask.dtype == dtype and s_dmask.shape == (0,), \
            f"S_dmask without dropout must be empty (as upstream): {s_dmask.dtype} {s_dmask.shape} {ctx}"
    snap.check(ctx)
    return out, lse, s_dmask, ref_p


def run_backward_and_check(q, k, v, kw, ctx, *, seed):
    """flash_attn_backward vs the references; returns (dq, dk, dv)."""
    dtype = q.dtype
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    dout = make_dout(seed, out.shape, dtype)
    snap = Snapshot(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=kw.get("alibi_slopes"))
    grads = flashattn.flash_attn_backward(dout, q, k, v, out, lse, **kw)
    snap.check(ctx)
    assert isinstance(grads, tuple) and len(grads) == 3, f"backward returned {type(grads)} {ctx}"
    refs = ref.attention_backward_ref(dout, q, k, v, **ref_kwargs(kw))
    naives = ((None,) * 3 if dtype == F32
              else ref.attention_backward_naive(dout, q, k, v, **ref_kwargs(kw)))
    for name, g, x, r, n in zip(("dq", "dk", "dv"), grads, (q, k, v), refs, naives):
        assert isinstance(g, np.ndarray) and g.dtype == x.dtype and g.shape == x.shape, \
            f"{name}: {type(g)} {getattr(g, 'dtype', None)} {getattr(g, 'shape', None)} {ctx}"
        ref.check_close(name, g, r, n, dtype, grad=True, context=ctx)
    return grads


SEQLENS = [(1, 239), (3, 799), (113, 203), (127, 513), (239, 1), (1023, 1024)]
HEAD_DIMS = [32, 40, 59, 64, 96, 128, 256]

# Variants and combinations ("alibi": True -> slopes (Hq), "batch" -> (B, Hq)).
VARIANTS = [
    dict(window_size=(16, -1)),
    dict(window_size=(-1, 8)),
    dict(window_size=(10, 10)),
    dict(window_size=(0, 0)),
    dict(softcap=2.0),
    dict(softcap=30.0, softmax_scale=0.6),
    dict(alibi=True),
    dict(alibi="batch"),
    dict(softmax_scale=0.5),
    dict(causal=True, window_size=(16, -1)),
    dict(causal=True, window_size=(5, 0)),
    dict(window_size=(12, 4), softcap=1.5),
    dict(alibi=True, causal=True),
    dict(causal=True, window_size=(20, 0), softcap=3.0, alibi="batch"),
]
VARIANT_IDS = ["-".join(f"{k}={v}" for k, v in d.items()).replace(" ", "") for d in VARIANTS]


# --------------------------------------------------------------------------- forward


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_flash_attn_output(seqlens, causal, dtype):
    seqlen_q, seqlen_k = seqlens
    big = seqlen_q * seqlen_k > 500_000
    batch, heads, dim = (1, 2, 64) if big else (2, 2, 64)
    seed = seed_for("output", seqlens, causal, str(dtype))
    q, k, v = make_qkv(seed, batch, seqlen_q, seqlen_k, heads, heads, dim, dtype=dtype)
    ctx = describe(seed, seqlens=seqlens, causal=causal, dtype=dtype)
    run_forward_and_check(q, k, v, dict(causal=causal), ctx, check_probs=not big)


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_flash_attn_output_head_dims(head_dim, causal, dtype):
    seed = seed_for("head_dims", head_dim, causal, str(dtype))
    q, k, v = make_qkv(seed, 1, 113, 203, 2, 2, head_dim, dtype=dtype)
    ctx = describe(seed, head_dim=head_dim, causal=causal, dtype=dtype)
    run_forward_and_check(q, k, v, dict(causal=causal), ctx)


@dtype_param()
@pytest.mark.parametrize("dims", [(32, 32), (32, 48), (64, 16)], ids=["d32", "d32dv48", "d64dv16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_flash_attn_output_heads(heads, causal, dims, dtype):
    heads_q, heads_kv = heads
    dim, dim_v = dims
    seed = seed_for("heads", heads, causal, dims, str(dtype))
    q, k, v = make_qkv(seed, 2, 67, 91, heads_q, heads_kv, dim, dim_v, dtype)
    ctx = describe(seed, heads=heads, causal=causal, dims=dims, dtype=dtype)
    run_forward_and_check(q, k, v, dict(causal=causal), ctx)


@dtype_param()
@pytest.mark.parametrize("seqlens", [(113, 203), (203, 113)], ids=["113x203", "203x113"])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_flash_attn_output_variants(variant, seqlens, dtype):
    seed = seed_for("variants", VARIANT_IDS[VARIANTS.index(variant)], seqlens, str(dtype))
    batch, heads_q, heads_kv = 2, 4, 2
    q, k, v = make_qkv(seed, batch, *seqlens, heads_q, heads_kv, 32, 40, dtype)
    kw = materialize(variant, seed, batch, heads_q)
    ctx = describe(seed, variant=variant, seqlens=seqlens, dtype=dtype)
    run_forward_and_check(q, k, v, kw, ctx)


def test_default_scale_is_inverse_sqrt_head_dim():
    seed = seed_for("scale")
    q, k, v = make_qkv(seed, 1, 33, 47, 2, 2, 48)
    a = flashattn.flash_attn_func(q, k, v)
    b = flashattn.flash_attn_func(q, k, v, softmax_scale=1.0 / np.sqrt(48))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"(seed={seed})")
    c = flashattn.flash_attn_func(q, k, v, softmax_scale=0.05)
    assert not np.allclose(a, c), "softmax_scale is ignored"


@dtype_param()
@pytest.mark.parametrize("case", ["causal_sq_gt_sk", "window_00_sq_gt_sk", "empty_k"])
def test_rows_without_visible_key(case, dtype):
    """A row that sees no key gives out 0 and lse -inf (and never NaN); rows that
    do see keys are unaffected."""
    seed = seed_for("novisible", case, str(dtype))
    sq, sk = (40, 0) if case == "empty_k" else (40, 13)
    kw = {"causal_sq_gt_sk": dict(causal=True), "window_00_sq_gt_sk": dict(window_size=(0, 0)),
          "empty_k": dict()}[case]
    q, k, v = make_qkv(seed, 2, sq, sk, 2, 1, 16, 24, dtype)
    ctx = describe(seed, case=case, dtype=dtype)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, dropout_p=0.3, seed=seed, **kw)
    _, ref_lse, _ = ref.attention_ref(q, k, v, **kw)
    empty = np.isneginf(ref_lse)  # (B, H, Sq)
    assert empty.any()
    out32 = np.asarray(out).astype(np.float32)
    assert out.shape == (2, sq, 2, 24) and not np.isnan(out32).any(), ctx
    assert np.all(out32.transpose(0, 2, 1, 3)[empty] == 0), f"out must be 0 where no key is seen {ctx}"
    check_lse(lse, ref_lse, ctx)
    s_dmask = np.asarray(s_dmask).astype(np.float32)
    assert not np.isnan(s_dmask).any() and np.all(s_dmask[empty] == 0), ctx
    run_forward_and_check(q, k, v, kw, ctx)


@pytest.mark.parametrize("shape", [(0, 5, 2, 8, 7), (2, 0, 2, 8, 7), (2, 5, 2, 8, 0)],
                         ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_shapes(shape):
    batch, sq, heads, dim, sk = shape
    q, k, v = make_qkv(0, batch, sq, sk, heads, heads, dim)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (batch, sq, heads, dim) and out.dtype == F32
    assert lse.shape == (batch, heads, sq) and s_dmask.shape == (0,)
    _, _, s_dmask = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, dropout_p=0.5, seed=1)
    assert s_dmask.shape == (batch, heads, sq, sk) and s_dmask.dtype == F32
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    dout = np.ones_like(out)
    dq, dk, dv = flashattn.flash_attn_backward(dout, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for g in (dq, dk, dv):
        assert np.all(g == 0)


# --------------------------------------------------------------------------- backward

BWD_SEQLENS = [(1, 239), (3, 799), (113, 203), (127, 513), (239, 1)]


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", BWD_SEQLENS, ids=[f"{a}x{b}" for a, b in BWD_SEQLENS])
def test_flash_attn_backward(seqlens, causal, dtype):
    seed = seed_for("backward", seqlens, causal, str(dtype))
    q, k, v = make_qkv(seed, 1, *seqlens, 2, 1, 64, dtype=dtype)
    ctx = describe(seed, seqlens=seqlens, causal=causal, dtype=dtype)
    run_backward_and_check(q, k, v, dict(causal=causal), ctx, seed=seed)


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [(32, 32), (59, 59), (96, 96), (128, 128), (256, 256), (40, 72)],
                         ids=["d32", "d59", "d96", "d128", "d256", "d40dv72"])
def test_flash_attn_backward_head_dims(dims, causal, dtype):
    seed = seed_for("backward_dims", dims, causal, str(dtype))
    q, k, v = make_qkv(seed, 1, 61, 87, 2, 2, *dims, dtype)
    ctx = describe(seed, dims=dims, causal=causal, dtype=dtype)
    run_backward_and_check(q, k, v, dict(causal=causal), ctx, seed=seed)


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_flash_attn_backward_heads(heads, causal, dtype):
    seed = seed_for("backward_heads", heads, causal, str(dtype))
    q, k, v = make_qkv(seed, 2, 77, 65, *heads, 32, 24, dtype)
    ctx = describe(seed, heads=heads, causal=causal, dtype=dtype)
    run_backward_and_check(q, k, v, dict(causal=causal), ctx, seed=seed)


@dtype_param()
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_flash_attn_backward_variants(variant, dtype):
    seed = seed_for("backward_variants", VARIANT_IDS[VARIANTS.index(variant)], str(dtype))
    batch, heads_q, heads_kv = 2, 4, 2
    q, k, v = make_qkv(seed, batch, 97, 131, heads_q, heads_kv, 32, 40, dtype)
    kw = materialize(variant, seed, batch, heads_q)
    ctx = describe(seed, variant=variant, dtype=dtype)
    run_backward_and_check(q, k, v, kw, ctx, seed=seed)


@dtype_param([np.float32, BF16])
@pytest.mark.parametrize("variant", [dict(), dict(causal=True, window_size=(40, 0), alibi=True)],
                         ids=["plain", "causal-window-alibi"])
def test_flash_attn_backward_deterministic(variant, dtype):
    """deterministic=True: bit-identical gradients on repeated calls (and still correct)."""
    seed = seed_for("deterministic", str(variant), str(dtype))
    batch, heads_q, heads_kv = 2, 4, 1  # MQA: 4 query heads add into each dk/dv
    q, k, v = make_qkv(seed, batch, 300, 257, heads_q, heads_kv, 32, dtype=dtype)
    kw = materialize(variant, seed, batch, heads_q)
    kw["deterministic"] = True
    ctx = describe(seed, variant=variant, dtype=dtype)
    first = run_backward_and_check(q, k, v, kw, ctx, seed=seed)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    dout = make_dout(seed, out.shape, dtype)
    runs = [flashattn.flash_attn_backward(dout, q, k, v, out, lse, **kw) for _ in range(3)]
    for r in runs:
        for name, a, b in zip(("dq", "dk", "dv"), first, r):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
                f"{name} differs between deterministic runs {ctx}"


# --------------------------------------------------------------------------- dropout


def _probs_times_v(weights, v):
    """out = weights @ v per (batch, q head), q head h using kv head h // group."""
    heads_q = weights.shape[1]
    vh = np.repeat(v.astype(np.float64).transpose(0, 2, 1, 3), heads_q // v.shape[2], axis=1)
    return (weights.astype(np.float64) @ vh).transpose(0, 2, 1, 3)


@dtype_param()
@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(window_size=(20, 5), alibi=True)],
                         ids=["plain", "causal", "window-alibi"])
def test_dropout_attn_probs(variant, dtype):
    """return_attn_probs with dropout, as upstream: S_dmask in q's dtype holds P where kept,
    -P where dropped and 0 where masked; out == (kept S_dmask / (1-p)) @ v (GQA mapping); lse
    is the undropped one."""
    p = 0.17
    seed = seed_for("dropout_probs", str(variant), str(dtype))
    batch, heads_q, heads_kv = 2, 4, 2
    q, k, v = make_qkv(seed, batch, 83, 121, heads_q, heads_kv, 32, 48, dtype)
    kw = materialize(variant, seed, batch, heads_q)
    ctx = describe(seed, variant=variant, dtype=dtype, dropout_p=p)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True,
                                                  seed=1234, **kw)
    assert s_dmask.dtype == dtype and s_dmask.shape == (batch, heads_q, 83, 121), ctx
    _, ref_lse, ref_p = ref.attention_ref(q, k, v, **ref_kwargs(kw))
    check_lse(lse, ref_lse, ctx)
    visible = ref.visible_mask(83, 121, kw.get("causal", False), kw.get("window_size", (-1, -1)))
    s32 = s_dmask.astype(np.float32)
    assert np.all(s32[..., ~visible] == 0), f"S_dmask non-zero outside the mask {ctx}"
    kept, dropped = s32 > 0, s32 < 0
    assert np.all((kept | dropped)[..., visible]), f"visible entries neither kept nor dropped {ctx}"
    rtol = {F32: 1e-5, BF16: 2.0 ** -8}.get(dtype, 2.0 ** -10)  # q's dtype rounds P
    np.testing.assert_allclose(np.abs(s32), ref_p, rtol=rtol, atol=1e-7,
                               err_msg=f"|S_dmask| must be P (dropped entries negated) {ctx}")
    assert dropped.any() and kept.any(), ctx
    weights = ref.dropout_weights_from_s_dmask(s_dmask, p)
    ref_out, _, _ = ref.attention_ref(q, k, v, dropout_weights=weights, **ref_kwargs(kw))
    naive = None if dtype == F32 else ref.attention_naive(q, k, v, dropout_weights=weights,
                                                         **ref_kwargs(kw))
    ref.check_close("out", out, ref_out, naive, dtype, context=ctx)
    # Literally the kept entries of S_dmask, scaled, times v.
    tol = 1e-5 if dtype == F32 else 2 * ref.max_abs(naive, ref_out) + 1e-5
    err = ref.max_abs(out, _probs_times_v(np.where(kept, ref_p, 0.0) / (1 - np.float64(np.float32(p))), v))
    assert err <= tol, f"|out - (kept P / (1 - p)) @ v| = {err:.3e} > {tol:.3e} {ctx}"


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_fraction(dropout_p, causal):
    """The fraction of dropped visible entries is close to dropout_p (~500k entries)."""
    seed = seed_for("dropout_fraction", dropout_p, causal)
    q, k, v = make_qkv(seed, 2, 256, 256 if not causal else 384, 4, 4, 16)
    _, _, s_dmask = flashattn.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal,
                                                return_attn_probs=True, seed=seed)
    visible = ref.visible_mask(256, s_dmask.shape[-1], causal)
    vis = np.broadcast_to(visible, s_dmask.shape)
    frac = 1.0 - np.count_nonzero(s_dmask[vis] > 0) / np.count_nonzero(vis)
    assert abs(frac - dropout_p) < 0.01, f"dropped fraction {frac:.4f} vs p={dropout_p} (seed={seed})"
    # Per (batch, head) the fraction is close too (the mask is not shared across heads
    # or batches).
    per_bh = 1.0 - (s_dmask > 0).sum(axis=(2, 3)) / visible.sum()
    assert np.all(np.abs(per_bh - dropout_p) < 0.03), f"{per_bh} (seed={seed})"
    masks = (s_dmask > 0).reshape(-1, *s_dmask.shape[2:])
    assert not any(np.array_equal(masks[0], m) for m in masks[1:]), \
        f"identical dropout masks across batch/heads (seed={seed})"


@dtype_param()
def test_dropout_seed_determinism(dtype):
    """Same seed -> same output (bitwise); another seed -> another mask; dropout_p=0
    ignores the seed."""
    seed = seed_for("dropout_seed", str(dtype))
    q, k, v = make_qkv(seed, 2, 64, 96, 4, 2, 32, dtype=dtype)
    kw = dict(dropout_p=0.3, causal=True)
    a = flashattn.flash_attn_func(q, k, v, seed=7, **kw)
    b = flashattn.flash_attn_func(q, k, v, seed=7, **kw)
    c = flashattn.flash_attn_func(q, k, v, seed=8, **kw)
    ctx = f"(seed={seed}, dtype={dtype})"
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"same seed, different output {ctx}"
    assert not np.array_equal(a, c), f"different seeds, same output {ctx}"
    _, _, sa = flashattn.flash_attn_func(q, k, v, seed=7, return_attn_probs=True, **kw)
    _, _, sb = flashattn.flash_attn_func(q, k, v, seed=7, return_attn_probs=True, **kw)
    np.testing.assert_array_equal(sa > 0, sb > 0, err_msg=f"same seed, different mask {ctx}")
    plain = flashattn.flash_attn_func(q, k, v, causal=True)
    zero = flashattn.flash_attn_func(q, k, v, causal=True, dropout_p=0.0, seed=99)
    assert np.array_equal(plain.view(np.uint8), zero.view(np.uint8)), ctx
    # seed=None draws a fresh mask: still a valid dropout output.
    d = flashattn.flash_attn_func(q, k, v, **kw)
    assert d.shape == a.shape and np.isfinite(d.astype(np.float32)).all(), ctx


@dtype_param()
@pytest.mark.parametrize("variant", [dict(), dict(causal=True, softcap=2.0), dict(window_size=(30, 10), alibi=True)],
                         ids=["plain", "causal-softcap", "window-alibi"])
def test_dropout_backward(variant, dtype):
    """flash_attn_backward with the forward's seed gives the gradients of
    out = S_dmask @ v (the reference built from the returned S_dmask)."""
    p = 0.25
    seed = seed_for("dropout_backward", str(variant), str(dtype))
    batch, heads_q, heads_kv = 2, 4, 2
    q, k, v = make_qkv(seed, batch, 71, 93, heads_q, heads_kv, 32, 40, dtype)
    kw = materialize(variant, seed, batch, heads_q)
    kw.update(dropout_p=p, seed=seed)
    ctx = describe(seed, variant=variant, dtype=dtype, dropout_p=p)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    weights = ref.dropout_weights_from_s_dmask(s_dmask, p)
    dout = make_dout(seed, out.shape, dtype)
    grads = flashattn.flash_attn_backward(dout, q, k, v, out, lse, **kw)
    refs = ref.attention_backward_ref(dout, q, k, v, dropout_weights=weights, **ref_kwargs(kw))
    naives = ((None,) * 3 if dtype == F32 else
              ref.attention_backward_naive(dout, q, k, v, dropout_weights=weights, **ref_kwargs(kw)))
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        ref.check_close(name, g, r, n, dtype, grad=True, context=ctx)
    # Another seed in backward is another mask: the gradients no longer match.
    other = flashattn.flash_attn_backward(dout, q, k, v, out, lse, **dict(kw, seed=seed + 1))
    assert ref.max_abs(other[2], refs[2]) > 1e-2, f"backward ignores the seed {ctx}"


# --------------------------------------------------------------------------- packed


@dtype_param()
@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(window_size=(9, 3), alibi=True),
                                     dict(dropout_p=0.2, seed=5)],
                         ids=["plain", "causal", "window-alibi", "dropout"])
def test_qkvpacked_equals_unpacked(variant, dtype):
    seed = seed_for("qkvpacked", str(variant), str(dtype))
    batch, seqlen, heads, dim = 2, 75, 3, 32
    qkv = randn(np.random.default_rng(seed), (batch, seqlen, 3, heads, dim), dtype)
    kw = materialize(variant, seed, batch, heads)
    ctx = describe(seed, variant=variant, dtype=dtype)
    snap = Snapshot(qkv=qkv)
    packed = flashattn.flash_attn_qkvpacked_func(qkv, return_attn_probs=True, **kw)
    snap.check(ctx)
    views = flashattn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                      return_attn_probs=True, **kw)
    copies = flashattn.flash_attn_func(*(np.ascontiguousarray(qkv[:, :, i]) for i in range(3)),
                                       return_attn_probs=True, **kw)
    for name, a, b, c in zip(("out", "softmax_lse", "S_dmask"), packed, views, copies):
        np.testing.assert_array_equal(a, b, err_msg=f"qkvpacked {name} != func on slices {ctx}")
        np.testing.assert_array_equal(b, c, err_msg=f"{name}: strided slices != copies {ctx}")
    out = flashattn.flash_attn_qkvpacked_func(qkv, **kw)
    np.testing.assert_array_equal(out, packed[0], err_msg=ctx)


@dtype_param()
@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(softcap=3.0, alibi="batch")],
                         ids=["plain", "causal", "softcap-alibi"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_kvpacked_equals_unpacked(heads, variant, dtype):
    seed = seed_for("kvpacked", heads, str(variant), str(dtype))
    batch, dim = 2, 40
    rng = np.random.default_rng(seed)
    q = randn(rng, (batch, 57, heads[0], dim), dtype)
    kv = randn(rng, (batch, 83, 2, heads[1], dim), dtype)
    kw = materialize(variant, seed, batch, heads[0])
    ctx = describe(seed, heads=heads, variant=variant, dtype=dtype)
    snap = Snapshot(q=q, kv=kv)
    packed = flashattn.flash_attn_kvpacked_func(q, kv, return_attn_probs=True, **kw)
    snap.check(ctx)
    views = flashattn.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], return_attn_probs=True, **kw)
    for name, a, b in zip(("out", "softmax_lse", "S_dmask"), packed, views):
        np.testing.assert_array_equal(a, b, err_msg=f"kvpacked {name} != func on slices {ctx}")
    ref_out, _, _ = ref.attention_ref(q, kv[:, :, 0], kv[:, :, 1], **ref_kwargs(kw))
    naive = None if dtype == F32 else ref.attention_naive(q, kv[:, :, 0], kv[:, :, 1], **ref_kwargs(kw))
    ref.check_close("out", packed[0], ref_out, naive, dtype, context=ctx)


# --------------------------------------------------------------------------- varlen

SEQLENS_Q = [5, 0, 17, 33, 4, 1, 0]
# A sequence of length 0 on both sides, queries without keys and keys without queries.
SEQLENS_K = [9, 0, 12, 40, 0, 30, 6]


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _varlen_inputs(seed, dtype, heads_q, heads_kv, dim, dim_v):
    rng = np.random.default_rng(seed)
    q = randn(rng, (sum(SEQLENS_Q), heads_q, dim), dtype)
    k = randn(rng, (sum(SEQLENS_K), heads_kv, dim), dtype)
    v = randn(rng, (sum(SEQLENS_K), heads_kv, dim_v), dtype)
    return q, k, v


def _close_to(a, b, dtype, msg):
    """Tight comparison: same computation, at most an ulp of the dtype apart."""
    a = np.asarray(a).astype(np.float32)
    b = np.asarray(b).astype(np.float32)
    rtol = 1e-6 if np.dtype(dtype) == F32 else (2.0 ** -7 if np.dtype(dtype) == BF16 else 2.0 ** -10)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6, err_msg=msg)


VARLEN_VARIANTS = [dict(), dict(causal=True), dict(window_size=(6, 2), softcap=2.0),
                   dict(causal=True, alibi="batch"), dict(alibi=True)]
VARLEN_IDS = ["plain", "causal", "window-softcap", "causal-alibi_batch", "alibi"]


def _per_sequence_kwargs(kw, b):
    kw = dict(kw)
    slopes = kw.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        kw["alibi_slopes"] = np.ascontiguousarray(slopes[b:b + 1])
    return kw


def _per_sequence_forward(q, k, v, cu_q, cu_k, kw):
    """flash_attn_func on every sequence: out (total_q, Hq, Dv) and lse (Hq, total_q)."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, np.float32)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start or ks.stop == ks.start:
            continue  # no query, or no key: out 0 and lse -inf (see test_rows_without_visible_key)
        o1, l1, _ = flashattn.flash_attn_func(q[None, qs], k[None, ks], v[None, ks], return_attn_probs=True,
                                              **_per_sequence_kwargs(kw, b))
        out[qs], lse[:, qs] = o1[0], l1[0]
    return out, lse


@dtype_param()
@pytest.mark.parametrize("variant", VARLEN_VARIANTS, ids=VARLEN_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_varlen_equals_per_sequence(heads, variant, dtype):
    seed = seed_for("varlen", heads, str(variant), str(dtype))
    batch = len(SEQLENS_Q)
    q, k, v = _varlen_inputs(seed, dtype, *heads, 32, 24)
    cu_q, cu_k = _cu(SEQLENS_Q), _cu(SEQLENS_K)
    kw = materialize(variant, seed, batch, heads[0])
    ctx = describe(seed, heads=heads, variant=variant, dtype=dtype)
    snap = Snapshot(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K), **kw)
    snap.check(ctx)
    assert isinstance(out, np.ndarray), f"varlen without return_attn_probs returns {type(out)} {ctx}"
    assert out.shape == (q.shape[0], heads[0], 24) and out.dtype == dtype, ctx
    expected, _ = _per_sequence_forward(q, k, v, cu_q, cu_k, kw)
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if SEQLENS_Q[b] == 0:
            continue
        cb = f"sequence {b} {ctx}"
        _close_to(out[qs], expected[qs], dtype, f"varlen out != per-sequence {cb}")
        kwb = _per_sequence_kwargs(kw, b)
        sq, sk, sv = q[None, qs], k[None, ks], v[None, ks]
        ref_out, _, _ = ref.attention_ref(sq, sk, sv, **ref_kwargs(kwb))
        naive = None if dtype == F32 else ref.attention_naive(sq, sk, sv, **ref_kwargs(kwb))
        ref.check_close("out", out[None, qs], ref_out, naive, dtype, context=cb)


@dtype_param([np.float32, BF16])
@pytest.mark.parametrize("variant", [dict(), dict(causal=True, alibi="batch")], ids=["plain", "causal-alibi_batch"])
def test_varlen_softmax_lse(variant, dtype):
    """return_attn_probs on a varlen batch gives (out, softmax_lse (Hq, total_q), S_dmask);
    lse matches per-sequence calls (-inf for queries without keys)."""
    seed = seed_for("varlen_lse", str(variant), str(dtype))
    heads = (4, 2)
    q, k, v = _varlen_inputs(seed, dtype, *heads, 32, 24)
    cu_q, cu_k = _cu(SEQLENS_Q), _cu(SEQLENS_K)
    kw = materialize(variant, seed, len(SEQLENS_Q), heads[0])
    ctx = describe(seed, variant=variant, dtype=dtype)
    res = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K),
                                           return_attn_probs=True, **kw)
    assert isinstance(res, tuple) and len(res) == 3, f"{type(res)} {ctx}"
    out, lse = res[0], np.asarray(res[1])
    exp_out, exp_lse = _per_sequence_forward(q, k, v, cu_q, cu_k, kw)
    _close_to(out, exp_out, dtype, f"varlen out (return_attn_probs) {ctx}")
    assert lse.shape == (heads[0], q.shape[0]) and lse.dtype == F32, f"lse {lse.shape} {lse.dtype} {ctx}"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exp_lse), err_msg=ctx)
    fin = np.isfinite(exp_lse)
    np.testing.assert_allclose(lse[fin], exp_lse[fin], rtol=1e-6, atol=1e-6, err_msg=ctx)


def test_varlen_s_dmask_holds_each_sequence_in_its_corner():
    """With dropout, a varlen S_dmask (batch, Hq, max_seqlen_q, max_seqlen_k) holds sequence b's
    signed probabilities in [b, :, :lq, :lk] and zeros elsewhere: each sequence's block is
    written through the view's strides (it was copied as if contiguous, scrambling rows)."""
    heads, d = 2, 8
    rng = np.random.default_rng(seed_for("varlen_s_dmask"))
    seqlens_q, seqlens_k = [2, 3, 1], [3, 2, 4]
    q = rng.standard_normal((sum(seqlens_q), heads, d)).astype(F32)
    k = rng.standard_normal((sum(seqlens_k), heads, d)).astype(F32)
    v = rng.standard_normal((sum(seqlens_k), heads, d)).astype(F32)
    cu_q, cu_k = _cu(seqlens_q), _cu(seqlens_k)
    _, _, s = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), dropout_p=0.5,
                                               return_attn_probs=True, seed=1)
    for b, (lq, lk) in enumerate(zip(seqlens_q, seqlens_k)):
        qs, ks = q[cu_q[b]:cu_q[b + 1]].astype(np.float64), k[cu_k[b]:cu_k[b + 1]].astype(np.float64)
        scores = np.einsum("qhd,khd->hqk", qs, ks) / np.sqrt(d)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.abs(s[b, :, :lq, :lk]), probs, atol=1e-6, err_msg=f"sequence {b}")
        outside = np.abs(s[b]).sum() - np.abs(s[b, :, :lq, :lk]).sum()
        assert outside == 0, f"sequence {b}: S_dmask written outside its corner"


def test_varlen_s_dmask_holds_the_dropout_each_sequence_ran():
    """S_dmask's signs are the dropout the kernels applied (negative: dropped), so the output
    rebuilt from them is the call's output — sequence b's pattern is drawn as batch index b,
    as the kernels draw it (every sequence after the first showed sequence 0's)."""
    heads, d, p = 2, 8, 0.5
    rng = np.random.default_rng(seed_for("varlen_s_dmask_dropout"))
    seqlens_q, seqlens_k = [5, 3, 6, 1], [7, 4, 6, 9]
    q = rng.standard_normal((sum(seqlens_q), heads, d)).astype(F32)
    k = rng.standard_normal((sum(seqlens_k), heads, d)).astype(F32)
    v = rng.standard_normal((sum(seqlens_k), heads, d)).astype(F32)
    cu_q, cu_k = _cu(seqlens_q), _cu(seqlens_k)
    out, _, s = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), dropout_p=p,
                                                 causal=True, return_attn_probs=True, seed=7)
    for b, (lq, lk) in enumerate(zip(seqlens_q, seqlens_k)):
        corner = s[b, :, :lq, :lk].astype(np.float64)
        weights = np.where(np.signbit(corner), 0.0, np.abs(corner)) / (1 - p)
        rebuilt = np.einsum("hqk,khd->qhd", weights, v[cu_k[b]:cu_k[b + 1]].astype(np.float64))
        np.testing.assert_allclose(rebuilt, out[cu_q[b]:cu_q[b + 1]], atol=1e-5, err_msg=f"sequence {b}")


@dtype_param()
@pytest.mark.parametrize("variant", [dict(), dict(causal=True, alibi="batch"), dict(window_size=(6, 2), softcap=2.0)],
                         ids=["plain", "causal-alibi_batch", "window-softcap"])
def test_varlen_backward_equals_per_sequence(variant, dtype):
    seed = seed_for("varlen_backward", str(variant), str(dtype))
    batch, heads = len(SEQLENS_Q), (4, 2)
    q, k, v = _varlen_inputs(seed, dtype, *heads, 32, 24)
    cu_q, cu_k = _cu(SEQLENS_Q), _cu(SEQLENS_K)
    kw = materialize(variant, seed, batch, heads[0])
    kw["deterministic"] = True
    ctx = describe(seed, variant=variant, dtype=dtype)
    mq, mk = max(SEQLENS_Q), max(SEQLENS_K)
    # out and lse from per-sequence calls (the same numbers the varlen forward gives, see
    # test_varlen_equals_per_sequence / test_varlen_softmax_lse).
    out, lse = _per_sequence_forward(q, k, v, cu_q, cu_k, kw)
    dout = make_dout(seed, out.shape, dtype)
    snap = Snapshot(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_q=cu_q, cu_k=cu_k)
    dq, dk, dv = flashattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, **kw)
    snap.check(ctx)
    for name, g, x in zip(("dq", "dk", "dv"), (dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} {g.shape} {g.dtype} {ctx}"
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        cb = f"sequence {b} {ctx}"
        if SEQLENS_Q[b] == 0 or SEQLENS_K[b] == 0:
            # No score at all: every gradient of the sequence is zero.
            assert np.all(dq[qs].astype(np.float32) == 0), cb
            assert np.all(dk[ks].astype(np.float32) == 0) and np.all(dv[ks].astype(np.float32) == 0), cb
            continue
        kwb = _per_sequence_kwargs(kw, b)
        sq, sk, sv, sdo = q[None, qs], k[None, ks], v[None, ks], dout[None, qs]
        g1 = flashattn.flash_attn_backward(sdo, sq, sk, sv, out[None, qs], lse[None, :, qs], **kwb)
        refs = ref.attention_backward_ref(sdo, sq, sk, sv, **ref_kwargs(kwb))
        naives = ((None,) * 3 if dtype == F32 else
                  ref.attention_backward_naive(sdo, sq, sk, sv, **ref_kwargs(kwb)))
        for name, g, s, one, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), (qs, ks, ks), g1, refs, naives):
            _close_to(g[s], one[0], dtype, f"varlen {name} != per-sequence {cb}")
            ref.check_close(name, g[None, s], r, n, dtype, grad=True, context=cb)


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_packed_equal_unpacked(causal, dtype):
    seed = seed_for("varlen_packed", causal, str(dtype))
    rng = np.random.default_rng(seed)
    lengths = [7, 0, 31, 12]
    cu = _cu(lengths)
    total, heads, dim = sum(lengths), 3, 32
    qkv = randn(rng, (total, 3, heads, dim), dtype)
    ctx = describe(seed, causal=causal, dtype=dtype)
    snap = Snapshot(qkv=qkv, cu=cu)
    a = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=causal)
    snap.check(ctx)
    b = flashattn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, max(lengths), max(lengths),
                                         causal=causal)
    np.testing.assert_array_equal(a, b, err_msg=f"varlen qkvpacked out {ctx}")

    lengths_k = [3, 5, 0, 40]
    cu_k = _cu(lengths_k)
    q = randn(rng, (total, 4, dim), dtype)
    kv = randn(rng, (sum(lengths_k), 2, 2, dim), dtype)
    a = flashattn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, max(lengths), max(lengths_k), causal=causal)
    b = flashattn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu_k, max(lengths), max(lengths_k),
                                         causal=causal)
    np.testing.assert_array_equal(a, b, err_msg=f"varlen kvpacked out {ctx}")
    c = flashattn.flash_attn_varlen_func(q, np.ascontiguousarray(kv[:, 0]), np.ascontiguousarray(kv[:, 1]),
                                         cu, cu_k, max(lengths), max(lengths_k), causal=causal)
    np.testing.assert_array_equal(a, c, err_msg=f"varlen strided slices != copies {ctx}")
    q32 = q[None].astype(np.float32)
    for s in range(len(lengths)):  # against the reference too
        qs, ks = slice(cu[s], cu[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lengths[s]:
            r, _, _ = ref.attention_ref(q32[:, qs], kv[None, ks, 0], kv[None, ks, 1], causal=causal)
            naive = None if dtype == F32 else ref.attention_naive(q[None, qs], kv[None, ks, 0], kv[None, ks, 1],
                                                                 causal=causal)
            ref.check_close("out", a[None, qs], r, naive, dtype, context=f"sequence {s} {ctx}")


def test_varlen_dropout_seed():
    seed = seed_for("varlen_dropout")
    q, k, v = _varlen_inputs(seed, np.float32, 4, 2, 32, 24)
    cu_q, cu_k = _cu(SEQLENS_Q), _cu(SEQLENS_K)
    args = (q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K))
    a = flashattn.flash_attn_varlen_func(*args, dropout_p=0.3, seed=11)
    b = flashattn.flash_attn_varlen_func(*args, dropout_p=0.3, seed=11)
    c = flashattn.flash_attn_varlen_func(*args, dropout_p=0.3, seed=12)
    plain = flashattn.flash_attn_varlen_func(*args)
    assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, plain), \
        f"(seed={seed})"


# --------------------------------------------------------------------------- strided


@dtype_param()
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(causal, dtype):
    """Views with a contiguous last dim give the results of contiguous copies, forward
    and backward, and are never written."""
    seed = seed_for("strided", causal, str(dtype))
    rng = np.random.default_rng(seed)
    batch, sq, sk, hq, hkv, d, dv = 2, 45, 70, 4, 2, 32, 24
    q = randn(rng, (batch, sq, 2 * hq, d), dtype)[:, :, ::2, :]          # head stride
    k = randn(rng, (batch, hkv, sk, d), dtype).transpose(0, 2, 1, 3)      # (B, H, S, D) storage
    v = randn(rng, (batch, 2 * sk, hkv, dv + 8), dtype)[:, ::2, :, 4:4 + dv]  # seq stride, offset
    assert not any(x.flags.c_contiguous for x in (q, k, v))
    kw = dict(causal=causal, deterministic=True)
    ctx = describe(seed, causal=causal, dtype=dtype)
    qc, kc, vc = (np.ascontiguousarray(x) for x in (q, k, v))
    snap = Snapshot(q=q, k=k, v=v)
    out, lse, s = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    snap.check(ctx)
    out_c, lse_c, s_c = flashattn.flash_attn_func(qc, kc, vc, return_attn_probs=True, **kw)
    np.testing.assert_array_equal(out, out_c, err_msg=f"out {ctx}")
    np.testing.assert_array_equal(lse, lse_c, err_msg=f"lse {ctx}")
    np.testing.assert_array_equal(s, s_c, err_msg=f"S_dmask {ctx}")

    dout = randn(rng, (batch, sq, hq, 2 * dv), dtype)[..., :dv]           # row stride 2*dv
    out_s = np.zeros((batch, hq, sq, dv), dtype).transpose(0, 2, 1, 3)   # strided copy of out
    out_s[...] = out
    lse_s = np.zeros((batch, hq, sq + 5), np.float32)[..., 2:2 + sq]
    lse_s[...] = lse
    snap = Snapshot(dout=dout, q=q, k=k, v=v, out=out_s, lse=lse_s)
    grads = flashattn.flash_attn_backward(dout, q, k, v, out_s, lse_s, **kw)
    snap.check(ctx)
    grads_c = flashattn.flash_attn_backward(np.ascontiguousarray(dout), qc, kc, vc, out_c, lse_c, **kw)
    for name, a, b, x in zip(("dq", "dk", "dv"), grads, grads_c, (q, k, v)):
        assert a.shape == x.shape and a.dtype == x.dtype, f"{name} {ctx}"
        np.testing.assert_array_equal(a, b, err_msg=f"{name} from strided inputs {ctx}")
    refs = ref.attention_backward_ref(dout, q, k, v, causal=causal)
    naives = ((None,) * 3 if dtype == F32 else ref.attention_backward_naive(dout, q, k, v, causal=causal))
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        ref.check_close(name, g, r, n, dtype, grad=True, context=ctx)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_contiguous_last_dim(which):
    """A last dim with stride != 1 is either handled like a copy or refused with a
    ValueError naming the argument — never silently wrong."""
    seed = seed_for("lastdim", which)
    q, k, v = make_qkv(seed, 1, 20, 30, 2, 2, 16)
    args = {"q": q, "k": k, "v": v}
    wide = np.repeat(args[which], 2, axis=-1)
    args[which] = wide[..., ::2]
    assert args[which].strides[-1] != args[which].itemsize
    expected = flashattn.flash_attn_func(q, k, v)
    try:
        out = flashattn.flash_attn_func(args["q"], args["k"], args["v"])
    except ValueError as e:
        assert which in str(e), f"message does not name {which}: {e}"
        return
    np.testing.assert_array_equal(out, expected, err_msg=f"(seed={seed})")


def test_outputs_are_fresh_arrays():
    seed = seed_for("fresh")
    q, k, v = make_qkv(seed, 1, 16, 16, 2, 2, 8)
    out, lse, s = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    dq, dk, dv = flashattn.flash_attn_backward(np.ones_like(out), q, k, v, out, lse)
    for r in (out, lse, s, dq, dk, dv):
        assert isinstance(r, np.ndarray)
        for x in (q, k, v):
            assert not np.shares_memory(r, x)
