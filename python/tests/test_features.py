"""The C++ features reached from Python: block-sparse masks, num_splits, the FP8 forward with
FA3's descales, flash_attn_combine, hadamard_rotate and the plan — against the float64
reference, on NumPy arrays and torch tensors, with their errors."""

import ml_dtypes
import numpy as np
import pytest
import torch

import flashattn
from conftest import BF16, dtype_param, make_dout, make_qkv, seed_for
from reference import (attention_backward_naive, attention_backward_ref, attention_naive, attention_ref,
                       block_keep, check_close, max_abs)

# ---- block-sparse masks -----------------------------------------------------------------------


def _block_mask(seed, sq, sk, bs):
    rng = np.random.default_rng(seed + 3)
    m = rng.random(((sq + bs - 1) // bs, (sk + bs - 1) // bs)) > 0.4
    m[:, 0] = True  # every row sees a key block, and some rows see more than one
    return m


@dtype_param()
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_forward_backward(dtype, causal):
    sq, sk, bs = 75, 93, 16
    seed = seed_for("block_mask", str(dtype), causal)
    q, k, v = make_qkv(seed, 2, sq, sk, 4, 2, 24, dtype=dtype)
    mask = _block_mask(seed, sq, sk, bs)
    keep = block_keep(mask, bs, sq, sk)
    ctx = f"seed={seed}"
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=causal, block_mask=mask, block_mask_block_size=bs,
                                            return_attn_probs=True)
    out_ref, lse_ref, _ = attention_ref(q, k, v, causal=causal, keep=keep)
    check_close("out", out, out_ref, attention_naive(q, k, v, causal=causal, keep=keep), dtype, context=ctx)
    assert max_abs(np.where(np.isfinite(lse_ref), lse, 0), np.where(np.isfinite(lse_ref), lse_ref, 0)) < 1e-4
    assert np.array_equal(np.isfinite(lse), np.isfinite(lse_ref)), ctx
    # The mask matters: without it the output differs.
    assert max_abs(out, attention_ref(q, k, v, causal=causal)[0]) > 1e-2

    dout = make_dout(seed, out.shape, dtype)
    grads = flashattn.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, block_mask=mask.astype(np.uint8),
                                          block_mask_block_size=bs)
    refs = attention_backward_ref(dout, q, k, v, causal=causal, keep=keep)
    naive = attention_backward_naive(dout, q, k, v, causal=causal, keep=keep)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naive):
        check_close(name, g, r, n, dtype, grad=True, context=ctx)

    # torch: autograd through the op carries the mask to the backward; the same numbers.
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(_torch_dtype(dtype)).requires_grad_() for x in (q, k, v))
    tout = flashattn.flash_attn_func(tq, tk, tv, causal=causal, block_mask=torch.from_numpy(mask),
                                     block_mask_block_size=bs)
    tout.backward(torch.from_numpy(dout.astype(np.float32)).to(_torch_dtype(dtype)))
    assert torch.equal(tout.detach().float(), torch.from_numpy(out.astype(np.float32)))
    for name, t, g in zip(("dq", "dk", "dv"), (tq, tk, tv), grads):
        assert torch.equal(t.grad.float(), torch.from_numpy(g.astype(np.float32))), name


def _torch_dtype(dtype):
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, BF16: torch.bfloat16}[dtype]


