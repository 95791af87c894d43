"""Upstream FlashAttention's `flash_attn.flash_attn_interface` module on the CPU (PyTorch only).

The public functions are flashattn's own (torch.library ops underneath). The low-level
functions keep upstream's names, positional order and return values, for code such as
ring attention and context parallelism that calls them directly:

- ``_flash_attn_forward(...) -> (out, softmax_lse, S_dmask, rng_state)``
- ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, ...) -> softmax_d``,
  writing the gradients into the dq, dk, dv arguments;
- the varlen pair, and the ``FlashAttn*Func`` autograd classes built on them.

``rng_state`` is the dropout (seed, offset) as an int64 tensor of shape (2,): drawn from
torch's default CPU generator by the forward, handed back to the backward. docs/python.md
lists the differences from upstream.
"""

from __future__ import annotations

from typing import Optional

try:
    import torch
except ImportError as e:  # as upstream's module, this one is for PyTorch users
    raise ImportError("flashattn.flash_attn_interface needs PyTorch (the NumPy functions are in flashattn)") from e

from . import _C
from . import _interface as _impl
from ._interface import (  # noqa: F401  (upstream's public functions, re-exported)
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = _C.__version__


def maybe_contiguous(x):
    """x, copied to be contiguous when its last dimension is strided (as upstream)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


def _alibi(alibi_slopes):
    return alibi_slopes if alibi_slopes is None or isinstance(alibi_slopes, torch.Tensor) \
        else torch.as_tensor(alibi_slopes)


def _rng_for_forward(dropout_p):
    state = _impl._torch_rng_state(dropout_p, None)
    return (state, state) if state is not None else (None, torch.zeros(2, dtype=torch.int64))


def _rng_for_backward(dropout_p, rng_state):
    if not dropout_p > 0.0:
        return None
    if rng_state is None:
        raise ValueError("rng_state: a backward with dropout needs the rng_state its forward returned")
    return rng_state


def _check_return_softmax(return_softmax, dropout_p):
    if return_softmax and not dropout_p > 0.0:
        raise ValueError("return_softmax: S_dmask is only returned with dropout_p > 0 (as upstream)")


def _flash_attn_forward(q, k, v, dropout_p: float, softmax_scale: Optional[float], causal: bool,
                        window_size_left: int, window_size_right: int, softcap: float, alibi_slopes,
                        return_softmax: bool):
    """(out, softmax_lse, S_dmask, rng_state); S_dmask is empty unless return_softmax."""
    _check_return_softmax(return_softmax, dropout_p)
    op_rng, rng_state = _rng_for_forward(dropout_p)
    alibi_slopes = _alibi(alibi_slopes)
    out, lse = torch.ops.flashattn.fwd(q, k, v, float(dropout_p), softmax_scale, bool(causal), int(window_size_left),
                                       int(window_size_right), float(softcap), alibi_slopes, False, op_rng, "auto",
                                       "auto", 0)
    s_dmask = (_impl._torch_s_dmask(q, k, v, None, dropout_p, softmax_scale, causal,
                                    (window_size_left, window_size_right), softcap, alibi_slopes, op_rng)
               if return_softmax else q.new_empty((0,)))
    return out, lse, s_dmask, rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                               dropout_p: float, softmax_scale: Optional[float], causal: bool,
                               window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes=None, return_softmax: bool = False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors: bool = False):
    """(out, softmax_lse (Hq, total_q), S_dmask, rng_state) of a packed variable-length batch."""
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k: not supported by the varlen forward on the CPU "
                                  "(flash_attn_with_kvcache has cache_leftpad)")
    if block_table is not None:  # page pools read in place: inference only
        _check_return_softmax(return_softmax, dropout_p)
        out, lse, _ = _impl._paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale,
                                          causal, (window_size_left, window_size_right), softcap, alibi_slopes, True,
                                          block_table, seqused_k, None, None, "auto", None, 0)
        return out, lse, q.new_empty((0,)), torch.zeros(2, dtype=torch.int64)
    if seqused_k is not None:
        raise ValueError("seqused_k: belongs to a paged batch (block_table)")
    _check_return_softmax(return_softmax, dropout_p)
    op_rng, rng_state = _rng_for_forward(dropout_p)
    alibi_slopes = _alibi(alibi_slopes)
    varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    out, lse = torch.ops.flashattn.varlen_fwd(q, k, v, *varlen, float(dropout_p), softmax_scale, bool(causal),
                                              int(window_size_left), int(window_size_right), float(softcap),
                                              alibi_slopes, False, op_rng, "auto", "auto", 0)
    s_dmask = (_impl._torch_s_dmask(q, k, v, varlen, dropout_p, softmax_scale, causal,
                                    (window_size_left, window_size_right), softcap, alibi_slopes, op_rng)
               if return_softmax else q.new_empty((0,)))
    return out, lse, s_dmask, rng_state


def _write_grads(grads, dq, dk, dv):
    """Copies the gradients into the caller's dq, dk, dv (those not None), each checked first
    against its gradient's shape and dtype (as upstream's kernels check them): nothing is
    written where one is refused."""
    pairs = [(name, dst, src) for name, dst, src in zip(("dq", "dk", "dv"), (dq, dk, dv), grads) if dst is not None]
    for name, dst, src in pairs:
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(dst).__name__}")
        if dst.device != src.device:  # a meta tensor would take the copy and hold nothing
            raise ValueError(f"{name}: device {dst.device} but expected {src.device} (its input's)")
        if dst.dtype != src.dtype:
            raise TypeError(f"{name}: dtype {dst.dtype} but expected {src.dtype} (its input's)")
        if dst.shape != src.shape:
            raise ValueError(f"{name}: shape {tuple(dst.shape)} but expected {tuple(src.shape)} (its input's)")
    for _, dst, src in pairs:
        dst.copy_(src)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p: float,
                         softmax_scale: Optional[float], causal: bool, window_size_left: int, window_size_right: int,
                         softcap: float, alibi_slopes, deterministic: bool, rng_state=None):
    """Writes the gradients into dq, dk, dv (those not None); returns softmax_d =
    rowsum(dout * out), float32 (B, Hq, Sq)."""
    grads = torch.ops.flashattn.bwd(dout.to(q.dtype), q, k, v, out, softmax_lse, float(dropout_p), softmax_scale,
                                    bool(causal), int(window_size_left), int(window_size_right), float(softcap),
                                    _alibi(alibi_slopes), bool(deterministic), _rng_for_backward(dropout_p, rng_state),
                                    "auto", 0)
    _write_grads(grads, dq, dk, dv)
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: Optional[float], causal: bool, window_size_left: int,
                                window_size_right: int, softcap: float, alibi_slopes, deterministic: bool,
                                rng_state=None, zero_tensors: bool = False):
    """As _flash_attn_backward for a packed batch; softmax_d is (Hq, total_q)."""
    grads = torch.ops.flashattn.varlen_bwd(dout.to(q.dtype), q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                           int(max_seqlen_q), int(max_seqlen_k), float(dropout_p), softmax_scale,
                                           bool(causal), int(window_size_left), int(window_size_right),
                                           float(softcap), _alibi(alibi_slopes), bool(deterministic),
                                           _rng_for_backward(dropout_p, rng_state), "auto", 0)
    _write_grads(grads, dq, dk, dv)
    return (dout.float() * out.float()).sum(-1).transpose(0, 1)


# Upstream keeps the raw functions and their torch.ops wrappers under both names.
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward


# ---- upstream's autograd classes ----------------------------------------------------------------


def _save(ctx, tensors, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, **extra):
    ctx.save_for_backward(*tensors)
    ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size = dropout_p, softmax_scale, causal, window_size
    ctx.softcap, ctx.alibi_slopes, ctx.deterministic = softcap, alibi_slopes, deterministic
    for name, value in extra.items():
        setattr(ctx, name, value)


def _options(ctx):
    return (ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size[0], ctx.window_size[1], ctx.softcap,
            ctx.alibi_slopes, ctx.deterministic)


def _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_softmax):
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size[0],
                                                       window_size[1], softcap, alibi_slopes,
                                                       return_softmax and dropout_p > 0)
    _save(ctx, (q, k, v, out, lse, rng_state), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
          deterministic)
    return (out, lse, s_dmask) if return_softmax else out


def _dense_backward(ctx, dout, dq, dk, dv):
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, *_options(ctx), rng_state=rng_state)


def _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table=None):
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size[0], window_size[1], softcap, alibi_slopes, return_softmax and dropout_p > 0, block_table)
    _save(ctx, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state), dropout_p, softmax_scale, causal,
          window_size, softcap, alibi_slopes, deterministic, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return (out, lse, s_dmask) if return_softmax else out


def _varlen_backward(ctx, dout, dq, dk, dv):
    q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
    _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                                *_options(ctx), rng_state=rng_state)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _dense_backward(ctx, dout, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 9


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        q, k, v = (qkv[:, :, i].detach() for i in range(3))
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        q = ctx.saved_tensors[0]
        dqkv = q.new_empty((*q.shape[:-2], 3, *q.shape[-2:]))
        _dense_backward(ctx, dout, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2])
        return (dqkv,) + (None,) * 9


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        k, v = kv[:, :, 0].detach(), kv[:, :, 1].detach()
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k = ctx.saved_tensors[:2]
        dq, dkv = torch.empty_like(q), k.new_empty((*k.shape[:-2], 2, *k.shape[-2:]))
        _dense_backward(ctx, dout, dq, dkv[:, :, 0], dkv[:, :, 1])
        return (dq, dkv) + (None,) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table, is_grad_enabled=True):
        return _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax, block_table)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _varlen_backward(ctx, dout, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 14


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        q, k, v = (qkv[:, i].detach() for i in range(3))
        return _varlen_forward(ctx, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                               causal, window_size, softcap, alibi_slopes, deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        q = ctx.saved_tensors[0]
        dqkv = q.new_empty((*q.shape[:-2], 3, *q.shape[-2:]))
        _varlen_backward(ctx, dout, dqkv[:, 0], dqkv[:, 1], dqkv[:, 2])
        return (dqkv,) + (None,) * 11


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        k, v = kv[:, 0].detach(), kv[:, 1].detach()
        return _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k = ctx.saved_tensors[:2]
        dq, dkv = torch.empty_like(q), k.new_empty((*k.shape[:-2], 2, *k.shape[-2:]))
        _varlen_backward(ctx, dout, dq, dkv[:, 0], dkv[:, 1])
        return (dq, dkv) + (None,) * 13
