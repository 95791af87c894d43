"""int8 KV caches (include/flashattn/kv_quant.hpp) through flash_attn_with_kvcache and
flash_attn_varlen_func(block_table=...): appends within the stated bound, attention against a
NumPy float64 reference on the dequantized cache, NumPy and torch alike, errors by name."""

import numpy as np
import pytest

import flashattn
from reference import (attention_ref, empty_cache, planned_quantized_decode, quantized_cache_tolerance, run_kernel,
                       values)

FORMATS = [("u8", "u8"), ("s8", "s8"), ("u8", "s8"), ("s8", "e4m3")]


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("k_fmt,v_fmt", FORMATS)
@pytest.mark.parametrize("page_size", [None, 3, 16])
def test_int8_kvcache_appends_then_attends(page_size, k_fmt, v_fmt, per_token):
    rng = np.random.default_rng(31)
    batch, hq, hkv, d, cap = 2, 6, 2, 40, 48
    per_seq = 1 if page_size is None else -(-cap // page_size)
    pages, slots = batch * per_seq, cap if page_size is None else page_size
    table = None if page_size is None else rng.permutation(pages).astype(np.int32).reshape(batch, per_seq)
    k_cache, k_scale, k_zero = empty_cache(k_fmt, per_token, pages, slots, hkv, d)
    v_cache, v_scale, v_zero = empty_cache(v_fmt, per_token, pages, slots, hkv, d)
    quant = {"k_quant": k_fmt, "v_quant": v_fmt}
    seqlens = np.zeros(batch, np.int32)
    logical_k, logical_v = np.zeros((batch, 0, hkv, d)), np.zeros((batch, 0, hkv, d))
    for step, (n, magnitude) in enumerate([(29, 2.0), (1, 4.0), (1, 0.5)]):  # a prefill chunk, then decode steps
        k_new = (magnitude * rng.standard_normal((batch, n, hkv, d))).astype(np.float32)
        v_new = (magnitude * rng.standard_normal((batch, n, hkv, d))).astype(np.float32)
        q = rng.standard_normal((batch, n, hq, d), dtype=np.float32)
        out = flashattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=table, causal=True,
            k_scale=k_scale, v_scale=v_scale, k_zero_point=k_zero, v_zero_point=v_zero, num_threads=1 + step, **quant)
        seqlens += n
        logical_k = np.concatenate([logical_k, k_new], axis=1)
        logical_v = np.concatenate([logical_v, v_new], axis=1)
        kv = [values(k_fmt, k_cache, k_scale, k_zero), values(v_fmt, v_cache, v_scale, v_zero)]
        for b in range(batch):
            rows = [b] if table is None else table[b]
            keys, vals = (np.concatenate([x[p] for p in rows])[:seqlens[b]] for x in kv)
            for fmt, stored, x, scale, zero in ((k_fmt, keys, logical_k[b], k_scale, k_zero),
                                                (v_fmt, vals, logical_v[b], v_scale, v_zero)):
                if fmt == "e4m3" or not per_token:
                    continue  # the FP8 bound: tests/test_kvcache.py; per page: tests/test_int8_cache.cpp
                pos = np.arange(seqlens[b])
                page = np.full_like(pos, b) if table is None else table[b, pos // slots]
                step_scale = scale[page, pos % slots][..., None]
                step_zero = np.abs(zero[page, pos % slots][..., None]) if zero is not None else 0.0
                bound = (0.5 + 2.0**-23 * (1.0 + step_zero)) * step_scale
                assert (np.abs(stored - x) <= bound).all(), f"{fmt} of sequence {b} after step {step}"
            want = attention_ref(q[b][None], keys[None], vals[None], causal=True)[0][0]
            # the prefill chunk runs the tiled kernel (float32 on the values); the decode steps the
            # planner's quantized decode kernel, whose bound is the wider
            atol = quantized_cache_tolerance(planned_quantized_decode()) * np.abs(vals).max()
            np.testing.assert_allclose(out[b], want, atol=atol, err_msg=f"sequence {b}")
        if table is None:
            continue
        # The pools after the append, read by flash_attn_varlen_func: the same result, bit for bit.
        cu_q = np.arange(0, (batch + 1) * n, n, dtype=np.int32)
        again = flashattn.flash_attn_varlen_func(
            q.reshape(batch * n, hq, d), k_cache, v_cache, cu_q, None, n, None, causal=True, block_table=table,
            seqused_k=seqlens, k_scale=k_scale, v_scale=v_scale, k_zero_point=k_zero, v_zero_point=v_zero,
            num_threads=1 + step, **quant)
        np.testing.assert_array_equal(again.reshape(out.shape), out)


def test_int8_kvcache_from_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(32)
    k_cache, k_scale, k_zero = empty_cache("u8", True, 4, 16, 2, 16)
    v_cache, v_scale, _ = empty_cache("s8", True, 4, 16, 2, 16)
    table = np.array([[2, 0], [1, 3]], np.int32)
    seqlens = np.array([0, 5], np.int32)
    q = rng.standard_normal((2, 3, 4, 16), dtype=np.float32)
    k_new, v_new = (rng.standard_normal((2, 3, 2, 16), dtype=np.float32) for _ in range(2))
    t = {name: torch.from_numpy(x.copy()) for name, x in (("k_cache", k_cache), ("v_cache", v_cache),
                                                          ("k_scale", k_scale), ("k_zero", k_zero),
                                                          ("v_scale", v_scale))}
    args = dict(k=k_new, v=v_new, cache_seqlens=seqlens, block_table=table, causal=True, k_quant="u8")
    want = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale,
                                             k_zero_point=k_zero, **args)
    got = flashattn.flash_attn_with_kvcache(
        torch.from_numpy(q), t["k_cache"], t["v_cache"], k_scale=t["k_scale"], v_scale=t["v_scale"],
        k_zero_point=t["k_zero"], **{**args, **{name: torch.from_numpy(args[name]) for name in
                                                 ("k", "v", "cache_seqlens", "block_table")}})
    np.testing.assert_array_equal(got.numpy(), want)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale), ("k_zero", k_zero),
                    ("v_scale", v_scale)):
        np.testing.assert_array_equal(t[name].numpy(), x, err_msg=f"{name} written as the NumPy call wrote it")