def test_block_mask_packed_and_compiled():
    sq, bs = 40, 8
    q, k, v = make_qkv(seed_for("block_mask_packed"), 1, sq, sq, 2, 2, 16)
    mask = _block_mask(5, sq, sq, bs)
    ref = attention_ref(q, k, v, keep=block_keep(mask, bs, sq, sq))[0]
    qkv = np.stack([q, k, v], axis=2)
    got = flashattn.flash_attn_qkvpacked_func(qkv, block_mask=mask, block_mask_block_size=bs)
    check_close("out", got, ref, None, np.float32)
    got = flashattn.flash_attn_kvpacked_func(q, np.stack([k, v], axis=2), block_mask=mask, block_mask_block_size=bs)
    check_close("out", got, ref, None, np.float32)

    tmask = torch.from_numpy(mask)
    fn = torch.compile(lambda a, b, c: flashattn.flash_attn_func(a, b, c, block_mask=tmask,
                                                                 block_mask_block_size=bs), fullgraph=True,
                       backend="aot_eager")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    check_close("compiled out", fn(tq, tk, tv).numpy(), ref, None, np.float32)
    scalars = (0.0, None, False, -1, -1, 0.0, None, False, None, "auto", "auto", 1, 0, tmask, bs)
    torch.library.opcheck(torch.ops.flashattn.fwd, (tq, tk, tv, *scalars))

    class Masked(torch.nn.Module):
        def forward(self, a, b, c):
            return flashattn.flash_attn_func(a, b, c, block_mask=tmask, block_mask_block_size=bs)

    exported = torch.export.export(Masked(), (tq, tk, tv))
    check_close("exported out", exported.module()(tq, tk, tv).numpy(), ref, None, np.float32)


def test_block_mask_errors():
    q, k, v = make_qkv(1, 1, 20, 20, 2, 2, 8)
    good = np.ones((3, 3), dtype=bool)
    with pytest.raises(ValueError, match=r"block_mask: shape \(2, 3\)"):
        flashattn.flash_attn_func(q, k, v, block_mask=good[:2], block_mask_block_size=8)
    with pytest.raises(TypeError, match="block_mask: dtype float32"):
        flashattn.flash_attn_func(q, k, v, block_mask=good.astype(np.float32), block_mask_block_size=8)
    with pytest.raises(TypeError, match="block_mask: dtype torch.int32"):
        flashattn.flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)),
                                  block_mask=torch.ones(3, 3, dtype=torch.int32), block_mask_block_size=8)
    with pytest.raises(ValueError, match="block_mask_block_size: must be >= 1"):
        flashattn.flash_attn_func(q, k, v, block_mask=good)
    with pytest.raises(ValueError, match="block_mask_block_size: 8 given without a block_mask"):
        flashattn.flash_attn_func(q, k, v, block_mask_block_size=8)
    with pytest.raises(TypeError, match="block_mask: expected a numpy.ndarray"):
        flashattn.flash_attn_func(q, k, v, block_mask=[[1]], block_mask_block_size=32)


# ---- num_splits -------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_num_splits(splits):
    seed = seed_for("num_splits", splits)
    q, k, v = make_qkv(seed, 2, 1, 301, 4, 1, 32)
    ref = attention_ref(q, k, v)[0]
    check_close("out", flashattn.flash_attn_func(q, k, v, num_splits=splits), ref, None, np.float32,
                context=f"seed={seed}")
    tout = flashattn.flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)), num_splits=splits)
    check_close("torch out", tout.numpy(), ref, None, np.float32)
    planned = flashattn.plan(q, k, v, num_splits=splits)["forward"]
    assert planned["splits"] == min(splits, -(-301 // planned["block_k"])), "never more splits than key tiles"
    qv, kv, vv = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    cu_q, cu_k = np.array([0, 1, 2], np.int32), np.array([0, 301, 602], np.int32)
    got = flashattn.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 1, 301, num_splits=splits)
    check_close("varlen out", got.reshape(ref.shape), ref, None, np.float32)


def test_num_splits_errors():
    q, k, v = make_qkv(1, 1, 1, 20, 2, 2, 8)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"num_splits: expected an integer in \[0, "):
            flashattn.flash_attn_func(q, k, v, num_splits=bad)


