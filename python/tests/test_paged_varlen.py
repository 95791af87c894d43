"""flash_attn_varlen_func with block_table (and FA3's seqused_k): decode rows and prefill
chunks mixed over shuffled pages, against a float64 torch eager reference per sequence."""
import numpy as np
import pytest
import torch

import flashattn
from flashattn import flash_attn_interface
from reference import planned_quantized_decode, quantized_cache_tolerance

HQ, HKV, D, PAGE = 4, 2, 32, 16
LENGTHS = [(1, 300), (0, 20), (40, 100), (1, 0), (3, 17), (70, 50), (16, 2100)]  # (query rows, keys)


def paged_batch(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-k // PAGE) for _, k in LENGTHS) + 2
    width = max(-(-k // PAGE) for _, k in LENGTHS) + 1
    k_cache = torch.randn(pages, PAGE, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(pages, PAGE, HKV, D, generator=g).to(dtype)
    order = torch.randperm(pages, generator=g).to(torch.int32)
    table = torch.full((len(LENGTHS), width), -1, dtype=torch.int32)
    used = 0
    for b, (_, k) in enumerate(LENGTHS):
        n = -(-k // PAGE)
        table[b, :n] = order[used:used + n]
        used += n
    q = torch.randn(sum(q for q, _ in LENGTHS), HQ, D, generator=g).to(dtype)
    cu_q = torch.tensor(np.cumsum([0] + [q for q, _ in LENGTHS]), dtype=torch.int32)
    seqused = torch.tensor([k for _, k in LENGTHS], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu_q, seqused


def reference(q, k_cache, v_cache, table, cu_q, seqused, causal, softcap=0.0, window_left=-1):
    """Each sequence's keys gathered from its pages, attention in float64 (bottom-right causal,
    keys more than window_left before a query's diagonal masked when window_left >= 0)."""
    out = torch.zeros(q.shape[0], HQ, D, dtype=torch.float64)
    for b in range(table.shape[0]):
        q0, q1, n = int(cu_q[b]), int(cu_q[b + 1]), int(seqused[b])
        if q1 == q0 or n == 0:
            continue
        rows = (table[b, : -(-n // PAGE)].long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]
        k = k_cache.reshape(-1, HKV, D)[rows].double().repeat_interleave(HQ // HKV, dim=1)
        v = v_cache.reshape(-1, HKV, D)[rows].double().repeat_interleave(HQ // HKV, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[q0:q1].double(), k) / D ** 0.5
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(q1 - q0)[:, None]
        j = torch.arange(n)[None, :]
        if causal:
            s = s.masked_fill(j > i + n - (q1 - q0), float("-inf"))
        if window_left >= 0:
            s = s.masked_fill(j < i + n - (q1 - q0) - window_left, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: zeros
        out[q0:q1] = torch.einsum("hij,jhd->ihd", p, v)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_eager_reference(dtype, tol, causal):
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(dtype)
    want = reference(q, k_cache, v_cache, table, cu_q, seqused, causal, softcap=3.0)
    out = flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 70, 2100, causal=causal, softcap=3.0,
                                           block_table=table, seqused_k=seqused)
    assert out.dtype == dtype and out.shape == (q.shape[0], HQ, D)
    assert (out.double() - want).abs().max().item() < tol


def test_keys_from_cu_seqlens_k_numpy_and_upstream_module():
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(torch.float32, seed=1)
    cu_k = torch.tensor(np.cumsum([0] + seqused.tolist()), dtype=torch.int32)
    a = flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 70, 2100, causal=True, block_table=table,
                                         seqused_k=seqused)
    b = flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 70, 2100, causal=True, block_table=table)
    c = flashattn.flash_attn_varlen_func(q.numpy(), k_cache.numpy(), v_cache.numpy(), cu_q.numpy(), None, 70, 2100,
                                         causal=True, block_table=table.numpy(), seqused_k=seqused.numpy())
    d, lse, _, _ = flash_attn_interface._flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, 70, 2100, 0.0,
                                                                   None, True, block_table=table,
                                                                   seqused_k=seqused)
    assert torch.equal(a, b) and torch.equal(a, torch.from_numpy(c)) and torch.equal(a, d)
    assert lse.shape == (HQ, q.shape[0])


def test_bad_calls_raise():
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(torch.float32)
    bad = table.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table: \[0, 0\]"):
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 70, 2100, block_table=bad,
                                         seqused_k=seqused)
    with pytest.raises(ValueError, match="dropout_p"):
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 70, 2100, dropout_p=0.1,
                                         block_table=table, seqused_k=seqused)
    with pytest.raises(ValueError, match=r"q: expected rank 3 \(total_q, heads, head_dim\)"):
        flashattn.flash_attn_varlen_func(q[None], k_cache, v_cache, cu_q, None, 70, 2100, block_table=table,
                                         seqused_k=seqused)
    # Without seqused_k, cu_seqlens_k gives the key counts: named when they would be negative.
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), seqused.cumsum(0).to(torch.int32)])
    cu_k[2] = cu_k[1] - 1
    with pytest.raises(ValueError, match=r"cu_seqlens_k: must be non-decreasing .* at \[1\]"):
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 70, 2100, block_table=table)
    # ... int32 as everywhere (an int64 offset past 2^32 would wrap, a float truncate), one a sequence and the end.
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), seqused.cumsum(0).to(torch.int32)])
    for wide in (cu_k.to(torch.int64) + (1 << 32) * (torch.arange(len(cu_k)) > 0), cu_k.double(), cu_k.numpy().astype(np.int64)):
        with pytest.raises(TypeError, match=r"cu_seqlens_k: dtype .* but expected (torch\.)?int32"):
            flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, wide, 70, 2100, block_table=table)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: shape \(\d+,\) but expected \(\d+ \+ 1,\)"):
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k[:-1], 70, 2100, block_table=table)
    with pytest.raises(ValueError, match="inference only"):
        flashattn.flash_attn_varlen_func(q.requires_grad_(), k_cache, v_cache, cu_q, None, 70, 2100,
                                         block_table=table, seqused_k=seqused)


