"""flashattn.flash_attn_interface: upstream's module contents and signatures (low-level
functions with out-arguments, the FlashAttn*Func classes), its __version__, and
install_as_flash_attn() (subprocesses). Skipped without torch."""

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import flash_attn_interface as fai  # noqa: E402
from conftest import seed_for  # noqa: E402

# Upstream's parameter lists (flash_attn/flash_attn_interface.py, FlashAttention 2.7/2.8).
UPSTREAM_SIGNATURES = {
    "_flash_attn_forward": "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
                           "alibi_slopes return_softmax",
    "_flash_attn_varlen_forward": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
                                  "softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
                                  "return_softmax block_table leftpad_k seqused_k zero_tensors",
    "_flash_attn_backward": "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left "
                            "window_size_right softcap alibi_slopes deterministic rng_state",
    "_flash_attn_varlen_backward": "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                   "max_seqlen_k dropout_p softmax_scale causal window_size_left "
                                   "window_size_right softcap alibi_slopes deterministic rng_state zero_tensors",
    "flash_attn_func": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                       "return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
                              "causal window_size softcap alibi_slopes deterministic return_attn_probs block_table",
}
UPSTREAM_CLASSES = {
    "FlashAttnFunc": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                     "return_softmax is_grad_enabled",
    "FlashAttnQKVPackedFunc": "qkv dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                              "return_softmax is_grad_enabled",
    "FlashAttnKVPackedFunc": "q kv dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                             "return_softmax is_grad_enabled",
    "FlashAttnVarlenFunc": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
                           "causal window_size softcap alibi_slopes deterministic return_softmax block_table "
                           "is_grad_enabled",
    "FlashAttnVarlenQKVPackedFunc": "qkv cu_seqlens max_seqlen dropout_p softmax_scale causal window_size softcap "
                                    "alibi_slopes deterministic return_softmax is_grad_enabled",
    "FlashAttnVarlenKVPackedFunc": "q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
                                   "softmax_scale causal window_size softcap alibi_slopes deterministic "
                                   "return_softmax is_grad_enabled",
}


def _positional(fn, skip=0):
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return " ".join(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


@pytest.mark.parametrize("name", sorted(UPSTREAM_SIGNATURES))
def test_upstream_signatures(name):
    assert _positional(getattr(fai, name)) == UPSTREAM_SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(UPSTREAM_CLASSES))
def test_upstream_classes(name):
    cls = getattr(fai, name)
    assert issubclass(cls, torch.autograd.Function)
    assert _positional(cls.forward, skip=1) == UPSTREAM_CLASSES[name]


def test_interface_version():
    assert fai.__version__ == flashattn.__version__


def _qkv(seed, shape=(2, 27, 4, 16), kv_heads=2, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, d = shape
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s + 5, kv_heads, d, generator=gen)
    v = torch.randn(b, s + 5, kv_heads, d, generator=gen)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_low_level_forward_backward_out_arguments():
    """_flash_attn_backward writes into dq, dk, dv (strided views of one buffer, as ring
    attention passes them) the gradients autograd gives; softmax_d = rowsum(dout * out)."""
    seed = seed_for("low_level")
    q, k, v = _qkv(seed, requires_grad=True)
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, None, True,
                                                           -1, -1, 0.0, None, False)
    assert s_dmask.shape == (0,) and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    ref = flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert torch.equal(out, ref.detach()) and lse.shape == (2, 4, 27)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref.backward(dout)
    buf = torch.full((2, 32, 3, 2, 16), float("nan"))
    dq = torch.full_like(q, float("nan"))
    dk, dv = buf[:, :, 0], buf[:, :, 1]
    softmax_d = fai._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, 0.0, None,
                                         True, -1, -1, 0.0, None, True, rng_state)
    for name, got, want in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert torch.equal(got, want), name
    assert torch.isnan(buf[:, :, 2]).all(), "wrote outside dk, dv"
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).transpose(1, 2))