# ---- pack_gqa ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_pack_gqa(causal):
    """FA3's pack_gqa: the q heads of a kv head share a Q tile. Every function takes it, the plan
    shows it (heads_per_item), and packed or not the result is the same bits (one key split, so
    that both plans read the keys in the same order), close to the float64 reference."""
    seed = seed_for("pack_gqa", causal)
    q, k, v = make_qkv(seed, 2, 7, 301, 8, 2, 32)  # 7 rows a head, 4 q heads a kv head
    ref = attention_ref(q, k, v, causal=causal)[0]
    packed_plan = flashattn.plan(q, k, v, causal=causal, pack_gqa=True)["forward"]
    assert packed_plan["heads_per_item"] == 4
    assert packed_plan["block_q"] == 7  # the heads' rows back to back, the tile padded once
    assert flashattn.plan(q, k, v, causal=causal, pack_gqa=False)["forward"]["heads_per_item"] == 1
    outs = {pack: flashattn.flash_attn_func(q, k, v, causal=causal, num_splits=1, pack_gqa=pack, return_attn_probs=True)
            for pack in (None, True, False)}
    check_close("out", outs[True][0], ref, attention_naive(q, k, v, causal=causal), np.float32,
                context=f"seed={seed}")
    for pack in (None, False):
        for i, name in enumerate(("out", "softmax_lse")):
            assert np.array_equal(outs[pack][i], outs[True][i]), f"{name}, pack_gqa={pack}, seed={seed}"

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tout = flashattn.flash_attn_func(tq, tk, tv, causal=causal, num_splits=1, pack_gqa=True)
    assert torch.equal(tout.detach(), torch.from_numpy(outs[True][0]))
    tout.sum().backward()  # the backward is not packed: the option stops at the forward
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (tq, tk, tv))
    compiled = torch.compile(lambda a, b, c: flashattn.flash_attn_func(a, b, c, causal=causal, num_splits=1,
                                                                       pack_gqa=False),
                             fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(*(t.detach() for t in (tq, tk, tv))), tout.detach())
    scalars = (0.0, None, causal, -1, -1, 0.0, None, False, None, "auto", "auto", 1, 1, None, 0, None, True)
    torch.library.opcheck(torch.ops.flashattn.fwd, tuple(t.detach() for t in (tq, tk, tv)) + scalars)

    qv, kv, vv = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    cu_q, cu_k = np.array([0, 7, 14], np.int32), np.array([0, 301, 602], np.int32)
    varlen = {pack: flashattn.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 7, 301, causal=causal, num_splits=1,
                                                     pack_gqa=pack) for pack in (True, False)}
    assert np.array_equal(varlen[True], varlen[False])
    check_close("varlen out", varlen[True].reshape(ref.shape), ref, None, np.float32)

    # A KV cache (the first 301 of 320 slots) and a paged pool of 16-token pages, as tensors.
    cache = {n: torch.zeros(2, 320, 2, 32) for n in "kv"}
    for n, x in (("k", k), ("v", v)):
        cache[n][:, :301] = torch.from_numpy(x)
    seqlens = torch.tensor([301, 301], dtype=torch.int32)
    pages = {n: c.reshape(40, 16, 2, 32) for n, c in cache.items()}
    table = torch.arange(40, dtype=torch.int32).reshape(2, 20)
    got = {}
    for pack in (True, False):
        got[pack] = (flashattn.flash_attn_with_kvcache(torch.from_numpy(q), cache["k"], cache["v"],
                                                       cache_seqlens=seqlens, causal=causal, num_splits=1,
                                                       pack_gqa=pack),
                     flashattn.flash_attn_varlen_func(torch.from_numpy(qv), pages["k"], pages["v"],
                                                      torch.from_numpy(cu_q), None, 7, None, causal=causal,
                                                      block_table=table, seqused_k=seqlens, num_splits=1,
                                                      pack_gqa=pack))
    for i, name in enumerate(("kvcache out", "paged out")):
        assert torch.equal(got[True][i], got[False][i]), name
        check_close(name, got[True][i].reshape(ref.shape).numpy(), ref, None, np.float32)
    # The NumPy KV cache and FP8 inputs take it too.
    caches = [c.numpy() for c in (cache["k"], cache["v"])]
    numpy_cache = {pack: flashattn.flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens.numpy(), causal=causal,
                                                           num_splits=1, pack_gqa=pack) for pack in (True, False)}
    assert np.array_equal(numpy_cache[True], numpy_cache[False])
    assert np.array_equal(numpy_cache[True], got[True][0].numpy())
    (q8, k8, v8), (dq, dk, dv) = _fp8_case(seed, 2, 7, 301, 8, 2, 32)
    fp8 = {pack: flashattn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv,
                                           num_splits=1, pack_gqa=pack) for pack in (True, False)}
    assert np.array_equal(fp8[True].astype(np.float32), fp8[False].astype(np.float32))


