"""flash_attn_with_kvcache against a NumPy float64 reference built from the logical cache."""

import ml_dtypes
import numpy as np
import pytest

import flashattn
from reference import quantized_cache_tolerance, run_kernel


def rotary_tables(positions, half):
    angle = np.arange(positions)[:, None] * 10000.0 ** (-np.arange(half) / half)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate(x, pos, cos, sin, interleaved):
    x = x.astype(np.float64).copy()
    half = cos.shape[1]
    a = np.arange(half) * 2 if interleaved else np.arange(half)
    b = a + 1 if interleaved else a + half
    c, s = cos[pos].astype(np.float64), sin[pos].astype(np.float64)
    xa, xb = x[..., a].copy(), x[..., b].copy()
    x[..., a] = xa * c - xb * s
    x[..., b] = xa * s + xb * c
    return x


def attention(q, k, v, causal):
    """q (Sq, H, D), k/v (Sk, Hkv, D), float64, bottom-right causal."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[0], k.shape[0]
        s = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v)


@pytest.mark.parametrize("page_size", [None, 1, 3, 16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_matches_reference(page_size, interleaved):
    rng = np.random.default_rng(7)
    batch, sq, hq, hkv, d, new, cap = 2, 2, 4, 2, 16, 3, 32
    seqlens = np.array([5, 20], np.int32)
    q = rng.standard_normal((batch, sq, hq, d), dtype=np.float32)
    old_k = rng.standard_normal((batch, cap, hkv, d), dtype=np.float32)
    old_v = rng.standard_normal((batch, cap, hkv, d), dtype=np.float32)
    k_new = rng.standard_normal((batch, new, hkv, d), dtype=np.float32)
    v_new = rng.standard_normal((batch, new, hkv, d), dtype=np.float32)
    cos, sin = rotary_tables(64, 4)
    if page_size is None:
        k_cache, v_cache, table = old_k.copy(), old_v.copy(), None
    else:
        per_seq = -(-cap // page_size)
        pages = batch * per_seq
        order = rng.permutation(pages).astype(np.int32)
        table = order.reshape(batch, per_seq)
        k_cache = np.zeros((pages, page_size, hkv, d), np.float32)
        v_cache = np.zeros_like(k_cache)
        for b in range(batch):
            for pos in range(cap):
                k_cache[table[b, pos // page_size], pos % page_size] = old_k[b, pos]
                v_cache[table[b, pos // page_size], pos % page_size] = old_v[b, pos]
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                            cache_seqlens=seqlens, block_table=table, causal=True,
                                            rotary_interleaved=interleaved)
    for b in range(batch):
        n = seqlens[b] + new
        keys = old_k[b, :n].astype(np.float64).copy()
        vals = old_v[b, :n].astype(np.float64).copy()
        for t in range(new):
            keys[seqlens[b] + t] = rotate(k_new[b, t], seqlens[b] + t, cos, sin, interleaved)
            vals[seqlens[b] + t] = v_new[b, t]
        qr = np.stack([rotate(q[b, i], seqlens[b] + i, cos, sin, interleaved) for i in range(sq)])
        want = attention(qr, keys, vals, causal=True)
        np.testing.assert_allclose(out[b], want, atol=1e-5, err_msg=f"sequence {b}")
        # the new tokens were written into the cache, rotated keys and plain values
        for t in range(new):
            pos = seqlens[b] + t
            slot = (b, pos) if table is None else (table[b, pos // page_size], pos % page_size)
            np.testing.assert_allclose(k_cache[slot], keys[pos], atol=1e-5)
            np.testing.assert_array_equal(v_cache[slot], v_new[b, t])


def test_kvcache_leftpad_skips_the_padding():
    rng = np.random.default_rng(8)
    batch, hq, hkv, d, cap = 2, 4, 2, 16, 24
    seqlens, leftpad = np.array([9, 20], np.int32), np.array([3, 0], np.int32)
    q = rng.standard_normal((batch, 1, hq, d), dtype=np.float32)
    k_cache = rng.standard_normal((batch, cap, hkv, d), dtype=np.float32)
    v_cache = rng.standard_normal((batch, cap, hkv, d), dtype=np.float32)
    k_cache[0, :3] = v_cache[0, :3] = 1e4  # padding: attending to it would dominate
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                            causal=True)
    for b in range(batch):
        keys = k_cache[b, leftpad[b]:seqlens[b]].astype(np.float64)
        vals = v_cache[b, leftpad[b]:seqlens[b]].astype(np.float64)
        want = attention(q[b].astype(np.float64), keys, vals, causal=True)
        np.testing.assert_allclose(out[b], want, atol=1e-5, err_msg=f"sequence {b}")


# ---- FP8 e4m3 caches: uint8 codes with one float32 descale per (page, kv head) -----------------

E4M3_NAN = 0x7F  # S.1111.111 (either sign) is NaN: never a cache value


def random_codes(rng, shape):
    """Random e4m3 codes, every finite one possible (subnormals included), NaN excluded."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((codes & 0x7F) == E4M3_NAN, codes ^ 0x01, codes).astype(np.uint8)


