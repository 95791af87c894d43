"""Attention sinks: through the extension's Options (sinks, dsinks) against an eager torch
implementation of gpt-oss's sinks, its gradients by torch autograd; then the public
`learnable_sink=` keyword (docs/python.md, "Attention sinks") against the float64 reference."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashattn import _C, _interface  # noqa: E402


def eager(q, k, v, sinks, scale, causal):
    """gpt-oss: the unscaled sink logit concatenated to the scaled scores, dropped after the softmax."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(hq // hkv, dim=2)
    vv = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    logits = torch.cat([s, sinks.reshape(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_sinks_forward_and_gradients_match_eager_torch(causal, threads):
    gen = torch.Generator().manual_seed(7)
    b, sq, sk, hq, hkv, d = 2, 37, 53, 4, 2, 24
    q = torch.randn(b, sq, hq, d, generator=gen)
    k = torch.randn(b, sk, hkv, d, generator=gen)
    v = torch.randn(b, sk, hkv, d, generator=gen)
    dout = torch.randn(b, sq, hq, d, generator=gen)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    scale = d ** -0.5

    o = _C.Options()
    o.causal = causal
    o.num_threads = threads
    o.deterministic = True
    o.sinks = sinks.numpy()
    out, lse, _ = _interface._forward(q, k, v, o, False)
    dsinks = np.zeros(hq, dtype=np.float32)
    o.dsinks = dsinks
    dq, dk, dv = _interface._backward(dout, q, k, v, out, lse, o)

    leaves = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    want, want_lse = eager(*leaves, scale, causal)
    (want * dout.double()).sum().backward()
    torch.testing.assert_close(out.double(), want.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse.detach(), atol=2e-5, rtol=0)
    for got, leaf in zip((dq, dk, dv), leaves[:3]):
        torch.testing.assert_close(got.double(), leaf.grad, atol=2e-4, rtol=0)
    torch.testing.assert_close(torch.from_numpy(dsinks).double(), leaves[3].grad, atol=1e-3, rtol=0)
    assert np.abs(dsinks).min() > 0  # a real gradient, not the zeros it started as


def test_bad_sinks_name_the_argument():
    q = torch.randn(1, 4, 4, 8)
    o = _C.Options()
    o.sinks = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match="sinks: shape"):
        _interface._forward(q, q, q, o, False)
    o.sinks = np.array([0.0, np.nan, 0.0, 0.0], dtype=np.float32)
    with pytest.raises(ValueError, match="sinks: sink logit of head 1"):
        _interface._forward(q, q, q, o, False)


# ---- the public learnable_sink= keyword (upstream FA4's name) -------------------------------------

import flashattn  # noqa: E402
import reference as ref  # noqa: E402
from conftest import BF16, seed_for  # noqa: E402

TORCH_DTYPES = {torch.float32: np.dtype(np.float32), torch.bfloat16: BF16}


def to_numpy(t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16).copy()
    return t.numpy().copy()


def _sinks(hq, seed):
    """Sink logits around the scores' scale, some above them, so that they matter."""
    return torch.from_numpy(np.random.default_rng(seed).uniform(-2.0, 3.0, hq).astype(np.float32))


VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(7, 3)),
    "causal-window-softcap": dict(causal=True, window_size=(9, -1), softcap=2.0),
}