def test_pack_gqa_errors():
    q, k, v = make_qkv(1, 1, 4, 20, 4, 2, 8)
    for bad in (1, "on", 0.0):
        with pytest.raises(TypeError, match="pack_gqa: expected None, True or False"):
            flashattn.flash_attn_func(q, k, v, pack_gqa=bad)
    with pytest.raises(ValueError, match="pack_gqa: true is not supported with alibi_slopes"):
        flashattn.flash_attn_func(q, k, v, alibi_slopes=np.ones(4, np.float32), pack_gqa=True)
    with pytest.raises(ValueError, match="pack_gqa: true is not supported with dropout_p"):
        flashattn.flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)), dropout_p=0.5, pack_gqa=True)
    # A per-head variant without a request runs unpacked; False always runs.
    assert flashattn.plan(q, k, v, alibi_slopes=np.ones(4, np.float32))["forward"]["heads_per_item"] == 1
    flashattn.flash_attn_func(q, k, v, alibi_slopes=np.ones(4, np.float32), pack_gqa=False)


# ---- FP8 --------------------------------------------------------------------------------------

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8_case(seed, b, sq, sk, hq, hkv, d):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32) * 3
               for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    q8, k8, v8 = (x.astype(E4M3) for x in (q, k, v))
    descales = [(rng.random((b, hkv)) * 0.9 + 0.1).astype(np.float32) for _ in range(3)]
    return (q8, k8, v8), descales


def _dequantized(codes, descale, group):
    d = np.repeat(descale, group, axis=1) if group > 1 else descale
    return codes.astype(np.float64) * d[:, None, :, None]


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward(causal):
    seed = seed_for("fp8", causal)
    (q8, k8, v8), (dq, dk, dv) = _fp8_case(seed, 2, 37, 53, 6, 2, 32)
    out, lse, s_dmask = flashattn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk,
                                                  v_descale=dv, return_attn_probs=True)
    assert out.dtype == BF16 and out.shape == (2, 37, 6, 32) and s_dmask.shape == (0,)
    # The values the codes stand for, each q head with its kv head's descale (FA3's rule).
    qf, kf, vf = _dequantized(q8, dq, 3), _dequantized(k8, dk, 1), _dequantized(v8, dv, 1)
    out_ref, lse_ref, _ = attention_ref(qf, kf, vf, causal=causal)
    # P is rounded to e4m3 before P V (relative 2^-4), then out to bf16 (2^-8).
    tol = 2.0 ** -4 * np.abs(vf).max() + 2.0 ** -8 * np.abs(out_ref).max()
    err = max_abs(out.astype(np.float32), out_ref)
    assert err <= tol, f"out: {err} > {tol}, seed={seed}"
    finite = np.isfinite(lse_ref)
    assert max_abs(lse[finite], lse_ref[finite]) < 1e-4
    # Descales matter: all ones is another result.
    assert max_abs(flashattn.flash_attn_func(q8, k8, v8, causal=causal).astype(np.float32), out_ref) > 10 * tol

    # torch: the same numbers through the op, compiled too.
    t = [torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, k8, v8)]
    td = [torch.from_numpy(x) for x in (dq, dk, dv)]
    tout = flashattn.flash_attn_func(*t, causal=causal, q_descale=td[0], k_descale=td[1], v_descale=td[2])
    assert tout.dtype == torch.bfloat16
    assert np.array_equal(tout.float().numpy(), out.astype(np.float32))
    fn = torch.compile(lambda a, b, c, x, y, z: flashattn.flash_attn_func(a, b, c, causal=causal, q_descale=x,
                                                                          k_descale=y, v_descale=z),
                       fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(*t, *td), tout)

    class Fp8(torch.nn.Module):
        def forward(self, a, b, c, x, y, z):
            return flashattn.flash_attn_func(a, b, c, causal=causal, q_descale=x, k_descale=y, v_descale=z)

    assert torch.equal(torch.export.export(Fp8(), (*t, *td)).module()(*t, *td), tout)


