"""NumPy references for the flashattn tests, independent of the library.

Two references, as in upstream FlashAttention's tests/test_flash_attn.py:

* ``attention_ref`` / ``attention_backward_ref``: float64 textbook attention (the
  "upcast" reference, ``out_ref``) and its analytic gradients.
* ``attention_naive`` / ``attention_backward_naive``: the same computation in the
  input's precision (upstream's ``upcast=False`` reference, ``out_pt``): every
  materialized tensor (scores, probabilities, outputs, gradient intermediates) is
  rounded to the input dtype, products accumulate in float32.

The tolerance rule of upstream (see ``check_low_precision``) compares the library's
error against the float64 reference with the naive reference's error.

Layout is upstream's: q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).
Internally everything is (B, H, S, ·).
"""

from __future__ import annotations

import numpy as np

try:  # only needed for bfloat16 inputs
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    BFLOAT16 = None


# --------------------------------------------------------------------------- helpers


def _to_bhsd(x, dtype=np.float64):
    """(B, S, H, D) -> (B, H, S, D) as ``dtype``."""
    return np.ascontiguousarray(np.asarray(x).astype(dtype).transpose(0, 2, 1, 3))


def _from_bhsd(x):
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _repeat_kv(x, group):
    """(B, Hkv, S, D) -> (B, Hkv*group, S, D): q head h uses kv head h // group."""
    return np.repeat(x, group, axis=1) if group > 1 else x


def _sum_groups(x, group):
    """(B, Hkv*group, S, D) -> (B, Hkv, S, D), the adjoint of _repeat_kv."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return x.reshape(b, h // group, group, s, d).sum(axis=2)


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Bool (Sq, Sk): query i sees key j (bottom-right aligned, upstream semantics)."""
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diag = i + seqlen_k - seqlen_q
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    return mask


def alibi_bias(alibi_slopes, batch, heads, seqlen_q, seqlen_k):
    """float64 (B, H, Sq, Sk): -slope * |i + Sk - Sq - j|."""
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    if slopes.ndim == 1:
        slopes = np.broadcast_to(slopes[None, :], (batch, heads))
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    dist = np.abs(i + seqlen_k - seqlen_q - j).astype(np.float64)
    return -slopes[:, :, None, None] * dist[None, None]


def _with_sinks(s, sinks):
    """Scores (B, H, Sq, Sk) with one more key column per head: its sink logit (gpt-oss's
    sinks, unscaled), which joins the softmax denominator and has no value."""
    if sinks is None:
        return s
    col = np.broadcast_to(np.asarray(sinks, dtype=s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
    return np.concatenate([s, col], axis=-1)


def _scale(softmax_scale, head_dim):
    return 1.0 / np.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


# --------------------------------------------------------------------------- float64


def block_keep(block_mask, block_size, seqlen_q, seqlen_k):
    """Bool (Sq, Sk) of a block-sparse mask: (i, j) is kept where block_mask[i // bs, j // bs]."""
    rows = np.arange(seqlen_q) // block_size
    cols = np.arange(seqlen_k) // block_size
    return np.asarray(block_mask, dtype=bool)[rows[:, None], cols[None, :]]


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, dropout_weights=None, keep=None, sinks=None):
    """Float64 reference forward.

    dropout_weights: optional (B, Hq, Sq, Sk) multiplier applied to the probabilities
    (0 where dropped, 1/(1-p) where kept), i.e. out = (P * w) @ v. keep: optional bool
    (Sq, Sk) mask of further visible pairs (a block mask, see block_keep). sinks: optional
    (Hq,) logits, one per head, in every row's denominator (lse includes them; P does not).

    Returns (out (B, Sq, Hq, Dv), lse (B, Hq, Sq), P (B, Hq, Sq, Sk)), all float64.
    """
    qh, kh, vh = _to_bhsd(q), _to_bhsd(k), _to_bhsd(v)
    batch, heads, seqlen_q, dim = qh.shape
    seqlen_k = kh.shape[2]
    group = heads // kh.shape[1]
    kh, vh = _repeat_kv(kh, group), _repeat_kv(vh, group)
    scale = _scale(softmax_scale, dim)

    s = (qh @ kh.transpose(0, 1, 3, 2)) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, batch, heads, seqlen_q, seqlen_k)
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size)
    if keep is not None:
        mask = mask & keep
    s = _with_sinks(np.where(mask, s, -np.inf), sinks)

    with np.errstate(invalid="ignore"):
        m = np.max(s, axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m_safe)
        total = e.sum(axis=-1, keepdims=True)
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
        with np.errstate(divide="ignore"):
            lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)[..., 0]
    p = p[..., :seqlen_k]
    z = p if dropout_weights is None else p * np.asarray(dropout_weights, dtype=np.float64)
    out = z @ vh
    return _from_bhsd(out), lse, p


