"""flashattn.scaled_dot_product_attention: PyTorch's SDPA on the native core.

query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv), SDPA's layout, reach the
library as transposed views (B, S, H, D) — no copies — and the output comes back as the
transposed view of the library's (B, Sq, Hq, Dv). is_causal is top-left aligned (the
library's causal_alignment "top_left"), attn_mask the library's dense attn_mask (bool:
True keeps; float: added to the scaled scores), broadcast from the right as SDPA's.

Torch tensors go through the custom ops flashattn::sdpa_fwd / flashattn::sdpa_bwd (fake
kernels for torch.compile, autograd for dq, dk, dv and a float attn_mask's gradient, the
library's dbias summed over the mask's broadcast dims, and the sinks' dsinks); NumPy arrays
are forward only. Beyond SDPA's arguments, keyword-only: softcap and learnable_sink (the
library's soft-capping and attention sinks, as flash_attn_func takes them), which torch's SDPA
lacks and which models such as Gemma 2 and gpt-oss combine with a dense mask.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np

from . import _interface as _impl

torch = _impl.torch
Tensor = torch.Tensor if torch is not None else np.ndarray  # the ops' schema reads the annotations

_MASK64 = (1 << 64) - 1
# The largest magnitude of a scale (or score_mod's c) the kernels take: they multiply it by log2(e) in float32.
LARGEST_SCALED = _impl._C.LARGEST_SCALED


def check_layout(query, key, value, scale, enable_gqa):
    """query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv) of one dtype, and a
    finite scale, as ValueError/TypeError naming SDPA's arguments (the native checks name the
    (B, S, H, D) views q, k, v). Rank and dtype kinds are checked before."""
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise TypeError(f"{name}: dtype {x.dtype} but query has {query.dtype} (query, key and value share one "
                            "dtype)")
        if x.shape[0] != query.shape[0]:
            raise ValueError(f"{name}: batch {x.shape[0]} but query has {query.shape[0]}")
    if tuple(value.shape[1:3]) != tuple(key.shape[1:3]):
        raise ValueError(f"value: (heads, seqlen) {tuple(value.shape[1:3])} but key has {tuple(key.shape[1:3])}")
    if key.shape[3] != query.shape[3]:
        raise ValueError(f"key: head_dim {key.shape[3]} but query has {query.shape[3]}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq < 1 or hkv < 1:
        raise ValueError(f"{'query' if hq < 1 else 'key'}: 0 heads; flashattn needs at least one (torch's SDPA "
                         "returns an empty result)")
    if not enable_gqa and hq != hkv:
        raise ValueError(f"key: {hkv} heads but query has {hq}; pass enable_gqa=True for grouped-query attention")
    if hq % hkv:
        raise ValueError(f"query: {hq} heads, not a multiple of key's and value's {hkv} (grouped-query attention)")
    if scale is not None and not (math.isfinite(scale) and abs(scale) <= LARGEST_SCALED):
        raise ValueError(f"scale: must be finite, of magnitude at most {LARGEST_SCALED:.3g}, got {scale!r}")


def _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap):
    """SDPA's argument rules (and softcap's type), as ValueError/TypeError naming the argument,
    before any work (or any draw from a random generator)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not (_impl._is_tensor(x) or isinstance(x, np.ndarray)):
            raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (batch, heads, seqlen, head_dim), got shape {tuple(x.shape)}")
        if _impl._is_tensor(x) and x.layout != torch.strided:
            raise TypeError(f"{name}: layout {x.layout} is not supported (dense, strided tensors only)")
    if len({_impl._is_tensor(x) for x in (query, key, value)}) > 1:
        raise TypeError("inputs mix numpy arrays and torch tensors: query, key, value")
    for name, x in (("query", query), ("key", key), ("value", value)):
        _impl._dtype_of(x, name)
    # NumPy views may run backwards; the native views may not. Named here in SDPA's layout
    # (the native check would name the transposed (B, S, H, D) view's dim).
    for name, x in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)):
        if isinstance(x, np.ndarray):
            for dim, stride in enumerate(x.strides):
                if stride < 0:
                    raise ValueError(f"{name}: negative stride {stride // x.itemsize} in dim {dim} "
                                     "(only non-negative strides are supported)")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask: must be None when is_causal=True (as torch's scaled_dot_product_attention)")
    # Real numbers, NumPy's included (as torch's SDPA takes them); a bool or a non-number is a
    # TypeError, a value out of range a ValueError.
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    check_layout(query, key, value, scale, enable_gqa)
    if attn_mask is None:
        return
    if _impl._is_tensor(attn_mask):
        if attn_mask.layout != torch.strided:
            raise TypeError(f"attn_mask: layout {attn_mask.layout} is not supported (dense, strided tensors only)")
        floating = attn_mask.dtype.is_floating_point
        if attn_mask.dtype != torch.bool and not floating:
            raise TypeError(f"attn_mask: dtype {attn_mask.dtype} is neither bool nor floating")
    elif isinstance(attn_mask, np.ndarray):
        if attn_mask.dtype != np.bool_ and attn_mask.dtype not in _impl._NUMPY_DTYPES:
            raise TypeError(f"attn_mask: dtype {attn_mask.dtype} is neither bool nor float32, float16, bfloat16")
    else:
        raise TypeError(f"attn_mask: expected a numpy.ndarray or a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.ndim > 4:
        raise ValueError(f"attn_mask: rank {attn_mask.ndim} does not broadcast to (batch, heads, seqlen_q, seqlen_k)")


def _opts(attn_mask, dropout_p, is_causal, scale, rng_state, num_threads, softcap, sinks):
    o = _impl._options(dropout_p, scale, is_causal, (-1, -1), softcap, None, False, None, sinks=sinks,
                       attn_mask=attn_mask, causal_alignment="top_left")
    if rng_state is not None:
        o.seed, o.offset = (int(x) & _MASK64 for x in rng_state.tolist())
    o.num_threads = _impl._resolve_threads(num_threads, True)
    return o


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, softcap=0.0, learnable_sink=None):
    """torch.nn.functional.scaled_dot_product_attention on flashattn's CPU kernels.

    query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv), torch
    tensors or NumPy arrays. attn_mask: bool (True keeps) or float (added to the scaled
    scores), broadcastable to (B, Hq, Sq, Sk) from the right (2-D (Sq, Sk), 3-D, 4-D); size-1
    dims are read once, never expanded. is_causal: key j visible to query i iff j <= i
    (top-left). scale: default 1/sqrt(D). enable_gqa: Hq a multiple of Hkv. dropout_p: the
    library's dropout (its own RNG, seeded from torch's generator: the masks differ from
    torch's). Gradients of query, key, value and a float attn_mask through autograd (the
    mask's in its own shape and dtype, summed over its broadcast dims, as torch's).

    Keyword-only extras (not torch's): softcap, the scaled scores soft-capped to
    softcap·tanh(s / softcap) before attn_mask is added (0: off); learnable_sink (Hq,), one
    logit per query head added to every row's softmax denominator (gpt-oss's sinks), its
    gradient through autograd."""
    _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap)
    scale, softcap = None if scale is None else float(scale), float(softcap)
    if _impl._is_tensor(query):
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        sinks = _impl._learnable_sink(learnable_sink, q)
        if isinstance(attn_mask, np.ndarray):
            attn_mask = torch.from_numpy(attn_mask)
        rng_state = _impl._torch_rng_state(dropout_p, None)
        args = (q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale, rng_state, 0, softcap, sinks)
        direct = _impl._torch_ops.direct(q, k, v, attn_mask, sinks)
        out, _ = (_sdpa_fwd if direct else torch.ops.flashattn.sdpa_fwd)(*args)
        return out.transpose(1, 2)
    q, k, v = (np.swapaxes(x, 1, 2) for x in (query, key, value))
    o = _impl._options(dropout_p, scale, is_causal, (-1, -1), softcap, None, False,
                       _impl._numpy_seed(dropout_p, None), sinks=_impl._learnable_sink(learnable_sink, q),
                       attn_mask=attn_mask, causal_alignment="top_left")
    o.num_threads = _impl._resolve_threads(None, False)
    out, _, _ = _impl._forward(q, k, v, o, False)
    return np.swapaxes(out, 1, 2)