def test_fp8_forward_with_learnable_sink():
    """FP8 inputs with learnable_sink: the reference on the dequantized values with the sinks,
    within the FP8 bound; NumPy and torch (op and compiled) agree bit for bit."""
    (q8, k8, v8), (dq, dk, dv) = _fp8_case(31, 2, 21, 40, 4, 2, 32)
    sinks = np.array([0.5, 4.0, -1.0, 8.0], np.float32)  # the scores reach ~20: some sinks must compete
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, causal=True, q_descale=dq, k_descale=dk, v_descale=dv,
                                            return_attn_probs=True, learnable_sink=sinks)
    qf, kf, vf = _dequantized(q8, dq, 2), _dequantized(k8, dk, 1), _dequantized(v8, dv, 1)
    out_ref, lse_ref, _ = attention_ref(qf, kf, vf, causal=True, sinks=sinks.astype(np.float64))
    tol = 2.0 ** -4 * np.abs(vf).max() + 2.0 ** -8 * np.abs(out_ref).max()
    assert max_abs(out.astype(np.float32), out_ref) <= tol
    assert max_abs(lse, lse_ref) < 1e-4
    plain_lse = attention_ref(qf, kf, vf, causal=True)[1]
    assert max_abs(plain_lse, lse_ref) > 0.1  # the sinks matter
    t = [torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, k8, v8)]
    td = [torch.from_numpy(x) for x in (dq, dk, dv)]

    def f(a, b, c, x, y, z, s):
        return flashattn.flash_attn_func(a, b, c, causal=True, q_descale=x, k_descale=y, v_descale=z,
                                         learnable_sink=s)

    ts = torch.from_numpy(sinks)
    assert np.array_equal(f(*t, *td, ts).float().numpy(), out.astype(np.float32))
    assert np.array_equal(torch.compile(f, fullgraph=True)(*t, *td, ts).float().numpy(), out.astype(np.float32))


def test_fp8_opcheck_and_e5m2():
    (q8, k8, v8), (dq, dk, dv) = _fp8_case(7, 1, 9, 17, 2, 1, 16)
    t = [torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, k8, v8)]
    td = [torch.from_numpy(x) for x in (dq, dk, dv)]
    args = (*t, *td, 0.0, None, True, -1, -1, 0.0, None, None, "auto", 1, 0, None, 0)
    # test_schema is left out: it multiplies the inputs, which torch cannot do for float8.
    torch.library.opcheck(torch.ops.flashattn.fwd_fp8, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    # e5m2 codes: values exactly as the format defines them.
    vals = [np.random.default_rng(3).standard_normal(x.shape).astype(np.float32) for x in (q8, k8, v8)]
    codes = [x.astype(np.dtype(ml_dtypes.float8_e5m2)) for x in vals]
    out = flashattn.flash_attn_func(*codes)
    ref = attention_ref(*(c.astype(np.float64) for c in codes))[0]
    assert max_abs(out.astype(np.float32), ref) <= 2.0 ** -4 * np.abs(codes[2].astype(np.float32)).max() + 2e-2


def test_fp8_errors():
    (q8, k8, v8), (dq, dk, dv) = _fp8_case(2, 2, 5, 6, 4, 2, 16)
    with pytest.raises(ValueError, match=r"k_descale: expected shape \(batch, heads_kv\) = \(2, 2\), got \(2, 4\)"):
        flashattn.flash_attn_func(q8, k8, v8, k_descale=np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match="q_descale: dtype float64"):
        flashattn.flash_attn_func(q8, k8, v8, q_descale=dq.astype(np.float64))
    with pytest.raises(TypeError, match="k: dtype float32 but q is FP8"):
        flashattn.flash_attn_func(q8, k8.astype(np.float32), v8)
    with pytest.raises(TypeError, match="v_descale: descales belong to FP8 inputs"):
        flashattn.flash_attn_func(*(x.astype(np.float32) for x in (q8, k8, v8)), v_descale=dv)
    with pytest.raises(ValueError, match=r"k.descale: entry \(0, 0, 0\) is 0"):  # the native check: finite, > 0
        flashattn.flash_attn_func(q8, k8, v8, k_descale=np.zeros((2, 2), np.float32))
    with pytest.raises(NotImplementedError, match="FP8 inputs are supported by flash_attn_func only"):
        flashattn.flash_attn_varlen_func(q8[0], k8[0], v8[0], np.array([0, 5], np.int32),
                                         np.array([0, 6], np.int32), 5, 6)


# ---- flash_attn_combine ---------------------------------------------------------------------------


def _partials(q, k, v, bounds):
    """Each key chunk's normalized output (float32) and lse, stacked as upstream's combine takes them."""
    outs, lses = [], []
    for lo, hi in bounds:
        o, lse, _ = flashattn.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], return_attn_probs=True,
                                              softmax_scale=q.shape[-1] ** -0.5)
        outs.append(o.astype(np.float32))
        lses.append(lse.transpose(0, 2, 1))  # (B, Sq, H)
    return np.stack(outs), np.stack(lses)