@pytest.mark.parametrize("kernel", ["decode", "auto"])
def test_fp8_pool_matches_its_dequantized_values(kernel):
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    k_codes = torch.randint(0, 0x7F, k_cache.shape, dtype=torch.uint8, generator=g)  # finite e4m3 codes
    v_codes = torch.randint(0, 0x7F, v_cache.shape, dtype=torch.uint8, generator=g)
    k_codes[torch.rand(k_codes.shape, generator=g) < 0.5] |= 0x80  # and their negatives
    k_scale = torch.rand(k_cache.shape[0], HKV, generator=g) * 0.01 + 0.001
    v_scale = torch.rand(k_cache.shape[0], HKV, generator=g) * 0.01 + 0.001

    def values(codes, scale):
        return codes.view(torch.float8_e4m3fn).float() * scale[:, None, :, None]

    want = reference(q, values(k_codes, k_scale), values(v_codes, v_scale), table, cu_q, seqused, causal=True)
    out = flashattn.flash_attn_varlen_func(q, k_codes, v_codes, cu_q, None, 70, 2100, causal=True, block_table=table,
                                           seqused_k=seqused, k_scale=k_scale, v_scale=v_scale, kernel=kernel)
    # decode: float32 arithmetic on the dequantized values. auto: the decode rows run the
    # planner's choice here, decode_fp16 or decode_bf16 on narrow products (bounded relative to
    # max|v|: outputs are convex combinations of the values) or decode.
    narrow = planned_quantized_decode() if kernel == "auto" else kernel
    tolerance = (quantized_cache_tolerance(narrow) * values(v_codes, v_scale).abs().max().item()
                 if narrow != "decode" else 1e-5)
    assert (out.double() - want).abs().max().item() <= tolerance


@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_fullgraph_is_bit_identical_to_eager(fp8):
    """The paged call is one op (flashattn::varlen_paged_fwd) in a compiled graph, keys
    counted from cu_seqlens_k inside it, and gives eager's bits."""
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(torch.bfloat16, seed=4)
    cu_k = torch.tensor(np.cumsum([0] + seqused.tolist()), dtype=torch.int32)
    scales = {}
    if fp8:
        g = torch.Generator().manual_seed(5)
        k_cache = torch.randint(0, 0x7F, k_cache.shape, dtype=torch.uint8, generator=g)
        v_cache = torch.randint(0, 0x7F, v_cache.shape, dtype=torch.uint8, generator=g)
        scales = {"k_scale": torch.rand(k_cache.shape[0], HKV, generator=g) * 0.01 + 0.001,
                  "v_scale": torch.rand(k_cache.shape[0], HKV, generator=g) * 0.01 + 0.001}

    def call(q, k_cache, v_cache, table, cu_q, cu_k):
        return flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 70, 2100, causal=True, softcap=3.0,
                                                window_size=(500, 0), block_table=table, return_attn_probs=True,
                                                **scales)

    torch._dynamo.reset()
    out, lse, _ = torch.compile(call, fullgraph=True)(q, k_cache, v_cache, table, cu_q, cu_k)
    want_out, want_lse, _ = call(q, k_cache, v_cache, table, cu_q, cu_k)
    assert out.dtype == torch.bfloat16 and lse.shape == (HQ, q.shape[0])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    if fp8:
        k_cache = k_cache.view(torch.float8_e4m3fn).float() * scales["k_scale"][:, None, :, None]
        v_cache = v_cache.view(torch.float8_e4m3fn).float() * scales["v_scale"][:, None, :, None]
    want = reference(q, k_cache, v_cache, table, cu_q, seqused, causal=True, softcap=3.0, window_left=500)
    assert (out.double() - want).abs().max().item() < 3e-2


