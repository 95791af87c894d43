"""Seeded random decode calls over quantized KV caches, every decode kernel this CPU runs,
against the float64 reference on the dequantized pools.

Each case draws its formats (e4m3, u8, s8; per page or per token), layout (contiguous or
pages of 1 to 64 in a shuffled table), batch of ragged lengths (empty ones too), GQA group,
head dims, query rows, and variants (causal, window, softcap, ALiBi, sinks). Keys are built so
that scores rise along the sequence by up to 7.5 in log2 units — inside the default rescale
threshold of 8, where the reference maximum of the first block is kept while later keys weigh
up to 2^7.5 times more (decode_fp16's half-precision P·V overflowed there until it rescaled
at every new maximum). The cache is filled by the library's own appends, then read by each
kernel; the caches must not change under the reads. A randomized differential run like this
one (13k cases, outside the repository) found that fault and the constant u8 rows' one.
"""

import numpy as np
import pytest

import flashattn
from conftest import seed_for
from reference import attention_ref, empty_cache, quantized_cache_tolerance, values

CASES = 64


def _kernels():
    """The decode kernels this CPU runs: decode everywhere, the narrow ones by their flags."""
    hw = flashattn._C.cpu_hardware()
    return ["decode"] + [k for k in ("decode_fp16", "decode_bf16") if hw[k] == "1"]


def _draw(rng):
    k_fmt, v_fmt = rng.choice(["e4m3", "u8", "s8"], 2)
    batch, hkv = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    group = int(rng.choice([1, 2, 4]))
    d = int(rng.choice([8, 40, 64, 128]))
    dv = d if rng.random() < 0.7 else int(rng.choice([16, 24, 64]))
    sq = int(rng.choice([1, 1, 2, 4]))
    lengths = rng.integers(0, 600, batch)
    lengths[rng.random(batch) < 0.15] = 0
    page = None if rng.random() < 0.3 else int(rng.choice([1, 3, 16, 64]))
    causal = sq > 1 and rng.random() < 0.6
    window = (int(rng.integers(8, 300)), 0 if causal else -1) if rng.random() < 0.3 else (-1, -1)
    variants = dict(causal=causal, window_size=window,
                    softcap=float(rng.choice([0.0, 0.0, 30.0])),
                    alibi_slopes=(rng.random(hkv * group) * 0.05).astype(np.float32) if rng.random() < 0.3 else None)
    sinks = rng.standard_normal(hkv * group).astype(np.float32) if rng.random() < 0.3 else None
    per_token = bool(rng.random() < 0.6)
    return k_fmt, v_fmt, batch, hkv, group, d, dv, sq, lengths, page, variants, sinks, per_token


@pytest.mark.parametrize("case", range(CASES))
def test_random_quantized_decode_matches_the_reference(case):
    rng = np.random.default_rng(seed_for("random quantized decode", case))
    k_fmt, v_fmt, batch, hkv, group, d, dv, sq, lengths, page, variants, sinks, per_token = _draw(rng)
    hq, cap = hkv * group, int(lengths.max()) + 1
    per_seq = 1 if page is None else -(-cap // page)
    pages, slots = batch * per_seq, cap if page is None else page
    table = None if page is None else rng.permutation(pages).astype(np.int32).reshape(batch, per_seq)
    k_cache, k_scale, k_zero = empty_cache(k_fmt, per_token, pages, slots, hkv, d)
    v_cache, v_scale, v_zero = empty_cache(v_fmt, per_token, pages, slots, hkv, dv)
    quant = dict(k_scale=k_scale, v_scale=v_scale, k_zero_point=k_zero, v_zero_point=v_zero, k_quant=k_fmt,
                 v_quant=v_fmt)
    q = rng.standard_normal((batch, sq, hq, d)).astype(np.float32)
    # Keys along q's direction (kv head h: its first q head's, last query row), rising to 7.5 in
    # log2 units of softmax_scale · q·k over the sequence, over small random ones.
    n = int(lengths.max())
    k_new = (0.3 * rng.standard_normal((batch, n, hkv, d))).astype(np.float32)
    direction = q[:, -1, ::group, :] / np.linalg.norm(q[:, -1, ::group, :], axis=-1, keepdims=True)
    rise = 7.5 / np.log2(np.e) * np.sqrt(d) / np.linalg.norm(q[:, -1, ::group, :], axis=-1)  # (batch, hkv)
    ramp = (np.arange(n) / max(n - 1, 1))[None, :, None, None]
    k_new += (ramp * rise[:, None, :, None] * direction[:, None]).astype(np.float32)
    v_new = (2.0 * rng.standard_normal((batch, n, hkv, dv))).astype(np.float32)
    # Appends quantize: sequence b gets its first lengths[b] tokens — packed rows (FA3's
    # cu_seqlens_k_new; no query rows) into pages, one sequence a call (cache_batch_idx) into
    # a contiguous cache.
    if n and table is not None:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        pack = lambda x: np.concatenate([x[b, :lengths[b]] for b in range(batch)])  # noqa: E731
        flashattn.flash_attn_with_kvcache(
            np.zeros((0, hq, d), np.float32), k_cache, v_cache, k=pack(k_new), v=pack(v_new),
            cache_seqlens=np.zeros(batch, np.int32), block_table=table, cu_seqlens_q=np.zeros(batch + 1, np.int32),
            cu_seqlens_k_new=cu, max_seqlen_q=0, **quant)
    elif n:
        for b in np.flatnonzero(lengths):
            flashattn.flash_attn_with_kvcache(
                q[b:b + 1, :1], k_cache, v_cache, k=k_new[b:b + 1, :lengths[b]], v=v_new[b:b + 1, :lengths[b]],
                cache_seqlens=np.zeros(1, np.int32), cache_batch_idx=np.array([b], np.int32), **quant)
    pools = [values(k_fmt, k_cache, k_scale, k_zero), values(v_fmt, v_cache, v_scale, v_zero)]
    before = [x.copy() for x in (k_cache, v_cache, k_scale, v_scale)]
    for kernel in _kernels():
        out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.astype(np.int32),
                                                block_table=table, learnable_sink=sinks, kernel=kernel,
                                                num_threads=int(rng.integers(1, 4)), **quant, **variants)
        for x, y in zip(before, (k_cache, v_cache, k_scale, v_scale)):
            np.testing.assert_array_equal(x, y, err_msg=f"{kernel} changed the cache")
        for b in range(batch):
            rows = [b] if table is None else table[b]
            keys, vals = (np.concatenate([x[p] for p in rows])[:lengths[b]] for x in pools)
            want = attention_ref(q[b][None], keys[None], vals[None], sinks=sinks, **variants)[0][0]
            atol = quantized_cache_tolerance(kernel) * max(np.abs(vals).max(initial=0.0), 1.0) + 1e-6
            assert np.isfinite(out[b]).all(), f"{kernel}: non-finite output, sequence {b}"
            np.testing.assert_allclose(out[b], want, rtol=0, atol=atol,
                                       err_msg=f"{kernel}, sequence {b} of {lengths.tolist()}, {k_fmt}/{v_fmt}, "
                                               f"page {page}, per token {per_token}, {variants}, sinks {sinks is not None}")