def test_flash_attn_combine():
    seed = seed_for("combine")
    q, k, v = make_qkv(seed, 2, 7, 90, 3, 3, 16, head_dim_v=24)
    bounds = [(0, 30), (30, 30), (30, 71), (71, 90)]  # an empty chunk: lse -inf
    out_partial, lse_partial = _partials(q, k, v, bounds)
    assert np.isneginf(lse_partial[1]).all()
    out_ref, lse_ref, _ = attention_ref(q, k, v)
    out, lse = flashattn.flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == np.float32 and lse.shape == (2, 7, 3)
    check_close("out", out, out_ref, None, np.float32, context=f"seed={seed}")
    assert max_abs(lse, lse_ref.transpose(0, 2, 1)) < 1e-5

    # out_dtype and out= (written in place); lse_partial in any layout.
    half, _ = flashattn.flash_attn_combine(out_partial, np.ascontiguousarray(lse_partial), out_dtype=BF16)
    assert half.dtype == BF16 and max_abs(half, out_ref) < 2e-2
    target = np.zeros((2, 7, 3, 24), np.float16)
    got, _ = flashattn.flash_attn_combine(out_partial, lse_partial, out=target)
    assert got is target and max_abs(target, out_ref) < 5e-3

    # torch: upstream's lse is a (B, Sq, H) view of (B, H, Sq); eager, compiled, out=.
    to, tl = flashattn.flash_attn_combine(torch.from_numpy(out_partial), torch.from_numpy(lse_partial))
    assert np.array_equal(to.numpy(), out) and np.array_equal(tl.numpy(), lse)
    assert tl.shape == (2, 7, 3) and tl.stride() == (21, 1, 7)
    fn = torch.compile(lambda a, b: flashattn.flash_attn_combine(a, b, out_dtype=torch.bfloat16), fullgraph=True,
                       backend="aot_eager")
    co, cl = fn(torch.from_numpy(out_partial), torch.from_numpy(lse_partial))
    assert co.dtype == torch.bfloat16 and np.array_equal(co.float().numpy(), half.astype(np.float32))
    assert np.array_equal(cl.numpy(), lse)
    tt = torch.zeros(2, 7, 3, 24)
    flashattn.flash_attn_combine(torch.from_numpy(out_partial), torch.from_numpy(lse_partial), out=tt)
    assert np.array_equal(tt.numpy(), out)
    torch.library.opcheck(torch.ops.flashattn.combine,
                          (torch.from_numpy(out_partial), torch.from_numpy(lse_partial), "f16", 1))