def attention_backward_ref(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, dropout_weights=None, keep=None, sinks=None):
    """Analytic float64 gradients (dq, dk, dv) of sum(out * dout), shapes of q, k, v; with
    sinks also dsinks (Hq,) = -sum over batch and rows of e^(sink - lse) * rowsum(dout * out)."""
    qh, kh0, vh0 = _to_bhsd(q), _to_bhsd(k), _to_bhsd(v)
    doh = _to_bhsd(dout)
    batch, heads, seqlen_q, dim = qh.shape
    group = heads // kh0.shape[1]
    kh, vh = _repeat_kv(kh0, group), _repeat_kv(vh0, group)
    scale = _scale(softmax_scale, dim)

    _, lse, p = attention_ref(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, keep=keep,
                              sinks=sinks)
    z = p if dropout_weights is None else p * np.asarray(dropout_weights, dtype=np.float64)

    dv = z.transpose(0, 1, 3, 2) @ doh                      # (B, Hq, Sk, Dv)
    da = doh @ vh.transpose(0, 1, 3, 2)                     # dO V^T, before dropout weights
    delta = np.sum(z * da, axis=-1, keepdims=True)          # rowsum(dO * O)
    ds = z * da - p * delta                                 # d loss / d (score after softcap+alibi)
    if softcap > 0:
        t = np.tanh((qh @ kh.transpose(0, 1, 3, 2)) * scale / softcap)
        ds = ds * (1.0 - t * t)
    ds = ds * scale                                         # d loss / d (q . k)
    dq = ds @ kh
    dk = ds.transpose(0, 1, 3, 2) @ qh
    grads = (_from_bhsd(dq), _from_bhsd(_sum_groups(dk, group)), _from_bhsd(_sum_groups(dv, group)))
    if sinks is None:
        return grads
    p_sink = np.exp(np.asarray(sinks, dtype=np.float64)[None, :, None] - lse)
    return grads + (-np.sum(p_sink * delta[..., 0], axis=(0, 2)),)


# --------------------------------------------------------------------------- same precision


def _rounder(dtype):
    dtype = np.dtype(dtype)

    def rnd(x):
        return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)

    return rnd


def _softmax_f32(s):
    """Softmax over the last axis in float32 (fully masked rows give 0)."""
    if s.shape[-1] == 0:
        return np.zeros(s.shape, np.float32)
    with np.errstate(invalid="ignore"):
        m = np.max(s, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, np.float32(0))
        e = np.exp(s - m)
        total = e.sum(axis=-1, keepdims=True, dtype=np.float32)
        return np.where(total > 0, e / np.where(total > 0, total, 1), 0).astype(np.float32)


def _naive_scores(q, k, rnd, scale, causal, window_size, softcap, alibi_slopes, keep=None):
    qh, kh = _to_bhsd(q, np.float32), _to_bhsd(k, np.float32)
    batch, heads, seqlen_q, _ = qh.shape
    seqlen_k = kh.shape[2]
    group = heads // kh.shape[1]
    kh = _repeat_kv(kh, group)
    qs = rnd(qh * np.float32(scale))                        # upstream: q / sqrt(d) in the dtype
    s = rnd(qs @ kh.transpose(0, 1, 3, 2))
    t = None
    if softcap > 0:
        t = rnd(np.tanh(rnd(s / np.float32(softcap))))
        s = rnd(t * np.float32(softcap))
    if alibi_slopes is not None:
        s = rnd(s + alibi_bias(alibi_slopes, batch, heads, seqlen_q, seqlen_k).astype(np.float32))
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size)
    if keep is not None:
        mask = mask & keep
    s = np.where(mask, s, np.float32(-np.inf))
    return qs, kh, s, t, group


