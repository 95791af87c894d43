"""PyTorch CPU tensors: tensors in, tensors out, autograd through flash_attn_backward,
and agreement with torch.nn.functional.scaled_dot_product_attention where the
semantics agree (non-causal, or causal with Sq == Sk). Skipped without torch."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import reference as ref  # noqa: E402
from conftest import BF16, alibi, seed_for  # noqa: E402

F = torch.nn.functional
TORCH_DTYPES = {torch.float32: np.dtype(np.float32), torch.bfloat16: BF16, torch.float16: np.dtype(np.float16)}
DTYPE_PARAM = pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def to_numpy(t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16).copy()
    return t.numpy().copy()


def to_torch(a):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def randn(gen, shape, tdtype, requires_grad=False):
    t = torch.randn(shape, generator=gen, dtype=torch.float32).to(tdtype)
    return t.requires_grad_(requires_grad)


def make(seed, batch, sq, sk, hq, hkv, d, dv, tdtype, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return (randn(gen, (batch, sq, hq, d), tdtype, requires_grad),
            randn(gen, (batch, sk, hkv, d), tdtype, requires_grad),
            randn(gen, (batch, sk, hkv, dv), tdtype, requires_grad))


def assert_same(a, b, msg):
    """Bitwise equality of a torch tensor and a NumPy array (or two tensors)."""
    a = to_numpy(a) if isinstance(a, torch.Tensor) else a
    b = to_numpy(b) if isinstance(b, torch.Tensor) else b
    assert a.shape == b.shape and a.dtype == b.dtype, f"{msg}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)), msg


# --------------------------------------------------------------------------- tensors in/out


@DTYPE_PARAM
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_forward_matches_numpy(causal, tdtype):
    seed = seed_for("torch_fwd", causal, str(tdtype))
    q, k, v = make(seed, 2, 37, 53, 4, 2, 32, 24, tdtype)
    copies = [t.clone() for t in (q, k, v)]
    out = flashattn.flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.shape == (2, 37, 4, 24)
    assert out.device.type == "cpu" and not out.requires_grad
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b), "input modified"
    expected = flashattn.flash_attn_func(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal)
    assert_same(out, expected, f"torch out != numpy out (seed={seed})")
    res = flashattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out2, lse, s_dmask = res
    assert all(isinstance(t, torch.Tensor) for t in res)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 37)
    assert s_dmask.dtype == tdtype and s_dmask.shape == (0,)
    _, _, s_dmask = flashattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, dropout_p=0.2)
    assert s_dmask.dtype == tdtype and s_dmask.shape == (2, 4, 37, 53)
    assert_same(out2, expected, f"(seed={seed})")
    r_out, r_lse, _ = ref.attention_ref(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal)
    tol = 1e-5 if tdtype == torch.float32 else 2e-2
    np.testing.assert_allclose(out.float().numpy(), r_out, atol=tol, err_msg=f"(seed={seed})")
    fin = np.isfinite(r_lse)
    np.testing.assert_allclose(lse.numpy()[fin], r_lse[fin], rtol=1e-5, atol=1e-4)


def test_torch_non_contiguous_inputs():
    seed = seed_for("torch_strided")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 40, 32, generator=gen).transpose(1, 2)       # (B, S, H, D) view of (B, H, S, D)
    k = torch.randn(2, 60, 4, 64, generator=gen)[..., :32]              # row stride 64
    v = torch.randn(2, 120, 2, 32, generator=gen)[:, ::2]               # seq stride 2
    v = torch.cat([v, v], dim=2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    expected = flashattn.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert_same(out, expected, f"(seed={seed})")


@DTYPE_PARAM
def test_torch_route_matches_numpy_route(tdtype):
    """Tensors reach the native core as DLPack capsules, NumPy arrays as views: the same bits
    out of the KV-cache call (with an append and rotary embeddings, the cache written in place),
    the varlen forward and backward, and a forward whose key rows are strided (copied first)."""
    seed = seed_for("torch_route", str(tdtype))
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, (2, 3, 4, 32), tdtype)
    cache_k, cache_v = randn(gen, (2, 40, 2, 32), tdtype), randn(gen, (2, 40, 2, 32), tdtype)
    new_k, new_v = randn(gen, (2, 3, 2, 32), tdtype), randn(gen, (2, 3, 2, 32), tdtype)
    cos, sin = torch.rand(40, 8, generator=gen), torch.rand(40, 8, generator=gen)
    seqlens = torch.tensor([17, 30], dtype=torch.int32)
    np_k, np_v = to_numpy(cache_k), to_numpy(cache_v)
    out, lse = flashattn.flash_attn_with_kvcache(q, cache_k, cache_v, new_k, new_v, cos, sin, seqlens, causal=True,
                                                 return_softmax_lse=True)
    np_out, np_lse = flashattn.flash_attn_with_kvcache(to_numpy(q), np_k, np_v, to_numpy(new_k), to_numpy(new_v),
                                                       cos.numpy(), sin.numpy(), seqlens.numpy(), causal=True,
                                                       return_softmax_lse=True)
    assert_same(out, np_out, f"kvcache out (seed={seed})")
    assert_same(lse, np_lse, f"kvcache lse (seed={seed})")
    assert_same(cache_k, np_k, f"appended k cache (seed={seed})")
    assert_same(cache_v, np_v, f"appended v cache (seed={seed})")
    assert not torch.equal(cache_k[0, 17:20], torch.zeros_like(cache_k[0, 17:20]))

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    vq, vk, vv = (randn(gen, (12, 4 if i == 0 else 2, 32), tdtype, requires_grad=True) for i in range(3))
    out = flashattn.flash_attn_varlen_func(vq, vk, vv, cu, cu, 7, 7, causal=True)
    out.backward(torch.ones_like(out))
    np_out = flashattn.flash_attn_varlen_func(to_numpy(vq), to_numpy(vk), to_numpy(vv), cu.numpy(), cu.numpy(), 7, 7,
                                              causal=True)
    assert_same(out, np_out, f"varlen out (seed={seed})")
    _, np_lse, _ = flashattn.flash_attn_varlen_func(to_numpy(vq), to_numpy(vk), to_numpy(vv), cu.numpy(), cu.numpy(),
                                                    7, 7, causal=True, return_attn_probs=True)
    grads = flashattn.flash_attn_varlen_backward(np.ones(np_out.shape, np_out.dtype), to_numpy(vq), to_numpy(vk),
                                                 to_numpy(vv), np_out, np_lse, cu.numpy(), cu.numpy(), 7, 7,
                                                 causal=True)
    for name, t, g in zip(("dq", "dk", "dv"), (vq, vk, vv), grads):
        assert_same(t.grad, g, f"varlen {name} (seed={seed})")

    k_rows = randn(gen, (2, 40, 2, 64), tdtype)[..., ::2]  # last dim strided: copied before the call
    assert k_rows.stride(-1) == 2
    out = flashattn.flash_attn_func(q, k_rows, cache_v)
    assert_same(out, flashattn.flash_attn_func(to_numpy(q), to_numpy(k_rows), to_numpy(cache_v)),
                f"strided key rows (seed={seed})")


def test_torch_errors():
    q, k, v = make(1, 1, 8, 8, 2, 2, 8, 8, torch.float32)
    with pytest.raises(TypeError):
        flashattn.flash_attn_func(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match=r"\bk\b"):
        flashattn.flash_attn_func(q, k.to(torch.bfloat16), v)
    with pytest.raises(TypeError):
        flashattn.flash_attn_func(q, k.numpy(), v)     # torch and numpy mixed
    with pytest.raises(ValueError, match=r"k: head_dim 16 does not match q head_dim 8"):
        flashattn.flash_attn_func(q, torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16))


# --------------------------------------------------------------------------- autograd

VARIANTS = [dict(), dict(causal=True), dict(window_size=(7, 3), softcap=2.0), dict(causal=True, alibi=True)]
VARIANT_IDS = ["plain", "causal", "window-softcap", "causal-alibi"]


def _kwargs(variant, seed, batch, heads):
    kw = {k: x for k, x in variant.items() if k != "alibi"}
    if variant.get("alibi"):
        kw["alibi_slopes"] = alibi(seed, batch, heads)
    return kw


@DTYPE_PARAM
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_torch_autograd_matches_flash_attn_backward(variant, tdtype):
    """out.backward(dout) gives the gradients of flash_attn_backward (deterministic: bitwise)."""
    seed = seed_for("torch_autograd", str(variant), str(tdtype))
    q, k, v = make(seed, 2, 45, 61, 4, 2, 32, 40, tdtype, requires_grad=True)
    kw = _kwargs(variant, seed, 2, 4)
    kw_t = dict(kw, deterministic=True)
    if "alibi_slopes" in kw:
        kw_t["alibi_slopes"] = torch.from_numpy(kw["alibi_slopes"])
    out = flashattn.flash_attn_func(q, k, v, **kw_t)
    assert out.requires_grad and out.grad_fn is not None
    dout = randn(torch.Generator().manual_seed(seed + 1), tuple(out.shape), tdtype)
    out.backward(dout)
    qn, kn, vn = (to_numpy(t) for t in (q, k, v))
    o, lse, _ = flashattn.flash_attn_func(qn, kn, vn, return_attn_probs=True, **kw)
    assert_same(out, o, f"out (seed={seed})")
    grads = flashattn.flash_attn_backward(to_numpy(dout), qn, kn, vn, o, lse, deterministic=True, **kw)
    for name, t, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert t.grad is not None and t.grad.dtype == tdtype and t.grad.shape == t.shape, name
        assert_same(t.grad, g, f"{name} autograd != flash_attn_backward (seed={seed}, {variant})")


@pytest.mark.parametrize("seed_arg", [1234, None], ids=["seed", "no_seed"])
def test_torch_autograd_dropout(seed_arg):
    """With dropout, autograd reuses the forward's mask (also when the seed was drawn):
    the gradients match the reference built from S_dmask."""
    p = 0.2
    seed = seed_for("torch_dropout", seed_arg)
    q, k, v = make(seed, 2, 33, 47, 4, 2, 16, 16, torch.float32, requires_grad=True)
    out, _, s_dmask = flashattn.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True,
                                                seed=seed_arg)
    dout = randn(torch.Generator().manual_seed(seed + 1), tuple(out.shape), torch.float32)
    out.backward(dout)
    weights = ref.dropout_weights_from_s_dmask(s_dmask.numpy(), p)
    qn, kn, vn = (to_numpy(t) for t in (q, k, v))
    r_out, _, _ = ref.attention_ref(qn, kn, vn, causal=True, dropout_weights=weights)
    np.testing.assert_allclose(out.detach().numpy(), r_out, atol=1e-5, err_msg=f"(seed={seed})")
    refs = ref.attention_backward_ref(dout.numpy(), qn, kn, vn, causal=True, dropout_weights=weights)
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), refs):
        np.testing.assert_allclose(t.grad.numpy(), r, atol=1e-4, err_msg=f"{name} (seed={seed})")


def test_torch_autograd_packed():
    seed = seed_for("torch_packed")
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, 29, 3, 2, 16, generator=gen, requires_grad=True)
    out = flashattn.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    out.backward(dout)
    x = qkv.detach().numpy()
    o, lse, _ = flashattn.flash_attn_func(x[:, :, 0], x[:, :, 1], x[:, :, 2], causal=True, return_attn_probs=True)
    grads = flashattn.flash_attn_backward(dout.numpy(), x[:, :, 0], x[:, :, 1], x[:, :, 2], o, lse, causal=True,
                                          deterministic=True)
    assert_same(qkv.grad, np.stack(grads, axis=2), f"qkv.grad (seed={seed})")

    q = torch.randn(2, 19, 4, 16, generator=gen, requires_grad=True)
    kv = torch.randn(2, 31, 2, 2, 16, generator=gen, requires_grad=True)
    out = flashattn.flash_attn_kvpacked_func(q, kv, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    out.backward(dout)
    qn, kvn = q.detach().numpy(), kv.detach().numpy()
    o, lse, _ = flashattn.flash_attn_func(qn, kvn[:, :, 0], kvn[:, :, 1], return_attn_probs=True)
    dq, dk, dv = flashattn.flash_attn_backward(dout.numpy(), qn, kvn[:, :, 0], kvn[:, :, 1], o, lse,
                                               deterministic=True)
    assert_same(q.grad, dq, f"q.grad (seed={seed})")
    assert_same(kv.grad, np.stack([dk, dv], axis=2), f"kv.grad (seed={seed})")


def test_torch_autograd_varlen():
    seed = seed_for("torch_varlen")
    gen = torch.Generator().manual_seed(seed)
    lq, lk = [5, 0, 17, 9], [8, 3, 12, 0]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(sum(lk), 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(sum(lk), 2, 16, generator=gen, requires_grad=True)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, deterministic=True)
    assert isinstance(out, torch.Tensor) and out.shape == (sum(lq), 4, 16)
    dout = torch.randn(out.shape, generator=gen)
    out.backward(dout)
    for b in range(len(lq)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq[b] == 0:
            continue
        sq, sk, sv = (t.detach().numpy()[None, s] for t, s in ((q, qs), (k, ks), (v, ks)))
        r_out, _, _ = ref.attention_ref(sq, sk, sv, causal=True)
        np.testing.assert_allclose(out.detach().numpy()[None, qs], r_out, atol=1e-5, err_msg=f"seq {b}")
        refs = ref.attention_backward_ref(dout.numpy()[None, qs], sq, sk, sv, causal=True)
        for name, t, s, r in zip(("dq", "dk", "dv"), (q, k, v), (qs, ks, ks), refs):
            np.testing.assert_allclose(t.grad.numpy()[None, s], r, atol=1e-4, err_msg=f"{name} seq {b} (seed={seed})")
    # Keys of a sequence without queries get no gradient.
    assert torch.all(k.grad[int(cu_k[1]):int(cu_k[2])] == 0) and torch.all(v.grad[int(cu_k[1]):int(cu_k[2])] == 0)


def test_torch_no_grad():
    q, k, v = make(3, 1, 8, 8, 2, 2, 8, 8, torch.float32, requires_grad=True)
    with torch.no_grad():
        out = flashattn.flash_attn_func(q, k, v)
    assert not out.requires_grad and out.grad_fn is None


# --------------------------------------------------------------------------- SDPA


def _sdpa(q, k, v, causal, scale=None):
    """SDPA on upstream's layout: (B, S, H, D) -> (B, H, S, D) and back; GQA by repeat."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    kw = {} if scale is None else {"scale": scale}
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kw).transpose(1, 2)