def test_flash_attn_combine_errors():
    outs, lses = np.zeros((2, 1, 3, 2, 8), np.float32), np.zeros((2, 1, 3, 2), np.float32)
    with pytest.raises(ValueError, match=r"lse_partial: expected shape \(num_splits, batch, seqlen, heads\)"):
        flashattn.flash_attn_combine(outs, lses.transpose(0, 1, 3, 2))
    with pytest.raises(ValueError, match="out_partial: expected rank 5"):
        flashattn.flash_attn_combine(outs[0], lses)
    with pytest.raises(TypeError, match="out_partial: dtype f16 but expected float32"):
        flashattn.flash_attn_combine(outs.astype(np.float16), lses)
    with pytest.raises(TypeError, match="out_dtype"):
        flashattn.flash_attn_combine(outs, lses, out_dtype=np.int32)
    with pytest.raises(TypeError, match="out: dtype f32 does not match out_dtype"):
        flashattn.flash_attn_combine(outs, lses, out=np.zeros((1, 3, 2, 8), np.float32), out_dtype=np.float16)
    with pytest.raises(ValueError, match=r"out: shape \(1, 3, 2, 7\) but expected \(1, 3, 2, 8\)"):
        flashattn.flash_attn_combine(outs, lses, out=np.zeros((1, 3, 2, 7), np.float32))
    with pytest.raises(ValueError, match="out: last dimension must be contiguous"):
        flashattn.flash_attn_combine(outs, lses, out=np.zeros((1, 3, 2, 16), np.float32)[..., ::2])
    with pytest.raises(TypeError, match="inputs mix numpy arrays and torch tensors"):
        flashattn.flash_attn_combine(torch.from_numpy(outs), lses)
    # Through the op (an input that requires grad, a torch function mode): the same checks, nothing written.
    t_outs, t_lses = torch.from_numpy(outs).requires_grad_(), torch.from_numpy(lses)
    for mode in (torch.device("cpu"), torch.autograd.set_grad_enabled(True)):
        with mode:
            wrong = torch.full((2, 3, 2, 8), 5.0)
            with pytest.raises(ValueError, match=r"out: shape \(2, 3, 2, 8\) but expected \(1, 3, 2, 8\)"):
                flashattn.flash_attn_combine(t_outs, t_lses, out=wrong)
            assert (wrong == 5.0).all()
            partial = torch.ones(2, 1, 3, 2, 8, requires_grad=True) * 1.0
            with pytest.raises(ValueError, match="out: shares memory with out_partial or lse_partial"):
                flashattn.flash_attn_combine(partial, t_lses, out=partial[0])
            assert (partial == 1.0).all()
            with pytest.raises(ValueError, match="out: only CPU tensors are supported, got device meta"):
                flashattn.flash_attn_combine(t_outs, t_lses, out=torch.empty(1, 3, 2, 8, device="meta"))
    # An out in the storage of out_partial but apart from it: taken on both routes alike (the op's
    # route refused any shared storage), the same result.
    buffer = torch.zeros(3 * 48 + 48)
    parts, out = buffer[:2 * 48].view(2, 1, 3, 2, 8), buffer[3 * 48:].view(1, 3, 2, 8)
    parts.copy_(torch.randn(2, 1, 3, 2, 8))
    lse_parts = torch.randn(2, 1, 3, 2)
    direct = flashattn.flash_attn_combine(parts, lse_parts, out=out)[0].clone()
    through_op = flashattn.flash_attn_combine(parts.detach().requires_grad_(), lse_parts, out=out)[0]
    torch.testing.assert_close(through_op, direct, rtol=0, atol=0)


# ---- hadamard_rotate --------------------------------------------------------------------------


def _sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("dim", [16, 24])
def test_hadamard_rotate(dim):
    n = flashattn.hadamard_dim(dim)
    assert n == (16 if dim == 16 else 32)
    # The rotation of the unit rows is R itself: R = H diag(signs) / sqrt(n), orthogonal.
    eye = np.eye(dim, dtype=np.float32).reshape(1, dim, 1, dim)
    r = flashattn.hadamard_rotate(eye, seed=11)[0, :, 0, :].astype(np.float64)  # (dim, n): R's first dim rows
    signs = r * np.sqrt(n) / _sylvester(n)[:dim]
    assert np.allclose(np.abs(signs), 1.0, atol=1e-6)
    assert np.allclose(signs, signs[0:1], atol=1e-6), "one sign per column"
    assert np.allclose(r @ r.T, np.eye(dim), atol=1e-6)
    other = flashattn.hadamard_rotate(eye, seed=12)[0, :, 0, :]
    assert not np.allclose(other, r)
    # Scores are unchanged with the same seed for q and k; tensors and bf16 give the same.
    q, k, _ = make_qkv(seed_for("hadamard", dim), 2, 5, 6, 3, 3, dim)
    rq, rk = flashattn.hadamard_rotate(q, 4), flashattn.hadamard_rotate(k, 4)
    assert rq.dtype == np.float32 and rq.shape == (2, 5, 3, n)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64))
    rs = np.einsum("bihd,bjhd->bhij", rq.astype(np.float64), rk.astype(np.float64))
    assert max_abs(rs, s) < 1e-4
    assert np.array_equal(flashattn.hadamard_rotate(torch.from_numpy(q), 4).numpy(), rq)
    qb = q.astype(BF16)
    assert np.array_equal(flashattn.hadamard_rotate(qb, 4), flashattn.hadamard_rotate(qb.astype(np.float32), 4))


