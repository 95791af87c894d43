"""flash_attn_with_kvcache against a NumPy float64 reference built from the logical cache."""

import numpy as np
import pytest

import flashattn


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