def test_low_level_dropout_rng_state_round_trip():
    """The forward's rng_state, handed to the backward, reproduces its mask: the gradients
    are those of autograd on flash_attn_func under the same torch.manual_seed."""
    seed = seed_for("rng_round_trip")
    q, k, v = _qkv(seed, requires_grad=True)
    torch.manual_seed(seed)
    ref = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, deterministic=True)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref.backward(dout)
    torch.manual_seed(seed)
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.3, None, False,
                                                           -1, -1, 0.0, None, True)
    assert torch.equal(out, ref.detach())
    assert s_dmask.shape == (2, 4, 27, 32) and s_dmask.dtype == q.dtype and (s_dmask < 0).any()
    grads = [torch.empty_like(t) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, *grads, 0.3, None, False, -1, -1,
                             0.0, None, True, rng_state)
    for name, got, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert torch.equal(got, t.grad), name
    with pytest.raises(ValueError, match="rng_state"):
        fai._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, *grads, 0.3, None, False, -1,
                                 -1, 0.0, None, True, None)
    # The caller's dq, dk, dv are checked against the gradients before any is written.
    kept = [torch.full_like(t, 3.0) for t in grads]
    for i, (bad, exc, pattern) in enumerate(((torch.zeros(3, *q.shape[1:]), ValueError, r"dq: shape \(3,"),
                                             (torch.zeros(k.shape, dtype=torch.float64), TypeError,
                                              "dk: dtype torch.float64 but expected torch.float32"),
                                             (torch.zeros(*v.shape[:-1], 1), ValueError, "dv: shape"),
                                             # a meta tensor took the copy and held nothing
                                             (torch.empty(k.shape, device="meta"), ValueError,
                                              "dq: device meta but expected cpu"))):
        args = list(kept)
        args[i % 3] = bad
        with pytest.raises(exc, match=pattern):
            fai._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, *args, 0.3, None, False,
                                     -1, -1, 0.0, None, True, rng_state)
        assert all((t == 3.0).all() for t in kept) and (bad.is_meta or not bad.any())
    with pytest.raises(ValueError, match="return_softmax"):
        fai._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, True)


def _grads(out, dout, *tensors):
    return torch.autograd.grad(out, tensors, dout)