def decode(codes, descale):
    """codes (..., T, Hkv, D) with descale (..., Hkv) -> float64 values, decoded by ml_dtypes."""
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * descale[..., None, :, None]


def fp8_cache(rng, batch, cap, hkv, d, page_size):
    """A paged (or contiguous when page_size is None) FP8 cache of random codes with a different
    power-of-two descale per (page, kv head), and the block table (None when contiguous)."""
    per_seq = 1 if page_size is None else -(-cap // page_size)
    pages, slots = batch * per_seq, cap if page_size is None else page_size
    caches = [random_codes(rng, (pages, slots, hkv, d)) for _ in range(2)]
    scales = [np.exp2(rng.integers(-10, -5, size=(pages, hkv))).astype(np.float32) for _ in range(2)]
    table = None if page_size is None else rng.permutation(pages).astype(np.int32).reshape(batch, per_seq)
    return caches, scales, table


def logical(cache, scale, table, b, n, page_size):
    """The first n dequantized tokens of sequence b, (n, Hkv, D) float64."""
    if table is None:
        return decode(cache[b], scale[b])[:n]
    pages = [decode(cache[p], scale[p]) for p in table[b]]
    return np.concatenate(pages)[:n]


@pytest.mark.parametrize("kernel", ["decode", "decode_fp16", "decode_bf16"])
@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 256])
def test_fp8_kvcache_matches_reference(page_size, kernel):
    rng = np.random.default_rng(11)
    batch, hq, hkv, d, cap = 2, 8, 2, 40, 300  # D not a multiple of the vector width
    seqlens = np.array([7, 293], np.int32)  # 293 keys: not a multiple of any key block
    (k_cache, v_cache), (k_scale, v_scale), table = fp8_cache(rng, batch, cap, hkv, d, page_size)
    before = [x.copy() for x in (k_cache, v_cache, k_scale, v_scale)]
    q = rng.standard_normal((batch, 1, hq, d), dtype=np.float32)
    out, lse = run_kernel(kernel, lambda: flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_scale=k_scale, v_scale=v_scale,
        return_softmax_lse=True, kernel=kernel))
    for b in range(batch):
        keys = logical(k_cache, k_scale, table, b, seqlens[b], page_size)
        vals = logical(v_cache, v_scale, table, b, seqlens[b], page_size)
        want = attention(q[b].astype(np.float64), keys, vals, causal=False)
        scale = np.abs(vals).max()  # outputs are convex combinations of the values
        np.testing.assert_allclose(out[b], want, atol=quantized_cache_tolerance(kernel) * scale, err_msg=f"sequence {b}")
        assert np.isfinite(lse[b]).all()
    for x, y in zip(before, (k_cache, v_cache, k_scale, v_scale)):  # nothing appended, nothing written
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kernel", ["decode", "decode_fp16", "decode_bf16"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_fp8_kvcache_appends_within_the_documented_bound(page_size, kernel):
    rng = np.random.default_rng(12)
    batch, hq, hkv, d, cap, new = 2, 4, 2, 16, 48, 3
    seqlens = np.array([5, 30], np.int32)
    (k_cache, v_cache), (k_scale, v_scale), table = fp8_cache(rng, batch, cap, hkv, d, page_size)
    q = rng.standard_normal((batch, 2, hq, d), dtype=np.float32)
    k_new = 4 * rng.standard_normal((batch, new, hkv, d), dtype=np.float32)  # larger: descales must grow
    v_new = 4 * rng.standard_normal((batch, new, hkv, d), dtype=np.float32)
    out = run_kernel(kernel, lambda: flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=table, k_scale=k_scale,
        v_scale=v_scale, causal=True, kernel=kernel))
    for b in range(batch):
        n = seqlens[b] + new
        keys = logical(k_cache, k_scale, table, b, n, page_size)  # as the call left the cache
        vals = logical(v_cache, v_scale, table, b, n, page_size)
        for name, stored, x, scale in (("k", keys, k_new, k_scale), ("v", vals, v_new, v_scale)):
            page = (b if table is None else table[b, (seqlens[b] + np.arange(new)) // page_size])
            descale = scale[page].reshape(-1, hkv, 1) if table is not None else scale[b][None, :, None]
            bound = 2.0**-4 * np.abs(x[b]) + 2.0**-9 * descale
            assert (np.abs(stored[seqlens[b]:] - x[b]) <= bound).all(), f"{name} of sequence {b}"
        want = attention(q[b].astype(np.float64), keys, vals, causal=True)
        np.testing.assert_allclose(out[b], want, atol=quantized_cache_tolerance(kernel) * np.abs(vals).max(),
                                   err_msg=f"sequence {b}")


def test_fp8_kvcache_from_torch_float8():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    (k_cache, v_cache), (k_scale, v_scale), table = fp8_cache(rng, 1, 64, 2, 16, 16)
    q = rng.standard_normal((1, 1, 4, 16), dtype=np.float32)
    seqlens = np.array([50], np.int32)
    want = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                             k_scale=k_scale, v_scale=v_scale)
    t = {name: torch.from_numpy(x) for name, x in (("q", q), ("k_scale", k_scale), ("v_scale", v_scale),
                                                    ("seqlens", seqlens), ("table", table))}
    got = flashattn.flash_attn_with_kvcache(
        t["q"], torch.from_numpy(k_cache).view(torch.float8_e4m3fn), torch.from_numpy(v_cache).view(torch.float8_e4m3fn),
        cache_seqlens=t["seqlens"], block_table=t["table"], k_scale=t["k_scale"], v_scale=t["v_scale"])
    np.testing.assert_array_equal(got.numpy(), want)


def test_fp8_kvcache_rejects_bad_descales():
    rng = np.random.default_rng(14)
    (k_cache, v_cache), (k_scale, v_scale), _ = fp8_cache(rng, 1, 8, 2, 16, None)
    q = rng.standard_normal((1, 1, 2, 16), dtype=np.float32)
    with pytest.raises(ValueError, match="k_scale: an FP8 cache"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, v_scale=v_scale)
    with pytest.raises(TypeError, match="v_scale: dtype float64"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale.astype(np.float64))
    with pytest.raises(TypeError, match="k_scale, v_scale: descales belong to an FP8 cache"):
        flashattn.flash_attn_with_kvcache(q, k_cache.astype(np.float32), v_cache.astype(np.float32), k_scale=k_scale,
                                          v_scale=v_scale)
    with pytest.raises(TypeError, match="v_cache: dtype float32 but the cache holds codes"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache.astype(np.float32), k_scale=k_scale, v_scale=v_scale)
    bad = k_scale.copy()
    bad[0, 1] = 0.0
    with pytest.raises(ValueError, match=r"k_scale: \[0, 1\] = 0"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([8], np.int32), k_scale=bad,
                                          v_scale=v_scale)