def _check_all(got, q, k, v, dout, sinks, kw, tdtype, ctx):
    """out, lse, dq, dk, dv, dsinks against the float64 reference by the project's rule."""
    out, lse, grads = got
    nq, nk, nv, ndo = (to_numpy(x) for x in (q, k, v, dout))
    s = to_numpy(sinks).astype(np.float64)
    want, want_lse, _ = ref.attention_ref(nq, nk, nv, sinks=s, **kw)
    naive = ref.attention_naive(nq, nk, nv, sinks=s, **kw)
    dt = TORCH_DTYPES[tdtype]
    ref.check_close("out", to_numpy(out), want, naive, dt, context=ctx)
    np.testing.assert_allclose(to_numpy(lse), want_lse, atol=1e-4, rtol=0, err_msg=ctx)
    want_grads = ref.attention_backward_ref(ndo, nq, nk, nv, sinks=s, **kw)
    naive_grads = ref.attention_backward_naive(ndo, nq, nk, nv, sinks=s, **kw)
    for name, g, w, n in zip(("dq", "dk", "dv"), grads[:3], want_grads[:3], naive_grads[:3]):
        ref.check_close(name, to_numpy(g), w, n, dt, grad=True, context=ctx)
    # dsinks sums every row of a head: its tolerance scales with that sum (f32: the rule's 1e-4 per row).
    rows = q.shape[0] * q.shape[1]
    dsinks = to_numpy(grads[3]).astype(np.float64)
    tol = (1e-4 * rows ** 0.5 if tdtype == torch.float32
           else 3 * ref.max_abs(naive_grads[3], want_grads[3]) + 1e-4)
    assert ref.max_abs(dsinks, want_grads[3]) <= tol, (dsinks, want_grads[3], ctx)
    assert np.abs(want_grads[3]).max() > 0.1, "the sinks should matter in this test"


@pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_learnable_sink_forward_and_autograd_match_reference(variant, tdtype, threads):
    """flash_attn_func(learnable_sink=) with GQA (Hq = 6, Hkv = 2), odd lengths: out, lse and
    autograd's dq, dk, dv, learnable_sink.grad against the float64 reference."""
    seed = seed_for("learnable_sink", variant, str(tdtype), threads)
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk, hq, hkv, d = 2, 29, 45, 6, 2, 40
    q, k, v = (torch.randn(shape, generator=gen).to(tdtype).requires_grad_()
               for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    dout = torch.randn(b, sq, hq, d, generator=gen).to(tdtype)
    sinks = _sinks(hq, seed).requires_grad_()
    kw = VARIANTS[variant]
    out, lse, _ = flashattn.flash_attn_func(q, k, v, **kw, return_attn_probs=True, learnable_sink=sinks,
                                            num_threads=threads)
    out.backward(dout)
    assert sinks.grad is not None and sinks.grad.dtype == torch.float32
    _check_all((out, lse, (q.grad, k.grad, v.grad, sinks.grad)), q, k, v, dout, sinks.detach(), kw, tdtype,
               f"(seed={seed}, {variant}, {tdtype}, threads={threads})")


def test_learnable_sink_low_precision_dtypes_widen_and_get_their_gradient():
    """A bfloat16 learnable_sink is widened exactly: the same out as its float32 values, and its
    gradient comes back as bfloat16 (autograd's rule), the float32 gradient rounded."""
    q, k, v = (torch.randn(1, 9, 4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    s16 = torch.tensor([0.5, -1.0, 2.0, 1.25], dtype=torch.bfloat16, requires_grad=True)
    s32 = s16.detach().float().requires_grad_()
    o16 = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=s16)
    o32 = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=s32)
    assert torch.equal(o16, o32)
    o16.sum().backward()
    o32.sum().backward()
    assert s16.grad.dtype == torch.bfloat16
    assert torch.equal(s16.grad, s32.grad.to(torch.bfloat16))


def test_learnable_sink_dsinks_against_finite_differences():
    """learnable_sink.grad of L = sum(out * dout) against central differences of the library's own
    float32 forward (gradcheck's comparison; torch.autograd.gradcheck needs float64 inputs,
    which the library does not take)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 17, 3, 24, generator=gen) for _ in range(3))
    dout = torch.randn(2, 17, 3, 24, generator=gen)
    sinks = torch.tensor([-0.5, 1.0, 2.5], requires_grad=True)
    out = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks)
    (out * dout).sum().backward()
    eps = 1e-2
    for h in range(3):
        plus, minus = sinks.detach().clone(), sinks.detach().clone()
        plus[h] += eps
        minus[h] -= eps
        lp = (flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=plus).double() * dout).sum()
        lm = (flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=minus).double() * dout).sum()
        num = float((lp - lm) / (2 * eps))
        assert abs(float(sinks.grad[h]) - num) <= 2e-3 * max(1.0, abs(num)), (h, float(sinks.grad[h]), num)


def test_learnable_sink_packed_variants():
    """qkvpacked and kvpacked pass learnable_sink on: the unpacked call's out and gradients."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 13, 3, 4, 16, generator=gen)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0])
    a_qkv, a_s = qkv.clone().requires_grad_(), sinks.clone().requires_grad_()
    out = flashattn.flash_attn_qkvpacked_func(a_qkv, causal=True, learnable_sink=a_s)
    out.sum().backward()
    q, k, v = (qkv[:, :, i].clone().requires_grad_() for i in range(3))
    b_s = sinks.clone().requires_grad_()
    want = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=b_s)
    want.sum().backward()
    assert torch.equal(out, want)
    assert torch.equal(a_s.grad, b_s.grad)
    assert torch.equal(a_qkv.grad[:, :, 0], q.grad)
    c_s = sinks.clone().requires_grad_()
    kv = qkv[:, :, 1:].clone().requires_grad_()
    out = flashattn.flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True, learnable_sink=c_s)
    out.sum().backward()
    assert torch.equal(out, want)
    assert torch.equal(c_s.grad, b_s.grad)


@pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_learnable_sink_varlen_matches_reference_per_sequence(tdtype):
    """flash_attn_varlen_func(learnable_sink=), causal, GQA, lengths 0 to 23: each sequence's out
    and gradients against the float64 reference; dsinks is the sum over the sequences."""
    seed = seed_for("varlen sinks", str(tdtype))
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [7, 0, 19, 1], [11, 5, 23, 1]
    hq, hkv, d = 4, 2, 24
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(tdtype).requires_grad_()
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to(tdtype).requires_grad_()
    v = torch.randn(sum(lens_k), hkv, d, generator=gen).to(tdtype).requires_grad_()
    dout = torch.randn(sum(lens_q), hq, d, generator=gen).to(tdtype)
    sinks = _sinks(hq, seed).requires_grad_()
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                           learnable_sink=sinks)
    out.backward(dout)
    dt = TORCH_DTYPES[tdtype]
    s = sinks.detach().double().numpy()
    dsinks, naive_dsinks = np.zeros(hq), np.zeros(hq)
    for i in range(len(lens_q)):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        c, f = int(cu_k[i]), int(cu_k[i + 1])
        nq, nk, nv, ndo = (to_numpy(x)[None] for x in (q[a:e], k[c:f], v[c:f], dout[a:e]))
        want = ref.attention_ref(nq, nk, nv, causal=True, sinks=s)[0]
        naive = ref.attention_naive(nq, nk, nv, causal=True, sinks=s)
        ref.check_close("out", to_numpy(out[a:e])[None], want, naive, dt, context=f"sequence {i}")
        grads = ref.attention_backward_ref(ndo, nq, nk, nv, causal=True, sinks=s)
        naive_grads = ref.attention_backward_naive(ndo, nq, nk, nv, causal=True, sinks=s)
        for name, g, w, n in zip(("dq", "dk", "dv"), (q.grad[a:e], k.grad[c:f], v.grad[c:f]), grads, naive_grads):
            ref.check_close(name, to_numpy(g)[None], w, n, dt, grad=True, context=f"sequence {i}")
        dsinks += grads[3]
        naive_dsinks += naive_grads[3]
    tol = 1e-4 * 3 if tdtype == torch.float32 else 3 * ref.max_abs(naive_dsinks, dsinks) + 1e-4
    assert ref.max_abs(sinks.grad.double().numpy(), dsinks) <= tol, (sinks.grad, dsinks)


