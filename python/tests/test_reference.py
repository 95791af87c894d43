"""Self-check of the NumPy references in reference.py (no flashattn needed).

The float64 forward is checked against a per-element brute-force loop, the analytic
backward against central finite differences, and the same-precision reference
against the float64 one.
"""

import ml_dtypes
import numpy as np
import pytest

import reference as ref
from conftest import BF16, alibi, make_dout, make_qkv, seed_for

VARIANTS = [
    dict(),
    dict(causal=True),
    dict(window_size=(2, 1)),
    dict(causal=True, window_size=(3, -1)),
    dict(window_size=(0, 0)),
    dict(softcap=0.7),
    dict(alibi=True),
    dict(alibi="batch", causal=True),
    dict(window_size=(2, 2), softcap=0.5, alibi=True, softmax_scale=0.8),
]


def _kwargs(v, seed, batch, heads):
    kw = {k: x for k, x in v.items() if k != "alibi"}
    if v.get("alibi"):
        kw["alibi_slopes"] = alibi(seed, batch, heads, per_batch=v["alibi"] == "batch", scale=0.5)
    return kw


@pytest.mark.parametrize("variant", VARIANTS, ids=[str(v) for v in VARIANTS])
@pytest.mark.parametrize("seqlens", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_reference_selfcheck(variant, seqlens):
    """attention_ref == brute force; attention_backward_ref == finite differences;
    the float32 naive reference == attention_ref; S_dmask convention holds."""
    sq, sk = seqlens
    seed = seed_for("selfcheck", str(variant), seqlens)
    batch, hq, hkv, d, dv = 2, 4, 2, 3, 5  # GQA and Dv != D
    q, k, v = make_qkv(seed, batch, sq, sk, hq, hkv, d, dv, np.float64)
    kw = _kwargs(variant, seed, batch, hq)
    ctx = f"(seed={seed}, seqlens={seqlens}, variant={variant})"

    out, lse, p = ref.attention_ref(q, k, v, **kw)
    out_bf, lse_bf = ref.attention_bruteforce(q, k, v, **kw)
    np.testing.assert_allclose(out, out_bf, rtol=1e-12, atol=1e-12, err_msg=ctx)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_bf), err_msg=ctx)
    fin = np.isfinite(lse_bf)
    np.testing.assert_allclose(lse[fin], lse_bf[fin], rtol=1e-12, atol=1e-12, err_msg=ctx)
    # Rows of P sum to 1, or to 0 where the row sees no key.
    np.testing.assert_allclose(p.sum(-1), np.where(np.isinf(lse), 0.0, 1.0), atol=1e-12, err_msg=ctx)

    # Analytic backward vs central differences of L = sum(out * dout).
    dout = make_dout(seed, out.shape, np.float64)
    rng = np.random.default_rng(seed + 7)
    weights = None
    if variant == {}:  # also check the dropout-weight path once per seqlen pair
        weights = np.where(rng.random(p.shape) < 0.3, 0.0, 1.0 / 0.7)
    grads = ref.attention_backward_ref(dout, q, k, v, dropout_weights=weights, **kw)

    def loss(qq, kk, vv):
        o, _, _ = ref.attention_ref(qq, kk, vv, dropout_weights=weights, **kw)
        return float(np.sum(o * dout))

    eps = 1e-6
    for which, g in zip(range(3), grads):
        base = [q, k, v]
        num = np.zeros_like(base[which])
        it = np.nditer(num, flags=["multi_index"])
        for _ in it:
            idx = it.multi_index
            plus = [x.copy() for x in base]
            minus = [x.copy() for x in base]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7,
                                   err_msg=f"grad {'qkv'[which]} {ctx}")

    # Same-precision reference in float32 agrees with float64 closely.
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    naive = ref.attention_naive(q32, k32, v32, dropout_weights=weights, **kw)
    out32, _, _ = ref.attention_ref(q32, k32, v32, dropout_weights=weights, **kw)
    np.testing.assert_allclose(naive, out32, atol=1e-5, err_msg=ctx)
    ng = ref.attention_backward_naive(dout.astype(np.float32), q32, k32, v32, dropout_weights=weights, **kw)
    rg = ref.attention_backward_ref(dout.astype(np.float32), q32, k32, v32, dropout_weights=weights, **kw)
    for a, b, n in zip(ng, rg, "qkv"):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"naive grad {n} {ctx}")