def _sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool,
              scale: Optional[float], rng_state: Optional[Tensor], num_threads: int, softcap: float = 0.0,
              sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, Dv) and softmax_lse (B, Hq, Sq) float32 of (B, S, H, D) views (sinks:
    float32 (Hq))."""
    o = _opts(attn_mask, dropout_p, is_causal, scale, rng_state, num_threads, softcap, sinks)
    out, lse, _ = _impl._forward(q, k, v, o, False)
    return out, lse


def _sdpa_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
              attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool, scale: Optional[float],
              rng_state: Optional[Tensor], num_threads: int, attn_mask_grad: bool, softcap: float = 0.0,
              sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (B, S, H, D), contiguous, of sum(dout * out); with attn_mask_grad the float
    attn_mask's gradient in its shape and dtype (else an empty (0,) tensor); dsinks as the
    backward ops' (float32 (Hq) with sinks, else (0,))."""
    o = _opts(attn_mask, dropout_p, is_causal, scale, rng_state, num_threads, softcap, sinks)
    dsinks = _impl._torch_ops._dsinks(o, q, sinks)
    if not attn_mask_grad:
        return (*_impl._backward(dout, q, k, v, out, softmax_lse, o), q.new_empty((0,)), dsinks)
    dbias = torch.zeros((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape), dtype=torch.float32)
    o.dbias = dbias.numpy()
    dq, dk, dv = _impl._backward(dout, q, k, v, out, softmax_lse, o)
    return dq, dk, dv, dbias.reshape(attn_mask.shape).to(attn_mask.dtype), dsinks