@DTYPE_PARAM
@pytest.mark.parametrize("case", [
    dict(sq=63, sk=95, causal=False, heads=(4, 4), d=32),
    dict(sq=95, sk=63, causal=False, heads=(4, 2), d=64),
    dict(sq=80, sk=80, causal=True, heads=(4, 1), d=32),
    dict(sq=80, sk=80, causal=True, heads=(2, 2), d=128, scale=0.3),
], ids=["full-63x95", "full-95x63-gqa", "causal-square-mqa", "causal-square-scale"])
def test_against_sdpa(case, tdtype):
    seed = seed_for("sdpa", str(case), str(tdtype))
    q, k, v = make(seed, 2, case["sq"], case["sk"], *case["heads"], case["d"], case["d"], tdtype, requires_grad=True)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    scale = case.get("scale")
    out = flashattn.flash_attn_func(q, k, v, causal=case["causal"], softmax_scale=scale)
    expected = _sdpa(q2, k2, v2, case["causal"], scale)
    tol_out, tol_grad = (1e-5, 1e-4) if tdtype == torch.float32 else (2e-2, 5e-2)
    ctx = f"(seed={seed}, {case}, {tdtype})"
    torch.testing.assert_close(out.float(), expected.float(), atol=tol_out, rtol=0 if tdtype == torch.float32 else 2e-2,
                               msg=lambda m: f"out vs SDPA {ctx}\n{m}")
    dout = randn(torch.Generator().manual_seed(seed + 1), tuple(out.shape), tdtype)
    out.backward(dout)
    expected.backward(dout)
    for name, a, b in zip(("dq", "dk", "dv"), (q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=tol_grad,
                                   rtol=0 if tdtype == torch.float32 else 2e-2,
                                   msg=lambda m, name=name: f"{name} vs SDPA {ctx}\n{m}")


# --------------------------------------------------------------------------- shared threads

_INTERLEAVED_SCRIPT = """
import sys
for name in sys.argv[1].split(","):
    __import__(name)
import torch, flashattn
gen = torch.Generator().manual_seed(5)
q, k, v = (torch.randn(1, 200, h, 64, generator=gen).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
dout = torch.randn(1, 200, 4, 64, generator=gen).to(torch.bfloat16)
a, b = (torch.randn(512, 512, generator=gen).to(torch.bfloat16) for _ in range(2))
product = a @ b
want = flashattn.flash_attn_func(q, k, v, causal=True)
want_grads = torch.autograd.grad(want, (q, k, v), dout)
def check(what, step):
    assert torch.equal(a @ b, product), f"torch's product changed after flashattn's {what} (step {step})"
for step in range(10):  # each of flashattn's calls right after one of torch's and vice versa
    check("calls", step)
    assert torch.equal(flashattn.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True), want), step
    check("forward", step)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, want), f"forward after torch's bf16 products (step {step})"
    for _ in range(2):
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for name, g, w in zip("qkv", grads, want_grads):
            assert torch.equal(g, w), f"d{name} after torch's bf16 products (step {step})"
        check("backward", step)
print("ok")
"""


@pytest.mark.parametrize("first", ["torch,flashattn", "flashattn,torch"])
def test_bf16_kernels_interleaved_with_torch_bf16_products(first):
    """torch's bf16 matrix products run on the same threads as flashattn's kernels, and on a
    CPU with AMX both use the thread's tile state (oneDNN configures tiles of its own shapes
    and releases them after its products): calls interleaved with torch's products give the
    bits of the first call, and torch's products are unchanged by ours. In a fresh process
    for each import order (which decides the threads the two libraries share). Meaningful
    where both run on AMX (Sapphire Rapids and later); elsewhere the same checks hold
    trivially."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", _INTERLEAVED_SCRIPT, first], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (
        f"import order {first}: exit {res.returncode} {res.stdout[-500:]!r} {res.stderr[-2000:]}")
