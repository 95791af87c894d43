"""The torch.library custom ops (namespace "flashattn") behind the torch path.

Each op has a CPU implementation over the native core, a fake kernel (output shapes and
dtypes only: meta tensors, FakeTensor tracing in torch.compile and torch.export) and, for
the two forward ops, an autograd formula that calls the matching backward op, so that a
compiled graph holds the ops themselves instead of breaking around Python code.

Arguments are primitives the schema can hold: the attention options travel one by one,
and the dropout seed and offset as an int64 tensor `rng_state` of shape (2,) (None
without dropout), so that a traced graph draws them at run time from torch's generator.

Plain eager inference (see direct()) calls the implementations _fwd, _varlen_fwd,
_varlen_paged_fwd and _fwd_kvcache without the dispatcher: its Python custom-op path costs
40 to 80 µs a call, as much as a whole decode step on a short cache; the results are the same.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from . import _interface as _impl

_MASK64 = (1 << 64) - 1


def _opts(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
          rng_state, kernel, backward_kernel, num_threads, num_splits=0, block_mask=None, block_mask_block_size=0,
          sinks=None, pack_gqa=None):
    o = _impl._options(dropout_p, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
                       deterministic, None, kernel, backward_kernel, num_splits, block_mask, block_mask_block_size,
                       sinks, pack_gqa=pack_gqa)
    if rng_state is not None:
        seed, offset = (int(x) & _MASK64 for x in rng_state.tolist())
        o.seed, o.offset = seed, offset
    o.num_threads = _impl._resolve_threads(num_threads, True)
    return o


def register_fake(op, impl, names=None):
    """Decorator: `op`'s fake kernel, which first refuses tensors on different devices, naming
    the argument (impl's parameter, or its public name in `names`). The dispatcher sends a
    call that mixes a meta tensor with CPU ones to the fake kernel — whose outputs are empty
    tensors on q's device — never to the CPU kernel, whose checks would name it. A call whose
    first tensor (q) is not on the CPU passes: meta tensors give the outputs' shapes, as
    torch's own ops do (with the small CPU tensors the wrappers make, such as cache_seqlens
    from an int)."""
    signature, names = inspect.signature(impl), names or {}

    def decorate(fake):
        def checked(*args, **kwargs):
            first = None
            for parameter, value in signature.bind(*args, **kwargs).arguments.items():
                name = names.get(parameter, parameter)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if not isinstance(t, torch.Tensor):
                        continue
                    if first is None:
                        first = (name, t.device)
                    elif first[1].type == "cpu" and t.device.type != "cpu":
                        raise ValueError(f"{name}: device {t.device}, but {first[0]} is on {first[1]} (only CPU "
                                         f"tensors are supported)")
            return fake(*args, **kwargs)

        op.register_fake(checked)
        return fake

    return decorate


# ---- forward and backward ---------------------------------------------------------------------


def _fwd(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: Optional[float], causal: bool,
         window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
         rng_state: Optional[Tensor], kernel: str, backward_kernel: str, num_threads: int, num_splits: int = 0,
         block_mask: Optional[Tensor] = None, block_mask_block_size: int = 0,
         sinks: Optional[Tensor] = None, pack_gqa: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, Dv) and softmax_lse (B, Hq, Sq) float32 (including the float32 (Hq) sinks)."""
    o = _opts(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
              rng_state, kernel, backward_kernel, num_threads, num_splits, block_mask, block_mask_block_size, sinks,
              pack_gqa)
    out, lse, _ = _impl._forward(q, k, v, o, False)
    return out, lse


fwd = torch.library.custom_op("flashattn::fwd", _fwd, mutates_args=())


