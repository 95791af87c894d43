"""Attention sinks through the extension's Options (sinks, dsinks) against an eager torch
implementation of gpt-oss's sinks, its gradients by torch autograd. The `sinks=` keyword
of the public functions is not wired yet (docs/python.md, "Attention sinks")."""

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