# The ops' tensor parameters by their names in SDPA's and FlexAttention's signatures, for errors.
SDPA_NAMES = {"q": "query", "k": "key", "v": "value"}

if torch is not None:
    sdpa_fwd = torch.library.custom_op("flashattn::sdpa_fwd", _sdpa_fwd, mutates_args=())
    sdpa_bwd = torch.library.custom_op("flashattn::sdpa_bwd", _sdpa_bwd, mutates_args=())

    @_impl._torch_ops.register_fake(sdpa_fwd, _sdpa_fwd, SDPA_NAMES)
    def fake_out_lse(q, k, v, *args):
        """out (B, Sq, Hq, Dv) and float32 lse (B, Hq, Sq) of (B, S, H, D) q, v: the forward ops' fake."""
        b, sq, hq, _ = q.shape
        return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)

    @_impl._torch_ops.register_fake(sdpa_bwd, _sdpa_bwd, SDPA_NAMES)
    def _(dout, q, k, v, out, softmax_lse, attn_mask, dropout_p, is_causal, scale, rng_state, num_threads,
          attn_mask_grad, softcap=0.0, sinks=None):
        dmask = attn_mask.new_empty(attn_mask.shape) if attn_mask_grad else q.new_empty((0,))
        dsinks = q.new_empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask, dsinks

    def _setup(ctx, inputs, output):
        q, k, v, attn_mask, dropout_p, is_causal, scale, rng_state, num_threads, softcap, sinks = inputs
        out, lse = output
        ctx.options = (dropout_p, is_causal, scale, num_threads, softcap)
        ctx.present = tuple(t is not None for t in (attn_mask, rng_state, sinks))
        ctx.save_for_backward(q, k, v, out, lse, *(t for t in (attn_mask, rng_state, sinks) if t is not None))
        ctx.mark_non_differentiable(lse)

    def _backward(ctx, dout, _dlse):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask, rng, sinks = (rest.pop(0) if present else None for present in ctx.present)
        dropout_p, is_causal, scale, num_threads, softcap = ctx.options
        mask_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dmask, dsinks = torch.ops.flashattn.sdpa_bwd(dout.to(q.dtype), q, k, v, out, lse, mask, dropout_p,
                                                                 is_causal, scale, rng, num_threads, mask_grad,
                                                                 softcap, sinks)
        return (dq, dk, dv, dmask if mask_grad else None, None, None, None, None, None, None,
                dsinks if sinks is not None else None)

    torch.library.register_autograd("flashattn::sdpa_fwd", _backward, setup_context=_setup)