@register_fake(fwd, _fwd)
def _(q, k, v, *args):
    _check_rank("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dropout_p: float,
         softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
         alibi_slopes: Optional[Tensor], deterministic: bool, rng_state: Optional[Tensor], backward_kernel: str,
         num_threads: int, block_mask: Optional[Tensor] = None, block_mask_block_size: int = 0,
         sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv of sum(dout * out) and dsinks (float32 (Hq) with sinks, else (0,)); P is
    recomputed from softmax_lse."""
    o = _opts(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
              rng_state, "auto", backward_kernel, num_threads, block_mask=block_mask,
              block_mask_block_size=block_mask_block_size, sinks=sinks)
    dsinks = _dsinks(o, q, sinks)
    return (*_impl._backward(dout, q, k, v, out, softmax_lse, o), dsinks)


def _dsinks(o, q, sinks):
    """The sinks' gradient, float32 like them, set as the options' output: (Hq), or (0,) without sinks."""
    dsinks = q.new_zeros((0 if sinks is None else sinks.shape[0],), dtype=torch.float32)
    if sinks is not None:
        o.dsinks = dsinks.numpy()
    return dsinks


bwd = torch.library.custom_op("flashattn::bwd", _bwd, mutates_args=())


def _fake_grads(op_impl):
    """The fake kernel of a backward op: dq, dk, dv of q, k, v's shapes, contiguous as the
    native backward writes them (whatever q, k, v's strides: inductor checks the real ones
    against these), and dsinks as _dsinks makes it (the call's arguments bound to the op's
    signature, defaults included, to find its sinks)."""
    signature = inspect.signature(op_impl)

    def fake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        q, k, v, sinks = (bound.arguments[n] for n in ("q", "k", "v", "sinks"))
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                q.new_empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32))

    return fake


register_fake(bwd, _bwd)(_fake_grads(_bwd))


# ---- variable-length batches ------------------------------------------------------------------


def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float], causal: bool, window_left: int,
                window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
                rng_state: Optional[Tensor], kernel: str, backward_kernel: str, num_threads: int,
                num_splits: int = 0, block_mask: Optional[Tensor] = None, block_mask_block_size: int = 0,
                sinks: Optional[Tensor] = None, pack_gqa: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """out (total_q, Hq, Dv) and softmax_lse (Hq, total_q) float32 (the native library refuses
    a block_mask with variable-length batches)."""
    o = _opts(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
              rng_state, kernel, backward_kernel, num_threads, num_splits, block_mask, block_mask_block_size, sinks,
              pack_gqa)
    out, lse, _ = _impl._varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, o, False)
    return out, lse


varlen_fwd = torch.library.custom_op("flashattn::varlen_fwd", _varlen_fwd, mutates_args=())


@register_fake(varlen_fwd, _varlen_fwd)
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    _check_rank("q", q, 3, "(total_q, heads_q, head_dim)")
    total_q, hq, _ = q.shape
    return q.new_empty((total_q, hq, v.shape[-1])), q.new_empty((hq, total_q), dtype=torch.float32)


def _varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                alibi_slopes: Optional[Tensor], deterministic: bool, rng_state: Optional[Tensor],
                backward_kernel: str, num_threads: int, block_mask: Optional[Tensor] = None,
                block_mask_block_size: int = 0,
                sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and dsinks (as bwd's) of a packed variable-length batch."""
    o = _opts(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
              rng_state, "auto", backward_kernel, num_threads, block_mask=block_mask,
              block_mask_block_size=block_mask_block_size, sinks=sinks)
    dsinks = _dsinks(o, q, sinks)
    return (*_impl._varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, o), dsinks)


varlen_bwd = torch.library.custom_op("flashattn::varlen_bwd", _varlen_bwd, mutates_args=())


register_fake(varlen_bwd, _varlen_bwd)(_fake_grads(_varlen_bwd))


# ---- paged variable-length batches ------------------------------------------------------------


def _varlen_paged_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int,
                      block_table: Tensor, seqused_k: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                      softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                      softcap: float, alibi_slopes: Optional[Tensor], kernel: str, num_threads: int,
                      num_splits: int, sinks: Optional[Tensor] = None, prefix_block_table: Optional[Tensor] = None,
                      prefix_seqused_k: Optional[Tensor] = None, prefix_idx: Optional[Tensor] = None,
                      k_zero_point: Optional[Tensor] = None, v_zero_point: Optional[Tensor] = None, k_quant: str = "",
                      v_quant: str = "", pack_gqa: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """out (total_q, Hq, Dv) and softmax_lse (Hq, total_q) float32 of a paged batch, with shared
    prefixes or not; the pools are only read. Forward only (inference, no gradient for sinks either).
    k_quant, v_quant: a quantized pool's format, "codes/granularity" (_interface._quant_name)."""
    o = _opts(0.0, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, False, None, kernel,
              "auto", num_threads, num_splits, sinks=sinks, pack_gqa=pack_gqa)
    return _impl._paged_varlen_forward(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, block_table, seqused_k,
                                       k_scale, v_scale, o, (prefix_block_table, prefix_seqused_k, prefix_idx),
                                       k_zero_point, v_zero_point, k_quant, v_quant)


varlen_paged_fwd = torch.library.custom_op("flashattn::varlen_paged_fwd", _varlen_paged_fwd, mutates_args=())


@register_fake(varlen_paged_fwd, _varlen_paged_fwd)
def _(q, k_cache, v_cache, *args):
    _check_rank("q", q, 3, "(total_q, heads_q, head_dim)")
    total_q, hq, _ = q.shape
    return q.new_empty((total_q, hq, v_cache.shape[-1])), q.new_empty((hq, total_q), dtype=torch.float32)