def test_op_passes_opcheck():
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(torch.float32, seed=6)
    args = (q, k_cache, v_cache, cu_q, 70, table, seqused, None, None, None, True, -1, -1, 0.0, None, "auto", 1, 0)
    torch.library.opcheck(torch.ops.flashattn.varlen_paged_fwd, args)


ADDED = [1, 0, 40, 0, 3, 50, 16]  # new tokens of each of LENGTHS' sequences (at most its keys)


def rotate(x, pos, cos, sin, interleaved):
    """x (..., D) rotated at positions pos (x's leading dim) in float64 over 2 * cos.shape[1] features."""
    half = cos.shape[1]
    c, s = cos[pos].double()[:, None, :], sin[pos].double()[:, None, :]
    x = x.double().clone()
    a, b = (x[..., 0:2 * half:2], x[..., 1:2 * half:2]) if interleaved else (x[..., :half], x[..., half:2 * half])
    a, b = a.clone(), b.clone()
    ra, rb = a * c - b * s, a * s + b * c
    if interleaved:
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = ra, rb
    else:
        x[..., :half], x[..., half:2 * half] = ra, rb
    return x


def packed_append(dtype, seed):
    """A paged batch whose last ADDED[b] keys of sequence b are given as new k, v (their slots
    zeroed), with rotary tables over 16 of D's features."""
    q, k_cache, v_cache, table, cu_q, seqused = paged_batch(dtype, seed)
    before = seqused - torch.tensor(ADDED, dtype=torch.int32)
    slots = [int(table[b, j // PAGE]) * PAGE + j % PAGE for b in range(len(ADDED))
             for j in range(int(before[b]), int(seqused[b]))]
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    k_new, v_new = flat_k[slots].clone(), flat_v[slots].clone()
    flat_k[slots], flat_v[slots] = 0, 0
    cu_new = torch.tensor(np.cumsum([0] + ADDED), dtype=torch.int32)
    angles = torch.arange(2200, dtype=torch.float64)[:, None] * 0.3 ** torch.arange(8, dtype=torch.float64)
    return q, k_cache, v_cache, table, cu_q, seqused, before, k_new, v_new, cu_new, slots, angles.cos().float(), \
        angles.sin().float()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_packed_kvcache_appends_rotated_then_attends(dtype, tol, interleaved):
    """flash_attn_with_kvcache with FA3's cu_seqlens_q / cu_seqlens_k_new over a paged cache:
    the new keys land rotated at cache_seqlens[b].., values as given, and each sequence
    attends (q rotated at its positions) against the float64 reference of the pools."""
    q, k_cache, v_cache, table, cu_q, seqused, before, k_new, v_new, cu_new, slots, cos, sin = packed_append(dtype, 7)
    positions = torch.cat([torch.arange(int(before[b]), int(seqused[b])) for b in range(len(ADDED))])
    want_k = rotate(k_new, positions, cos, sin, interleaved)
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, cache_seqlens=before,
                                                 block_table=table, causal=True, rotary_interleaved=interleaved,
                                                 return_softmax_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new,
                                                 max_seqlen_q=70)
    assert out.shape == (q.shape[0], HQ, D) and lse.shape == (HQ, q.shape[0])
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    assert (flat_k[slots].double() - want_k).abs().max().item() <= 8 * torch.finfo(dtype).eps
    assert torch.equal(flat_v[slots], v_new)
    q_positions = torch.cat([int(before[b]) + torch.arange(int(cu_q[b + 1] - cu_q[b])) for b in range(len(ADDED))])
    q_rot = rotate(q, q_positions.long(), cos, sin, interleaved)
    want = reference(q_rot, k_cache, v_cache, table, cu_q, seqused, causal=True)
    assert (out.double() - want).abs().max().item() < tol
    # the same bits as flash_attn_varlen_func over the pools after the append
    again = flashattn.flash_attn_varlen_func(q_rot.to(dtype), k_cache, v_cache, cu_q, None, 70, 2100, causal=True,
                                             block_table=table, seqused_k=seqused)
    assert (again.double() - out.double()).abs().max().item() < tol


def test_packed_kvcache_compiles_and_rejects_before_writing():
    q, k_cache, v_cache, table, cu_q, seqused, before, k_new, v_new, cu_new, slots, cos, sin = \
        packed_append(torch.bfloat16, 8)

    def call(q, k_cache, v_cache, k_new, v_new, cu_new):
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, cache_seqlens=before,
                                                 block_table=table, causal=True, return_softmax_lse=True,
                                                 cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=70)

    k0, v0 = k_cache.clone(), v_cache.clone()
    bad = cu_new.clone()
    bad[-1] += 1
    with pytest.raises(ValueError, match="cu_seqlens_k_new"):
        call(q, k_cache, v_cache, k_new, v_new, bad)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)  # a rejected call writes nothing
    torch._dynamo.reset()
    k1, v1 = k_cache.clone(), v_cache.clone()
    out, lse = torch.compile(call, fullgraph=True)(q, k1, v1, k_new, v_new, cu_new)
    want_out, want_lse = call(q, k_cache, v_cache, k_new, v_new, cu_new)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(k1, k_cache) and torch.equal(v1, v_cache)