def test_classes_match_functions():
    seed = seed_for("classes")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(seed, requires_grad=True)
    opts = (0.0, None, True, (-1, -1), 0.0, None, True)
    out = fai.FlashAttnFunc.apply(q, k, v, *opts, False)
    ref = flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    assert torch.equal(out, ref)
    for a, b in zip(_grads(out, dout, q, k, v), _grads(ref, dout, q, k, v)):
        assert torch.equal(a, b)
    out, lse, s_dmask = fai.FlashAttnFunc.apply(q, k, v, *opts, True)
    assert lse.shape == (2, 4, 27) and s_dmask.shape == (0,)
    # FlashAttention 2.7's flash_attn_func passes torch.is_grad_enabled() last: taken, the same.
    out = fai.FlashAttnFunc.apply(q, k, v, *opts, False, torch.is_grad_enabled())
    ref = flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
    for a, b in zip(_grads(out, dout, q, k, v), _grads(ref, dout, q, k, v)):
        assert torch.equal(a, b)

    qkv = torch.randn(2, 19, 3, 2, 16, generator=gen, requires_grad=True)
    out = fai.FlashAttnQKVPackedFunc.apply(qkv, *opts, False)
    ref = flashattn.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    assert torch.equal(out, ref) and torch.equal(_grads(out, dout, qkv)[0], _grads(ref, dout, qkv)[0])

    kv = torch.randn(2, 32, 2, 2, 16, generator=gen, requires_grad=True)
    out = fai.FlashAttnKVPackedFunc.apply(q, kv, *opts, False)
    ref = flashattn.flash_attn_kvpacked_func(q, kv, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    assert torch.equal(out, ref)
    for a, b in zip(_grads(out, dout, q, kv), _grads(ref, dout, q, kv)):
        assert torch.equal(a, b)


def test_varlen_classes_match_functions():
    seed = seed_for("varlen_classes")
    gen = torch.Generator().manual_seed(seed)
    lens = [7, 0, 12, 5]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    total, m = sum(lens), max(lens)
    opts = (0.0, None, True, (-1, -1), 0.0, None, True)
    q = torch.randn(total, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(total, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(total, 2, 16, generator=gen, requires_grad=True)
    out = fai.FlashAttnVarlenFunc.apply(q, k, v, cu, cu, m, m, *opts, False, None)
    ref = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    assert torch.equal(out, ref)
    for a, b in zip(_grads(out, dout, q, k, v), _grads(ref, dout, q, k, v)):
        assert torch.equal(a, b)
    qkv = torch.randn(total, 3, 2, 16, generator=gen, requires_grad=True)
    out = fai.FlashAttnVarlenQKVPackedFunc.apply(qkv, cu, m, *opts, False)
    ref = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, m, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    assert torch.equal(out, ref) and torch.equal(_grads(out, dout, qkv)[0], _grads(ref, dout, qkv)[0])
    kv = torch.randn(total, 2, 2, 16, generator=gen, requires_grad=True)
    out = fai.FlashAttnVarlenKVPackedFunc.apply(q, kv, cu, cu, m, m, *opts, False)
    ref = flashattn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, m, m, causal=True, deterministic=True)
    dout = torch.randn(out.shape, generator=gen)
    assert torch.equal(out, ref)
    for a, b in zip(_grads(out, dout, q, kv), _grads(ref, dout, q, kv)):
        assert torch.equal(a, b)
    # The low-level varlen backward writes into its out-arguments; softmax_d is (Hq, total_q).
    o, lse, _, rng = fai._flash_attn_varlen_forward(q.detach(), k.detach(), v.detach(), cu, cu, m, m, 0.0, None,
                                                    True)
    dout = torch.randn(o.shape, generator=gen)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    softmax_d = fai._flash_attn_varlen_backward(dout, q.detach(), k.detach(), v.detach(), o, lse, *grads, cu, cu, m,
                                                m, 0.0, None, True, -1, -1, 0.0, None, True, rng)
    ref = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, deterministic=True)
    for a, b in zip(grads, _grads(ref, dout, q, k, v)):
        assert torch.equal(a, b)
    assert softmax_d.shape == (4, total)
    with pytest.raises(ValueError, match="seqused_k: belongs to a paged batch"):
        fai._flash_attn_varlen_forward(q, k, v, cu, cu, m, m, 0.0, None, True, seqused_k=cu)


_INSTALL_SCRIPT = """
import importlib.util, sys
import flashattn
installed = flashattn.install_as_flash_attn()
import flash_attn
from flash_attn import flash_attn_func
from flash_attn.flash_attn_interface import _flash_attn_forward, FlashAttnFunc
print(installed, flash_attn.__name__, flash_attn_func is flashattn.flash_attn_func, flashattn.install_as_flash_attn())
"""


def _run(script, extra_path=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra_path, *sys.path]))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    return res


def test_install_as_flash_attn():
    if __import__("importlib").util.find_spec("flash_attn") is not None:
        pytest.skip("a real flash_attn is installed here: the alias is (rightly) refused; see the shadow test")
    res = _run(_INSTALL_SCRIPT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True", "flashattn", "True", "True"], res.stdout


def test_install_as_flash_attn_never_shadows(tmp_path):
    """A flash_attn that can be imported (here a stand-in package on the path) stays the
    one `import flash_attn` gives."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    script = """
import flashattn
print(flashattn.install_as_flash_attn())
import flash_attn
print(getattr(flash_attn, "REAL", False))
"""
    res = _run(script, extra_path=[str(tmp_path)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["False", "True"], res.stdout