def test_int8_kvcache_rejects_bad_formats():
    rng = np.random.default_rng(33)
    k_cache, k_scale, k_zero = empty_cache("u8", True, 2, 8, 2, 16)
    q = rng.standard_normal((1, 1, 2, 16), dtype=np.float32)
    with pytest.raises(ValueError, match="k_zero_point: u8 codes read as"):
        flashattn.flash_attn_with_kvcache(q, k_cache, k_cache.copy(), k_scale=k_scale, v_scale=k_scale.copy(),
                                          k_quant="u8", v_quant="u8", v_zero_point=k_zero)
    with pytest.raises(TypeError, match="k_quant: u8 codes but the cache is int8"):
        flashattn.flash_attn_with_kvcache(q, k_cache.view(np.int8), k_cache.view(np.int8), k_scale=k_scale,
                                          v_scale=k_scale, k_quant="u8")
    with pytest.raises(TypeError, match="k_quant: 's8' describes a cache of codes, not a float32 cache"):
        flashattn.flash_attn_with_kvcache(q, k_cache.astype(np.float32), k_cache.astype(np.float32), k_quant="s8")
    with pytest.raises(TypeError, match="k_zero_point, v_zero_point: zero points belong to a u8 cache"):
        flashattn.flash_attn_with_kvcache(q, k_cache.astype(np.float32), k_cache.astype(np.float32),
                                          k_zero_point=k_zero)
    with pytest.raises(ValueError, match="v_quant: expected 'e4m3', 'u8' or 's8', got 'int4'"):
        flashattn.flash_attn_with_kvcache(q, k_cache, k_cache.copy(), k_scale=k_scale, v_scale=k_scale.copy(),
                                          k_quant="u8", k_zero_point=k_zero, v_quant="int4")


@pytest.mark.parametrize("fmt", ["s8", "u8", "e4m3"])
@pytest.mark.parametrize("kernel", ["decode", "decode_fp16", "decode_bf16"])
def test_huge_query_scales_keep_the_winning_key(fmt, kernel):
    """softmax_scale up to 1e33 (q·scale·log2 e past 2^104; the float32 decode kernel's Q·codes,
    before the int8 scale, reach float32's largest near 1e35): the softmax is one key, the one
    q is made of, on every decode kernel. The narrow kernels scaled each q row by at most 2^-100
    into their range: beyond, half-precision products were inf (NaN out) and decode_bf16's
    integer q split wrapped (another key won)."""
    import ml_dtypes

    rng = np.random.default_rng(31)
    n, d = 64, 64
    x = rng.standard_normal((1, n, 1, d)).astype(np.float32)
    codes, scale, zero = empty_cache(fmt, True, 1, n, 1, d)
    v_codes, v_scale, v_zero = empty_cache(fmt, True, 1, n, 1, d)
    if fmt == "e4m3":
        codes[:] = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        v_codes[:] = rng.standard_normal(codes.shape).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        scale[:], v_scale[:] = 1.0, 1.0
    else:
        flashattn.flash_attn_with_kvcache(x[:, :1], codes, v_codes, k=x, v=rng.standard_normal(x.shape).astype(np.float32),
                                          cache_seqlens=np.array([0], np.int32), k_scale=scale, v_scale=v_scale,
                                          k_zero_point=zero, v_zero_point=v_zero, k_quant=fmt, v_quant=fmt)
    keys, vals = values(fmt, codes, scale, zero)[0], values(fmt, v_codes, v_scale, v_zero)[0]
    q = keys[7][None, None].astype(np.float32)  # key 7 scores |k7|², far above every other key
    extra = {} if fmt == "e4m3" else dict(k_zero_point=zero, v_zero_point=v_zero, k_quant=fmt, v_quant=fmt)
    tolerance = quantized_cache_tolerance(kernel) * np.abs(vals).max()
    for softmax_scale in (1e25, 1e31, 1e33):
        out = run_kernel(kernel, lambda: flashattn.flash_attn_with_kvcache(
            q, codes, v_codes, cache_seqlens=np.array([n], np.int32), k_scale=scale, v_scale=v_scale,
            softmax_scale=softmax_scale, kernel=kernel, num_threads=1, **extra))
        assert np.abs(out[0, 0, 0] - vals[7, 0]).max() <= tolerance, (softmax_scale, out[0, 0, 0, :4], vals[7, 0, :4])