def shared_batch(dtype, seed):
    """Sequences (query rows, own keys, prefix) over two prefixes of whole pages (so that the
    unshared table row of a sequence is its prefix's pages, then its own), one sequence
    without prefix between the groups: (q, pools, cu_q, shared args, unshared table, seqused)."""
    seqs = [(1, 5, 0), (3, 40, 0), (1, 0, 0), (2, 17, -1), (1, 33, 1), (0, 4, 1), (5, 9, 1)]
    prefix_pages = [4, 2]
    g = torch.Generator().manual_seed(seed)
    width = 4
    pages = sum(prefix_pages) + len(seqs) * width
    k_cache = torch.randn(pages, PAGE, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(pages, PAGE, HKV, D, generator=g).to(dtype)
    order = torch.randperm(pages, generator=g).to(torch.int32)
    prefix_table = torch.full((2, 5), -1, dtype=torch.int32)
    prefix_table[0, :4], prefix_table[1, :2] = order[:4], order[4:6]
    table = order[6:].reshape(len(seqs), width).clone()
    flat = torch.full((len(seqs), 4 + width), -1, dtype=torch.int32)
    for b, (_, _, p) in enumerate(seqs):
        n = prefix_pages[p] if p >= 0 else 0
        flat[b] = -1
        flat[b, :n] = prefix_table[p, :n]
        flat[b, n:n + width] = table[b]
    q = torch.randn(sum(r for r, _, _ in seqs), HQ, D, generator=g).to(dtype)
    cu_q = torch.tensor(np.cumsum([0] + [r for r, _, _ in seqs]), dtype=torch.int32)
    seqused = torch.tensor([k for _, k, _ in seqs], dtype=torch.int32)
    prefix = {"prefix_block_table": prefix_table,
              "prefix_seqused_k": torch.tensor([PAGE * n for n in prefix_pages], dtype=torch.int32),
              "prefix_idx": torch.tensor([p for _, _, p in seqs], dtype=torch.int32)}
    flat_seqused = torch.tensor([k + (PAGE * prefix_pages[p] if p >= 0 else 0) for _, k, p in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, cu_q, table, seqused, prefix, flat, flat_seqused


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_shared_prefix_equals_unshared_and_reference(dtype, tol):
    """Shared prefixes (cascade): the float64 reference of each sequence's prefix + own keys,
    the unshared call within the merge's rounding, and the NumPy path and a compiled graph
    (flashattn::varlen_paged_fwd with the prefix tensors) bit for bit."""
    q, k_cache, v_cache, cu_q, table, seqused, prefix, flat, flat_seqused = shared_batch(dtype, 9)

    def call(q, k_cache, v_cache, table, seqused, prefix_block_table, prefix_seqused_k, prefix_idx):
        return flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 5, 104, causal=True, softcap=3.0,
                                                block_table=table, seqused_k=seqused, return_attn_probs=True,
                                                prefix_block_table=prefix_block_table,
                                                prefix_seqused_k=prefix_seqused_k, prefix_idx=prefix_idx)

    out, lse, _ = call(q, k_cache, v_cache, table, seqused, *prefix.values())
    want_out, want_lse, _ = call(q, k_cache, v_cache, flat, flat_seqused, None, None, None)
    eps = torch.finfo(dtype).eps
    assert (out.double() - want_out.double()).abs().max().item() <= 1e-5 + eps * want_out.double().abs().max().item()
    assert (lse - want_lse).abs().max().item() < 1e-4
    want = reference(q, k_cache, v_cache, flat, cu_q, flat_seqused, causal=True, softcap=3.0)
    assert (out.double() - want).abs().max().item() < tol
    if dtype == torch.float32:
        numpy_out = flashattn.flash_attn_varlen_func(
            q.numpy(), k_cache.numpy(), v_cache.numpy(), cu_q.numpy(), None, 5, 104, causal=True, softcap=3.0,
            block_table=table.numpy(), seqused_k=seqused.numpy(), **{name: x.numpy() for name, x in prefix.items()})
        assert torch.equal(out, torch.from_numpy(numpy_out))
    torch._dynamo.reset()
    compiled, compiled_lse, _ = torch.compile(call, fullgraph=True)(q, k_cache, v_cache, table, seqused,
                                                                    *prefix.values())
    assert torch.equal(compiled, out) and torch.equal(compiled_lse, lse)


def test_shared_prefix_bad_calls_raise():
    q, k_cache, v_cache, cu_q, table, seqused, prefix, _, _ = shared_batch(torch.float32, 10)

    def call(**changes):
        args = {**prefix, **changes}
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 5, 104, causal=True, block_table=table,
                                         seqused_k=seqused, **args)

    scattered = prefix["prefix_idx"].clone()
    scattered[3] = 0
    scattered[1] = -1
    with pytest.raises(ValueError, match="prefix_idx: sequences 0 and 2 continue prefix 0"):
        call(prefix_idx=scattered)
    with pytest.raises(ValueError, match=r"prefix_idx: \[0\] = 2"):
        call(prefix_idx=torch.tensor([2, 0, 0, -1, 1, 1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="prefix_seqused_k: unset"):
        call(prefix_seqused_k=None)
    with pytest.raises(ValueError, match="window_size"):
        call(window_size=(8, 0))
    with pytest.raises(ValueError, match="prefix_idx: belongs to a paged batch"):
        flashattn.flash_attn_varlen_func(q, q, q, cu_q, cu_q, 5, 5, prefix_idx=prefix["prefix_idx"])


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_page"])
def test_shared_prefix_over_int8_pools_equals_unshared(per_token):
    """Shared prefixes over int8 pools (u8 K codes with zero points, s8 V codes): the prefix
    pass reads the codes and their scales through the prefix table's pages as the unshared call
    reads them through each sequence's, equal within the merge's rounding. Both calls on the
    float32 decode kernel: decode_fp16's half-precision products would differ between them by
    more than the merge's rounding."""
    q, k_cache, v_cache, cu_q, table, seqused, prefix, flat, flat_seqused = shared_batch(torch.float32, 11)
    g = torch.Generator().manual_seed(12)
    k_codes = torch.randint(0, 256, k_cache.shape, dtype=torch.uint8, generator=g)
    v_codes = torch.randint(-128, 128, v_cache.shape, dtype=torch.int8, generator=g)
    shape = (k_cache.shape[0], PAGE, HKV) if per_token else (k_cache.shape[0], HKV)
    k_scale = torch.rand(shape, generator=g) * 0.02 + 0.005
    k_zero = torch.rand(shape, generator=g) * 255
    v_scale = torch.rand(shape, generator=g) * 0.02 + 0.005

    def call(table, seqused, **prefix):
        return flashattn.flash_attn_varlen_func(q, k_codes, v_codes, cu_q, None, 5, 104, causal=True,
                                                block_table=table, seqused_k=seqused, return_attn_probs=True,
                                                k_scale=k_scale, v_scale=v_scale, k_zero_point=k_zero, k_quant="u8",
                                                v_quant="s8", kernel="decode", **prefix)

    out, lse, _ = call(table, seqused, **prefix)
    want_out, want_lse, _ = call(flat, flat_seqused)
    assert want_out.abs().max().item() > 0.1 and torch.isfinite(want_lse).any()
    eps = torch.finfo(torch.float32).eps
    assert (out.double() - want_out.double()).abs().max().item() <= 1e-5 + eps * want_out.double().abs().max().item()
    assert (lse - want_lse).abs().max().item() < 1e-4