def test_hadamard_rotate_errors():
    with pytest.raises(ValueError, match="x: expected rank 4"):
        flashattn.hadamard_rotate(np.zeros((2, 3, 8), np.float32))
    with pytest.raises(TypeError, match="x: dtype int32"):
        flashattn.hadamard_rotate(np.zeros((1, 2, 3, 8), np.int32))
    with pytest.raises(ValueError, match=r"head_dim: expected an integer in \[1, "):
        flashattn.hadamard_dim(0)
    assert flashattn.hadamard_dim(2**62) == 2**62
    with pytest.raises(ValueError, match="hadamard_dim: head_dim 4611686018427387905 has no power of two"):
        flashattn.hadamard_dim(2**62 + 1)  # the doubling overflowed and looped for ever


# ---- the plan ---------------------------------------------------------------------------------


def test_plan_is_the_plan_that_runs():
    q, k, v = make_qkv(seed_for("plan"), 2, 130, 170, 4, 2, 32)
    p = flashattn.plan(q, k, v, causal=True, num_threads=1)
    fwd, bwd = p["forward"], p["backward"]
    assert fwd["threads"] == 1 and bwd["threads"] == 1
    assert fwd["workspace_bytes"] == fwd["workspace_bytes_per_thread"] * fwd["threads"] + fwd["shared_bytes"]
    assert fwd["kernel"] in ("tiled", "tiled_bf16") and f"kernel={fwd['kernel']}" in fwd["describe"]
    assert fwd["q_blocks"] == -(-130 // fwd["block_q"]) and bwd["k_blocks"] == -(-170 // bwd["block_k"])
    assert "causal=true" in p["problem"]
    # The thread budget a call reports is the plan's.
    for threads in (1, 2):
        flashattn.flash_attn_func(q, k, v, causal=True, num_threads=threads)
        assert flashattn.plan(q, k, v, causal=True, num_threads=threads)["forward"]["threads"] == \
            flashattn.last_num_threads()
    # Options reach the planner: one query row per kv head group -> decode; forced kernels;
    # deterministic; torch tensors the same as arrays.
    assert flashattn.plan(q[:, :1], k, v)["forward"]["kernel"] == "decode"
    assert flashattn.plan(q[:, :1], k, v, kernel="tiled")["forward"]["kernel"] == "tiled"
    assert flashattn.plan(q, k, v, deterministic=True)["backward"]["deterministic"] is True
    assert flashattn.plan(q, k, v)["backward"]["keep_q_rows"] is True  # small: within every budget
    tp = flashattn.plan(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, num_threads=1)
    assert tp == p


def test_plan_errors():
    q, k, v = make_qkv(1, 1, 10, 10, 4, 3, 8)
    with pytest.raises(ValueError, match="heads"):
        flashattn.plan(q, k, v)
    q, k, v = make_qkv(1, 1, 10, 10, 2, 2, 8)
    with pytest.raises(ValueError, match="kernel"):
        flashattn.plan(q, k, v, kernel="nope")
    with pytest.raises(ValueError, match="kernel"):
        flashattn.flash_attn_func(q, k, v, kernel="nope")
    with pytest.raises(TypeError, match="inputs mix"):
        flashattn.plan(torch.from_numpy(q), k, v)