def attention_naive(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_weights=None, keep=None, sinks=None):
    """Forward in the input precision (upstream's upcast=False reference).

    Returns out (B, Sq, Hq, Dv) as float32 values rounded to q's dtype.
    """
    dtype = np.asarray(q).dtype
    rnd = _rounder(dtype)
    scale = _scale(softmax_scale, np.shape(q)[-1])
    _, _, s, _, group = _naive_scores(q, k, rnd, scale, causal, window_size, softcap, alibi_slopes, keep)
    p = rnd(_softmax_f32(_with_sinks(s, sinks)))[..., :s.shape[-1]]
    vh = _repeat_kv(_to_bhsd(v, np.float32), group)
    if dropout_weights is not None:
        p = rnd(p * np.asarray(dropout_weights, dtype=np.float32))
    return _from_bhsd(rnd(p @ vh))


def attention_backward_naive(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, dropout_weights=None, keep=None, sinks=None):
    """Gradients in the input precision, as autograd through attention_naive would give
    (with sinks, dsinks too, accumulated in float32)."""
    dtype = np.asarray(q).dtype
    rnd = _rounder(dtype)
    scale = _scale(softmax_scale, np.shape(q)[-1])
    qs, kh, s, t, group = _naive_scores(q, k, rnd, scale, causal, window_size, softcap, alibi_slopes, keep)
    vh = _repeat_kv(_to_bhsd(v, np.float32), group)
    doh = _to_bhsd(dout, np.float32)
    p_all = rnd(_softmax_f32(_with_sinks(s, sinks)))
    p = p_all[..., :s.shape[-1]]
    if dropout_weights is not None:
        w = np.asarray(dropout_weights, dtype=np.float32)
        z = rnd(p * w)
    else:
        w, z = None, p
    dv = rnd(z.transpose(0, 1, 3, 2) @ doh)
    dz = rnd(doh @ vh.transpose(0, 1, 3, 2))
    dp = rnd(dz * w) if w is not None else dz
    delta = np.sum(dp * p, axis=-1, keepdims=True, dtype=np.float32)
    ds = rnd(p * (dp - delta))                              # softmax backward, one rounding
    if softcap > 0:
        ds = rnd(ds * np.float32(softcap))
        ds = rnd(ds * (1 - t * t))
        ds = rnd(ds / np.float32(softcap))
    dqs = rnd(ds @ kh)
    dq = rnd(dqs * np.float32(scale))
    dk = rnd(ds.transpose(0, 1, 3, 2) @ qs)
    grads = (_from_bhsd(dq), _from_bhsd(rnd(_sum_groups(dk, group))), _from_bhsd(rnd(_sum_groups(dv, group))))
    if sinks is None:
        return grads
    return grads + (-np.sum(p_all[..., -1] * delta[..., 0], axis=(0, 2), dtype=np.float32),)


# --------------------------------------------------------------------------- tolerance rule


def max_abs(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)))


def check_close(name, actual, ref, naive, dtype, *, grad=False, context=""):
    """Upstream's rule. float32: |actual - ref| <= 1e-5 (out) / 1e-4 (grads);
    float16/bfloat16: |actual - ref| <= 2 x |naive - ref| + 1e-5 (out),
    3 x |naive - ref| + 1e-4 (grads).
    """
    actual = np.asarray(actual)
    assert actual.shape == np.shape(ref), f"{name}: shape {actual.shape} != {np.shape(ref)} {context}"
    assert not np.any(np.isnan(actual.astype(np.float32))), f"{name}: NaN in result {context}"
    err = max_abs(actual, ref)
    if np.dtype(dtype) == np.float32:
        tol = 1e-4 if grad else 1e-5
        naive_err = None
    else:
        naive_err = max_abs(naive, ref)
        tol = (3 * naive_err + 1e-4) if grad else (2 * naive_err + 1e-5)
    assert err <= tol, (f"{name}: max |actual - ref| = {err:.3e} > tolerance {tol:.3e} "
                        f"(naive error {naive_err}) {context}")
    return err


def dropout_weights_from_s_dmask(s_dmask, dropout_p):
    """Keep weights (0 or 1/(1-p)) recovered from the returned S_dmask."""
    s = np.asarray(s_dmask)
    return np.where(s > 0, 1.0 / (1.0 - np.float64(np.float32(dropout_p))), 0.0)


# --------------------------------------------------------------------------- brute force