def test_reference_visibility_semantics():
    """Bottom-right aligned causal/window masks, as upstream documents them."""
    # Sq=2, Sk=5 causal: row 0 sees keys 0..3, row 1 sees 0..4.
    m = ref.visible_mask(2, 5, causal=True)
    assert m.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Sq=5, Sk=2 causal: the first three rows see nothing.
    m = ref.visible_mask(5, 2, causal=True)
    assert m.tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # Window (1, 0) on a square matrix: the diagonal and one to the left.
    m = ref.visible_mask(3, 3, window_size=(1, 0))
    assert m.tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    # No visible key: out 0, lse -inf, never NaN.
    q, k, v = make_qkv(1, 1, 4, 2, 2, 1, 3)
    out, lse, p = ref.attention_ref(q, k, v, causal=True)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[:, :, :2])) and not np.isnan(out).any()
    out, lse, _ = ref.attention_ref(q, k[:, :0], v[:, :0])
    assert out.shape == (1, 4, 2, 3) and np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_reference_naive_error_scale(dtype):
    """The same-precision reference is off from float64 by about the dtype's epsilon
    (so upstream's 2x / 3x rule is neither vacuous nor impossible)."""
    seed = seed_for("naive-scale", str(dtype))
    q, k, v = make_qkv(seed, 2, 64, 80, 4, 2, 32, 32, dtype)
    out, _, _ = ref.attention_ref(q, k, v, causal=True)
    naive = ref.attention_naive(q, k, v, causal=True)
    err = ref.max_abs(naive, out)
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert eps / 8 < err < 8 * eps, f"naive error {err} vs eps {eps} (seed={seed})"
    dout = make_dout(seed, out.shape, dtype)
    g_ref = ref.attention_backward_ref(dout, q, k, v, causal=True)
    g_naive = ref.attention_backward_naive(dout, q, k, v, causal=True)
    for a, b, n in zip(g_naive, g_ref, "qkv"):
        e = ref.max_abs(a, b)
        scale = float(np.max(np.abs(b)))
        assert 0 < e < 16 * eps * scale, f"naive d{n} error {e}, |ref| {scale} (seed={seed})"


@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(window_size=(1, 0), softcap=0.6)],
                         ids=["full", "causal", "window-softcap"])
def test_reference_sinks_selfcheck(variant):
    """With sinks: lse = log(sum_j e^s_ij + e^sink); a row that sees no key (Sq > Sk, causal)
    gives out 0 and lse = its sink; dq, dk, dv and dsinks == central differences; the float32
    naive reference == attention_ref."""
    seed = seed_for("sinks selfcheck", str(variant))
    batch, sq, sk, hq, hkv, d = 2, 5, 3, 4, 2, 3
    q, k, v = make_qkv(seed, batch, sq, sk, hq, hkv, d, 4, np.float64)
    sinks = np.array([-1.0, 0.3, 1.5, 3.0])
    out, lse, _ = ref.attention_ref(q, k, v, sinks=sinks, **variant)
    _, lse_plain, _ = ref.attention_ref(q, k, v, **variant)
    want = np.logaddexp(lse_plain, sinks[None, :, None])
    np.testing.assert_allclose(lse, want, rtol=1e-12, atol=1e-12)
    if variant.get("causal"):  # rows 0 and 1 see no key
        np.testing.assert_array_equal(out[:, :2], 0.0)
        np.testing.assert_allclose(lse[:, :, :2], np.broadcast_to(sinks[None, :, None], (batch, hq, 2)))

    dout = make_dout(seed, out.shape, np.float64)
    grads = ref.attention_backward_ref(dout, q, k, v, sinks=sinks, **variant)
    assert len(grads) == 4

    def loss(qq, kk, vv, ss):
        return float(np.sum(ref.attention_ref(qq, kk, vv, sinks=ss, **variant)[0] * dout))

    eps = 1e-6
    base = [q, k, v, sinks]
    for which, g in enumerate(grads):
        num = np.zeros_like(base[which])
        for idx in np.ndindex(num.shape):
            plus, minus = [x.copy() for x in base], [x.copy() for x in base]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7, err_msg=f"gradient {which}")

    naive = ref.attention_naive(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), sinks=sinks,
                                **variant)
    np.testing.assert_allclose(naive, out, atol=1e-5)
    naive_grads = ref.attention_backward_naive(dout.astype(np.float32), q.astype(np.float32),
                                               k.astype(np.float32), v.astype(np.float32), sinks=sinks, **variant)
    for g, n in zip(grads, naive_grads):
        np.testing.assert_allclose(n, g, atol=1e-4)