def test_learnable_sink_with_kvcache_and_paged_varlen():
    """flash_attn_with_kvcache (contiguous and paged, one and several splits) and the paged
    flash_attn_varlen_func with learnable_sink: the float64 reference over each sequence's keys."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d, page = 3, 4, 2, 32, 16
    seqlens = [37, 1, 64]
    q = torch.randn(b, 1, hq, d, generator=gen)
    k_cache = torch.randn(b, 64, hkv, d, generator=gen)
    v_cache = torch.randn(b, 64, hkv, d, generator=gen)
    sinks = torch.tensor([1.0, -0.5, 3.0, 0.25])
    s = sinks.double().numpy()
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)

    def want(i):
        return ref.attention_ref(q[i:i + 1].numpy(), k_cache[i:i + 1, :seqlens[i]].numpy(),
                                 v_cache[i:i + 1, :seqlens[i]].numpy(), causal=True, sinks=s)

    for splits in (1, 3):
        out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True,
                                                     num_splits=splits, return_softmax_lse=True,
                                                     learnable_sink=sinks)
        for i in range(b):
            o, l, _ = want(i)
            np.testing.assert_allclose(out[i:i + 1].numpy(), o, atol=1e-5, err_msg=f"splits={splits} seq {i}")
            np.testing.assert_allclose(lse[i:i + 1].numpy(), l, atol=1e-5)
    # The same keys in pages of 16, sequence i in pages 4i .. 4i+3.
    k_pages = k_cache.reshape(b * 4, page, hkv, d)
    v_pages = v_cache.reshape(b * 4, page, hkv, d)
    table = torch.arange(b * 4, dtype=torch.int32).reshape(b, 4)
    out = flashattn.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=cache_seqlens, block_table=table,
                                            causal=True, learnable_sink=sinks)
    cu_q = torch.arange(b + 1, dtype=torch.int32)
    out_varlen = flashattn.flash_attn_varlen_func(q.reshape(b, hq, d), k_pages, v_pages, cu_q, None, 1, None,
                                                  causal=True, block_table=table, seqused_k=cache_seqlens,
                                                  learnable_sink=sinks)
    for i in range(b):
        o = want(i)[0]
        np.testing.assert_allclose(out[i:i + 1].numpy(), o, atol=1e-5, err_msg=f"paged kvcache seq {i}")
        np.testing.assert_allclose(out_varlen[i].numpy(), o[0, 0], atol=1e-5, err_msg=f"paged varlen seq {i}")


def test_learnable_sink_numpy_arrays():
    """NumPy q, k, v with a NumPy learnable_sink: the torch call's out, bit for bit."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 11, 4, 16, generator=gen) for _ in range(3))
    sinks = torch.tensor([0.5, 1.5, -2.0, 0.0])
    want = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks, num_threads=2)
    got = flashattn.flash_attn_func(q.numpy(), k.numpy(), v.numpy(), causal=True, learnable_sink=sinks.numpy(),
                                    num_threads=2)
    np.testing.assert_array_equal(got, want.numpy())


def test_learnable_sink_under_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) through the custom ops: eager's out and gradients."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 12, 4, 16, generator=gen).requires_grad_() for _ in range(3))
    sinks = torch.tensor([0.5, 1.5, -2.0, 0.0], requires_grad=True)

    def f(q, k, v, s):
        return flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=s)

    out = torch.compile(f, fullgraph=True)(q, k, v, sinks)
    out.sum().backward()
    got = [x.grad.clone() for x in (q, k, v, sinks)]
    for x in (q, k, v, sinks):
        x.grad = None
    want = f(q, k, v, sinks)
    want.sum().backward()
    assert torch.equal(out, want)
    for g, x in zip(got, (q, k, v, sinks)):
        assert torch.equal(g, x.grad)


def test_bad_learnable_sink_names_the_argument():
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"learnable_sink: expected shape \(heads_q,\) = \(4,\), got \(3,\)"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="learnable_sink: expected shape"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=torch.zeros(1, 4))
    with pytest.raises(TypeError, match="learnable_sink: dtype torch.int32"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="learnable_sink: dtype torch.float64"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="learnable_sink"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=[0.0] * 4)
    with pytest.raises(TypeError, match="inputs mix numpy arrays and torch tensors: q, learnable_sink"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="sinks: sink logit of head 2"):
        flashattn.flash_attn_func(q, q, q, learnable_sink=torch.tensor([0.0, 0.0, float("inf"), 0.0]))
    with pytest.raises(ValueError, match="learnable_sink: expected shape"):
        flashattn.flash_attn_with_kvcache(q, q, q, learnable_sink=torch.zeros(2))
    with pytest.raises(ValueError, match="learnable_sink: expected shape"):
        flashattn.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                         torch.tensor([0, 4], dtype=torch.int32), 4, 4,
                                         learnable_sink=torch.zeros(5))