def attention_bruteforce(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None):
    """Per-element loops straight from the definitions (tiny sizes only): out, lse."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    batch, seqlen_q, heads, dim = q.shape
    _, seqlen_k, heads_kv, dim_v = v.shape
    scale = _scale(softmax_scale, dim)
    left, right = window_size
    if causal:
        right = 0
    out = np.zeros((batch, seqlen_q, heads, dim_v))
    lse = np.full((batch, heads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(heads):
            hk = h // (heads // heads_kv)
            slope = 0.0
            if alibi_slopes is not None:
                a = np.asarray(alibi_slopes, dtype=np.float64)
                slope = a[h] if a.ndim == 1 else a[b, h]
            for i in range(seqlen_q):
                scores = {}
                for j in range(seqlen_k):
                    d = i + seqlen_k - seqlen_q
                    if left >= 0 and j < d - left:
                        continue
                    if right >= 0 and j > d + right:
                        continue
                    s = sum(q[b, i, h, c] * k[b, j, hk, c] for c in range(dim)) * scale
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    s -= slope * abs(i + seqlen_k - seqlen_q - j)
                    scores[j] = s
                if not scores:
                    continue
                mx = max(scores.values())
                total = sum(np.exp(s - mx) for s in scores.values())
                lse[b, h, i] = mx + np.log(total)
                for j, s in scores.items():
                    out[b, i, h, :] += np.exp(s - mx) / total * v[b, j, hk, :]
    return out, lse


# --------------------------------------------------------------------------- quantized cache kernels


def quantized_cache_tolerance(kernel):
    """Of max|v|, on an FP8 or int8 cache: float32 rounding (decode), four half-precision
    roundings (decode_fp16: half-precision products, short half-precision sums) or four bf16
    roundings (decode_bf16: q and P·factor rounded to bf16; tests/test_kvcache.cpp and
    tests/test_int8_cache.cpp hold both to a yardstick in their precision)."""
    return {"decode_fp16": 2.0**-9, "decode_bf16": 2.0**-7}.get(kernel, 1e-4)


def planned_quantized_decode():
    """The kernel the planner takes for a few decode rows over an FP8 or int8 cache here:
    decode_fp16 where the CPU has AVX512-FP16, else decode_bf16 where VDPBF16PS outpaces FMA
    (AMD's AVX512-BF16 cores), else decode (src/cpu/plan.cpp)."""
    import flashattn

    hw = flashattn._C.cpu_hardware()
    if hw["decode_fp16"] == "1":
        return "decode_fp16"
    if hw["decode_bf16"] == "1" and hw["tiled_bf16_default"] == "1" and hw["amx_bf16"] == "0":
        return "decode_bf16"
    return "decode"


def run_kernel(kernel, call):
    """call()'s result; a visible skip where this CPU lacks the kernel (decode_fp16 without
    AVX512-FP16, decode_bf16 without AVX512-BF16), which must be the only reason the call fails."""
    import pytest

    isa = {"decode_fp16": "AVX512-FP16", "decode_bf16": "AVX512-BF16"}
    try:
        return call()
    except ValueError as e:
        assert kernel in isa and f"{isa[kernel]} (this one: no)" in str(e), str(e)
        pytest.skip(f"no {isa[kernel]} on this CPU: {kernel} cannot run here")


def empty_cache(fmt, per_token, pages, slots, hkv, d):
    """Codes, scales and zero points (None but for u8) of an empty pool of `fmt`: per-token
    scales (pages, slots, Hkv) for int8, which appends set; e4m3 descales per page."""
    codes = np.zeros((pages, slots, hkv, d), np.int8 if fmt == "s8" else np.uint8)
    if fmt == "e4m3":
        return codes, np.zeros((pages, hkv), np.float32), None
    shape = (pages, slots, hkv) if per_token else (pages, hkv)
    scale = np.full(shape, 0.25 if fmt == "u8" else 0.0625, np.float32)  # per page: ±8 and ±32 covered
    zero = np.full(shape, 127.5, np.float32) if fmt == "u8" else None
    return codes, scale, zero


def values(fmt, codes, scale, zero):
    """The float64 values of a pool, (pages, slots, Hkv, D)."""
    if fmt == "e4m3":
        import ml_dtypes

        return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale[:, None, :, None]
    s = scale[..., None] if scale.ndim == 3 else scale[:, None, :, None]
    if fmt == "s8":
        return codes.astype(np.float64) * s
    z = zero[..., None] if zero.ndim == 3 else zero[:, None, :, None]
    return (codes.astype(np.float64) - z) * s