def direct(*tensors):
    """Whether a call may skip the dispatcher: eager (no torch.compile or export tracing, no
    torch-function or dispatch mode, no functorch transform, which must all see the op),
    no autograd graph to record, and plain CPU tensors (no subclass: fake, functional)."""
    if (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # is_cpu, not device.type: a torch.device made per call costs 0.5 µs a tensor
        if t is not None and (type(t) is not torch.Tensor or not t.is_cpu or (grad and t.requires_grad)):
            return False
    return True


def fwd_kvcache_direct(q, k_cache, v_cache, *args):
    """_fwd_kvcache outside the dispatcher; bumps the version counters of what it writes,
    as the op does, so that autograd still notices a cache saved for a backward."""
    result = _fwd_kvcache(q, k_cache, v_cache, *args)
    written = (k_cache, v_cache, args[16], args[17], *args[24:26])  # the scales, the zero points
    torch.autograd.graph.increment_version([t for t in written if t is not None])
    return result


def _check_rank(name, x, rank, layout):
    if x.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got rank {x.dim()}")


# ---- autograd ---------------------------------------------------------------------------------

# The options after q, k, v (fwd) or after q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
# max_seqlen_k (varlen_fwd), in the order of the schema.
_FWD_OPTIONS = ("dropout_p", "softmax_scale", "causal", "window_left", "window_right", "softcap", "alibi_slopes",
                "deterministic", "rng_state", "kernel", "backward_kernel", "num_threads", "num_splits", "block_mask",
                "block_mask_block_size", "sinks", "pack_gqa")
_NOT_FOR_BACKWARD = ("kernel", "alibi_slopes", "rng_state", "num_splits", "block_mask", "sinks", "pack_gqa")


def _setup(ctx, inputs, output, varlen):
    q, k, v = inputs[:3]
    rest = inputs[7:] if varlen else inputs[3:]
    named = dict(zip(_FWD_OPTIONS, rest))
    out, lse = output
    ctx.varlen = tuple(inputs[5:7]) if varlen else None
    ctx.options = {n: named[n] for n in _FWD_OPTIONS if n not in _NOT_FOR_BACKWARD}
    extra = [inputs[3], inputs[4]] if varlen else []
    ctx.has_alibi, ctx.has_rng = named["alibi_slopes"] is not None, named["rng_state"] is not None
    ctx.has_mask = named["block_mask"] is not None
    ctx.has_sinks = named["sinks"] is not None
    saved = [q, k, v, out, lse, *extra]
    for present, name in ((ctx.has_alibi, "alibi_slopes"), (ctx.has_rng, "rng_state"), (ctx.has_mask, "block_mask"),
                          (ctx.has_sinks, "sinks")):
        if present:
            saved.append(named[name])
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, varlen):
    saved = list(ctx.saved_tensors)
    q, k, v, out, lse = saved[:5]
    rest = saved[5:]
    cu = rest[:2] if varlen else []
    rest = rest[2:] if varlen else rest
    alibi = rest.pop(0) if ctx.has_alibi else None
    rng = rest.pop(0) if ctx.has_rng else None
    mask = rest.pop(0) if ctx.has_mask else None
    sinks = rest.pop(0) if ctx.has_sinks else None
    o = ctx.options
    common = (o["dropout_p"], o["softmax_scale"], o["causal"], o["window_left"], o["window_right"], o["softcap"],
              alibi, o["deterministic"], rng, o["backward_kernel"], o["num_threads"], mask,
              o["block_mask_block_size"], sinks)
    dout = dout.to(q.dtype)
    if varlen:
        return torch.ops.flashattn.varlen_bwd(dout, q, k, v, out, lse, *cu, *ctx.varlen, *common)
    return torch.ops.flashattn.bwd(dout, q, k, v, out, lse, *common)


def _fwd_setup(ctx, inputs, output):
    _setup(ctx, inputs, output, varlen=False)


def _option_grads(ctx, dsinks):
    """The gradients of the options, in _FWD_OPTIONS order: None but the sinks'."""
    return tuple(dsinks if name == "sinks" and ctx.has_sinks else None for name in _FWD_OPTIONS)


def _fwd_backward(ctx, dout, _dlse):
    dq, dk, dv, dsinks = _grads(ctx, dout, varlen=False)
    return (dq, dk, dv) + _option_grads(ctx, dsinks)


def _varlen_setup(ctx, inputs, output):
    _setup(ctx, inputs, output, varlen=True)


def _varlen_backward(ctx, dout, _dlse):
    dq, dk, dv, dsinks = _grads(ctx, dout, varlen=True)
    return (dq, dk, dv) + (None,) * 4 + _option_grads(ctx, dsinks)


torch.library.register_autograd("flashattn::fwd", _fwd_backward, setup_context=_fwd_setup)
torch.library.register_autograd("flashattn::varlen_fwd", _varlen_backward, setup_context=_varlen_setup)