def test_numpy_backward_with_learnable_sink():
    """flash_attn_backward(learnable_sink=) for NumPy users: autograd's dq, dk, dv and dsinks."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 19, 4, 16, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 19, 4, 16, generator=gen)
    sinks = torch.tensor([0.5, 1.5, -2.0, 3.0], requires_grad=True)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks, return_attn_probs=True,
                                            num_threads=2)
    out.backward(dout)
    got = flashattn.flash_attn_backward(dout.numpy(), *(x.detach().numpy() for x in (q, k, v, out)), lse.numpy(),
                                        causal=True, learnable_sink=sinks.detach().numpy(), num_threads=2)
    assert len(got) == 4 and got[3].dtype == np.float32
    for g, x in zip(got, (q, k, v, sinks)):
        np.testing.assert_array_equal(g, x.grad.numpy())
    cu = torch.tensor([0, 19, 38], dtype=torch.int32)
    packed = [x.detach().reshape(38, 4, 16).numpy() for x in (dout, q, k, v, out)]
    lse_packed = lse.permute(1, 0, 2).reshape(4, 38).contiguous().numpy()
    got = flashattn.flash_attn_varlen_backward(*packed, lse_packed, cu.numpy(), cu.numpy(), 19, 19, causal=True,
                                               learnable_sink=sinks.detach().numpy(), num_threads=2)
    np.testing.assert_allclose(got[3], sinks.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0].reshape(2, 19, 4, 16), q.grad.numpy(), rtol=0, atol=1e-5)


def test_sinks_is_an_alias_of_learnable_sink_on_every_function():
    """`sinks=` (gpt-oss's name) on each public function that takes learnable_sink: the same
    outputs and the same gradient (bit for bit) as `learnable_sink=`; both at once, or a bad
    `sinks`, is refused before anything runs."""
    import inspect

    for fn in (flashattn.flash_attn_func, flashattn.flash_attn_qkvpacked_func, flashattn.flash_attn_kvpacked_func,
               flashattn.flash_attn_varlen_func, flashattn.flash_attn_varlen_qkvpacked_func,
               flashattn.flash_attn_varlen_kvpacked_func, flashattn.flash_attn_with_kvcache,
               flashattn.flash_attn_backward, flashattn.flash_attn_varlen_backward):
        params = inspect.signature(fn).parameters
        assert params["sinks"].kind == inspect.Parameter.KEYWORD_ONLY and params["sinks"].default is None, fn.__name__
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 11, 4, 16, generator=gen) for _ in range(3))
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0])
    results = []
    for name in ("learnable_sink", "sinks"):
        a = [x.clone().requires_grad_() for x in (q, k, v, logits)]
        out = flashattn.flash_attn_func(*a[:3], causal=True, **{name: a[3]})
        out.sum().backward()
        results.append([out] + [x.grad for x in a])
    for want, got in zip(*results):
        assert torch.equal(want, got)
    cu = torch.tensor([0, 5, 22], dtype=torch.int32)
    flat = [x.reshape(22, 4, 16) for x in (q, k, v)]
    assert torch.equal(flashattn.flash_attn_varlen_func(*flat, cu, cu, 17, 17, sinks=logits),
                       flashattn.flash_attn_varlen_func(*flat, cu, cu, 17, 17, learnable_sink=logits))
    seqlens = torch.tensor([11, 7], dtype=torch.int32)
    assert torch.equal(flashattn.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=seqlens, sinks=logits),
                       flashattn.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=seqlens, learnable_sink=logits))
    with pytest.raises(TypeError, match="learnable_sink, sinks: one argument under two names"):
        flashattn.flash_attn_func(q, k, v, learnable_sink=logits, sinks=logits)
    with pytest.raises(ValueError, match=r"learnable_sink: expected shape \(heads_q,\) = \(4,\), got \(3,\)"):
        flashattn.flash_attn_func(q, k, v, sinks=torch.zeros(3))