# ---- the KV cache ---------------------------------------------------------------------------


def _fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                 rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                 cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                 softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                 rotary_interleaved: bool, alibi_slopes: Optional[Tensor], num_splits: int, k_scale: Optional[Tensor],
                 v_scale: Optional[Tensor], kernel: str, num_threads: int, sinks: Optional[Tensor] = None,
                 cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k_new: Optional[Tensor] = None,
                 max_seqlen_q: int = 0, k_zero_point: Optional[Tensor] = None, v_zero_point: Optional[Tensor] = None,
                 k_quant: str = "", v_quant: str = "", pack_gqa: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, Dv) and softmax_lse (B, Hq, Sq) — (total_q, Hq, Dv) and (Hq, total_q)
    with cu_seqlens_q (a packed batch); new k, v are written into the cache (and an FP8
    cache's descales grown, an int8 cache's per-token scales and zero points set) in place.
    k_quant, v_quant: a quantized pool's format, "codes/granularity" (_interface._quant_name)."""
    o = _opts(0.0, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, False, None, kernel,
              "auto", num_threads, sinks=sinks, pack_gqa=pack_gqa)
    o.num_splits = int(num_splits)
    return _impl._kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                  cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, k_scale, v_scale,
                                  o, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, k_zero_point, v_zero_point, k_quant,
                                  v_quant)


fwd_kvcache = torch.library.custom_op("flashattn::fwd_kvcache", _fwd_kvcache,
                                      mutates_args=("k_cache", "v_cache", "k_scale", "v_scale", "k_zero_point",
                                                    "v_zero_point"))


@register_fake(fwd_kvcache, _fwd_kvcache)
def _(*args, **kwargs):
    bound = inspect.signature(_fwd_kvcache).bind(*args, **kwargs)
    q, v_cache = bound.arguments["q"], bound.arguments["v_cache"]
    if bound.arguments.get("cu_seqlens_q") is not None:  # a packed batch
        _check_rank("q", q, 3, "(total_q, heads_q, head_dim)")
        total_q, hq, _ = q.shape
        return q.new_empty((total_q, hq, v_cache.shape[-1])), q.new_empty((hq, total_q), dtype=torch.float32)
    _check_rank("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_cache.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


# ---- FP8 forward and the combination of partial results ------------------------------------------


def _fwd_fp8(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor], k_descale: Optional[Tensor],
             v_descale: Optional[Tensor], dropout_p: float, softmax_scale: Optional[float], causal: bool,
             window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
             rng_state: Optional[Tensor], kernel: str, num_threads: int, num_splits: int,
             block_mask: Optional[Tensor], block_mask_block_size: int,
             sinks: Optional[Tensor] = None, pack_gqa: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """FP8 q, k, v (float8_e4m3fn or float8_e5m2) with FA3's (B, Hkv) descales: out (B, Sq, Hq, Dv)
    bfloat16 and softmax_lse (B, Hq, Sq) float32. Forward only (no gradient for sinks either)."""
    o = _opts(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, False, rng_state,
              kernel, "auto", num_threads, num_splits, block_mask, block_mask_block_size, sinks, pack_gqa)
    return _impl._fp8_forward(q, k, v, (q_descale, k_descale, v_descale), o)


fwd_fp8 = torch.library.custom_op("flashattn::fwd_fp8", _fwd_fp8, mutates_args=())


@register_fake(fwd_fp8, _fwd_fp8)
def _(q, k, v, *args):
    _check_rank("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    b, sq, hq, _ = q.shape
    return (q.new_empty((b, sq, hq, v.shape[-1]), dtype=torch.bfloat16),
            q.new_empty((b, hq, sq), dtype=torch.float32))


def _combine(out_partial: Tensor, lse_partial: Tensor, out_dtype: str, num_threads: int) -> tuple[Tensor, Tensor]:
    """flash_attn_combine: out (B, Sq, H, Dv) of out_dtype ("f32", "f16", "bf16") and softmax_lse
    (B, H, Sq) float32 from out_partial (splits, B, Sq, H, Dv) and lse_partial (splits, B, Sq, H)."""
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[out_dtype]
    return _impl._combine(out_partial, lse_partial, None, dtype, _impl._resolve_threads(num_threads, True))


combine = torch.library.custom_op("flashattn::combine", _combine, mutates_args=())


@register_fake(combine, _combine)
def _(out_partial, lse_partial, out_dtype, num_threads):
    _check_rank("out_partial", out_partial, 5, "(num_splits, batch, seqlen, heads, head_dim)")
    _, b, sq, h, dv = out_partial.shape
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[out_dtype]
    return out_partial.new_empty((b, sq, h, dv), dtype=dtype), out_partial.new_empty((b, h, sq))
