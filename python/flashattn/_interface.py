"""Upstream FlashAttention's functions on top of the native core (flashattn._C)."""

from __future__ import annotations

import operator
import threading

import ml_dtypes
import numpy as np

from . import _C

try:  # PyTorch is optional: tensors in, tensors out, autograd when it is importable.
    import torch
    from torch.utils.dlpack import to_dlpack
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None

_NUMPY_DTYPES = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(ml_dtypes.bfloat16): "bf16",
}
_NUMPY_OF = {name: dtype for dtype, name in _NUMPY_DTYPES.items()}


_TORCH_DTYPES = {} if torch is None else {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_TORCH_OF = {name: dtype for dtype, name in _TORCH_DTYPES.items()}


_TENSOR = () if torch is None else torch.Tensor  # isinstance(x, ()) is False


def _is_tensor(x) -> bool:
    return isinstance(x, _TENSOR)


def _raw(x, name, int32=False, tensor=False):
    """A zero-copy NumPy view of `x` for the native core, and its dtype name; with `tensor`,
    a torch tensor stays a (detached) tensor, for _native to hand over.

    float16 and bfloat16 travel as uint16 views (NumPy has no bfloat16 of its own). Like
    upstream, an array whose last dimension is not contiguous is copied first."""
    if _is_tensor(x):
        if not x.is_cpu:  # not device.type: a torch.device made per call costs 0.5 µs
            raise ValueError(f"{name}: only CPU tensors are supported, got device {x.device}")
        t = x.detach() if x.requires_grad else x  # a new tensor object costs about 0.5 µs
        try:
            if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:  # as upstream's maybe_contiguous
                t = t.contiguous()
        except RuntimeError:  # no strides: a sparse or mkldnn tensor (checked here, not per call)
            raise TypeError(f"{name}: layout {x.layout} is not supported (dense, strided tensors only)") from None
        if int32:
            if t.dtype != torch.int32:
                raise TypeError(f"{name}: dtype {t.dtype} but expected torch.int32")
            return t if tensor else t.numpy(), "i32"
        dt = _TORCH_DTYPES.get(t.dtype)
        if dt is None:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported (float32, float16, bfloat16)")
        if tensor:
            return t, dt
        return (t.numpy() if dt == "f32" else t.view(torch.int16).numpy().view(np.uint16)), dt
    if isinstance(x, np.ndarray):
        if x.ndim > 0 and x.strides[-1] != x.itemsize and x.shape[-1] > 1:  # upstream's maybe_contiguous
            x = np.ascontiguousarray(x)
        if int32:
            if x.dtype != np.int32:
                raise TypeError(f"{name}: dtype {x.dtype} but expected int32")
            return x, "i32"
        dt = _NUMPY_DTYPES.get(x.dtype)
        if dt is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported (float32, float16, bfloat16)")
        return (x if dt == "f32" else x.view(np.uint16)), dt
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")


def _empty(shape, dt, like, tensor=False):
    """An output of the same kind as `like` (NumPy or torch) and its raw view (with `tensor`,
    a torch output is its own, for _native)."""
    if _is_tensor(like):
        t = torch.empty(shape, dtype=_TORCH_OF[dt])
        if tensor:
            return t, t
        return t, (t.numpy() if dt == "f32" else t.view(torch.int16).numpy().view(np.uint16))
    a = np.empty(shape, dtype=_NUMPY_OF[dt])
    return a, (a if dt == "f32" else a.view(np.uint16))


def _inputs(tensors=False, **named):
    """Raw views of the named arrays, all of one kind (NumPy or torch), and each one's dtype
    name by its argument name: whether the dtypes agree is the native library's check. With
    `tensors`, torch tensors stay tensors (_raw)."""
    kinds = {_is_tensor(x) for x in named.values()}
    if len(kinds) > 1:
        raise TypeError("inputs mix numpy arrays and torch tensors: " + ", ".join(named))
    raws, dtypes = {}, {}
    for name, x in named.items():
        raws[name], dtypes[name] = _raw(x, name, tensor=tensors)
    return raws, dtypes


def _shape(x, layout, name="q"):
    """x's shape, of the rank of `layout` (its dims' names), or ValueError naming x."""
    if len(x.shape) != len(layout):
        raise ValueError(f"{name}: expected rank {len(layout)} ({', '.join(layout)}), got shape {tuple(x.shape)}")
    return tuple(x.shape)


def _native(*raws):
    """Raw views for the native core, each torch tensor among them (from _raw or _empty with
    `tensor`) as a DLPack capsule made by torch's C function: the binding reads it as it reads
    a NumPy view, which costs about 3 µs a tensor more to make (a tensor itself would make the
    binding call its Python-level __dlpack__)."""
    return tuple(to_dlpack(x) if isinstance(x, _TENSOR) else x for x in raws)


def _check_block_mask(block_mask, block_mask_block_size):
    """The kind, dtype and device of a block mask (shape and block size: the native library's checks)."""
    if block_mask is None:
        if block_mask_block_size:
            raise ValueError(f"block_mask_block_size: {block_mask_block_size!r} given without a block_mask")
    elif _is_tensor(block_mask):
        if block_mask.device.type != "cpu":
            raise ValueError(f"block_mask: only CPU tensors are supported, got device {block_mask.device}")
        if block_mask.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"block_mask: dtype {block_mask.dtype} but expected torch.bool or torch.uint8")
    elif isinstance(block_mask, np.ndarray):
        if block_mask.dtype not in (np.dtype(np.bool_), np.dtype(np.uint8)):
            raise TypeError(f"block_mask: dtype {block_mask.dtype} but expected bool or uint8")
    else:
        raise TypeError(f"block_mask: expected a numpy.ndarray or a torch.Tensor, got {type(block_mask).__name__}")


def _block_mask_raw(block_mask, block_mask_block_size):
    """A zero-copy uint8 view of a block mask (bool or uint8, (q blocks, k blocks)), or None."""
    _check_block_mask(block_mask, block_mask_block_size)
    if block_mask is None:
        return None
    if _is_tensor(block_mask):
        m = block_mask.detach()
        if m.dim() > 0 and m.stride(-1) != 1 and m.shape[-1] > 1:
            m = m.contiguous()
        return m.view(torch.uint8).numpy()
    m = block_mask
    if m.ndim > 0 and m.strides[-1] != m.itemsize and m.shape[-1] > 1:
        m = np.ascontiguousarray(m)
    return m.view(np.uint8)


def _attn_mask_raw(attn_mask):
    """A zero-copy view of a dense attn_mask for the native core and its dtype name: bool
    (or uint8) masks as uint8 ("u8", non-zero keeps), float32/float16/bfloat16 biases as
    _raw's; rank < 4 padded with leading size-1 dims (SDPA's broadcasting from the right)."""
    if _is_tensor(attn_mask):
        if attn_mask.layout != torch.strided:
            raise TypeError(f"attn_mask: layout {attn_mask.layout} is not supported (dense, strided tensors only)")
        if attn_mask.device.type != "cpu":
            raise ValueError(f"attn_mask: only CPU tensors are supported, got device {attn_mask.device}")
        m = attn_mask.detach()
        if m.dim() > 4:
            raise ValueError(f"attn_mask: rank {m.dim()} does not broadcast to (batch, heads, seqlen_q, seqlen_k)")
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() < 4 else m
        if m.dtype in (torch.bool, torch.uint8):
            if m.stride(-1) != 1 and m.shape[-1] > 1:
                m = m.contiguous()
            return m.view(torch.uint8).numpy(), "u8"
        return _raw(m, "attn_mask")
    if isinstance(attn_mask, np.ndarray):
        if attn_mask.ndim > 4:
            raise ValueError(f"attn_mask: rank {attn_mask.ndim} does not broadcast to (batch, heads, seqlen_q, seqlen_k)")
        m = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)
        if m.dtype in (np.dtype(np.bool_), np.dtype(np.uint8)):
            if m.strides[-1] != 1 and m.shape[-1] > 1:
                m = np.ascontiguousarray(m)
            return m.view(np.uint8), "u8"
        return _raw(m, "attn_mask")
    raise TypeError(f"attn_mask: expected a numpy.ndarray or a torch.Tensor, got {type(attn_mask).__name__}")


def _int_arg(name, value, minimum, maximum=2**31 - 1):
    """An integer option of the native library, by default a C int (2**31 overflowed it into
    nanobind's error, which names no argument)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not minimum <= value <= maximum:
        raise ValueError(f"{name}: expected an integer in [{minimum}, {maximum}], got {value!r}")
    return int(value)


def _seqlen_arg(name, value):
    """A max_seqlen argument or a window bound as an int (int() of it, as the native call takes
    it; an integral float too), named where it is not an integer (a bool, 1.5: never truncated)."""
    if isinstance(value, bool) or (isinstance(value, (float, np.floating)) and not float(value).is_integer()):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected an integer, got {value!r}") from None


def _cache_seqlens_int(x):
    """One cache_seqlens given as an integer (int, a NumPy integer; a traced int under
    torch.compile passes as it is, for the op to check): checked against int32's range."""
    if torch is not None and isinstance(x, torch.SymInt):
        return x
    if isinstance(x, bool):
        raise TypeError(f"cache_seqlens: expected integers, got {x!r}")
    try:
        value = operator.index(x)  # not floats
    except TypeError:
        raise TypeError(f"cache_seqlens: expected integers, got {x!r}") from None
    if not -(1 << 31) <= value < (1 << 31):
        raise ValueError(f"cache_seqlens: {value} is out of the int32 range")
    return value


def _cache_seqlens_table(cache_seqlens, batch, tensors):
    """cache_seqlens as the call's int32 table: an integer for every sequence or a list of
    them made one (a torch tensor or a NumPy array as `tensors` says); arrays and tensors as
    they are (checked natively)."""
    if _is_tensor(cache_seqlens) and cache_seqlens.dim() == 0 and torch.compiler.is_compiling():
        if cache_seqlens.dtype != torch.int32:  # no data read in a graph: int32 as the tables are
            raise TypeError(f"cache_seqlens: dtype {cache_seqlens.dtype} but expected torch.int32")
        return cache_seqlens.reshape(1).expand(batch)
    if cache_seqlens is None or (isinstance(cache_seqlens, (np.ndarray, _TENSOR)) and cache_seqlens.ndim > 0):
        return cache_seqlens
    if isinstance(cache_seqlens, (list, tuple)):
        values = [_cache_seqlens_int(x) for x in cache_seqlens]
        return torch.tensor(values, dtype=torch.int32) if tensors else np.asarray(values, dtype=np.int32)
    value = _cache_seqlens_int(cache_seqlens)
    return torch.full((batch,), value, dtype=torch.int32) if tensors else np.full((batch,), value, dtype=np.int32)


def _scale_arg(softmax_scale):
    """softmax_scale as a float, or None (1 / sqrt(head_dim)); named where it is not a number."""
    if softmax_scale is None:
        return None
    try:
        return float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale: expected a number or None, got {softmax_scale!r}") from None


def _window_arg(window_size):
    """window_size as (left, right) ints (-1: unbounded), named where it is not a pair of
    integers the native library can hold (int64)."""
    try:
        left, right = window_size
        pair = (_seqlen_arg("window_size", left), _seqlen_arg("window_size", right))  # (1.7, 0): not truncated
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected (left, right) integers, got {window_size!r}") from None
    if any(not -(1 << 63) <= x < (1 << 63) for x in pair):
        raise ValueError(f"window_size: {pair} is out of the int64 range")
    return pair


def _pack_gqa_arg(pack_gqa):
    """FA3's pack_gqa: None (the planner's choice), True or False (AttentionOptions::pack_gqa)."""
    if pack_gqa is None or isinstance(pack_gqa, (bool, np.bool_)):
        return None if pack_gqa is None else bool(pack_gqa)
    raise TypeError(f"pack_gqa: expected None, True or False, got {pack_gqa!r}")


def _sink_alias(learnable_sink, sinks):
    """`sinks=` (gpt-oss's name, and the native library's AttentionOptions::sinks) is another
    name for upstream FA4's `learnable_sink=`: the same tensor, autograd included."""
    if sinks is None:
        return learnable_sink
    if learnable_sink is not None:
        raise TypeError("learnable_sink, sinks: one argument under two names (sinks is an alias of learnable_sink); "
                        "pass one of them")
    return sinks


def _learnable_sink(learnable_sink, q):
    """Upstream FA4's learnable_sink: one sink logit per q head, shape (heads_q,), float32,
    float16 or bfloat16 (widened exactly to the float32 the native library takes; a tensor
    through autograd, so its gradient comes back in its own dtype). None stays None; whether
    the logits are finite is the native library's check."""
    if learnable_sink is None:
        return None
    if _is_tensor(q) != _is_tensor(learnable_sink):
        raise TypeError("inputs mix numpy arrays and torch tensors: q, learnable_sink")
    if _is_tensor(learnable_sink):
        if learnable_sink.device.type != "cpu":
            raise ValueError(f"learnable_sink: only CPU tensors are supported, got device {learnable_sink.device}")
        if learnable_sink.dtype not in _TORCH_DTYPES:
            raise TypeError(f"learnable_sink: dtype {learnable_sink.dtype} is not supported (float32, float16, "
                            "bfloat16)")
    elif not isinstance(learnable_sink, np.ndarray):
        raise TypeError(f"learnable_sink: expected a numpy.ndarray or a torch.Tensor, got "
                        f"{type(learnable_sink).__name__}")
    elif learnable_sink.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"learnable_sink: dtype {learnable_sink.dtype} is not supported (float32, float16, bfloat16)")
    heads_q = q.shape[-2] if len(q.shape) >= 3 else None  # a q of another rank: the native library's error
    if len(learnable_sink.shape) != 1 or heads_q is not None and learnable_sink.shape[0] != heads_q:
        raise ValueError(f"learnable_sink: expected shape (heads_q,) = ({heads_q},), got {tuple(learnable_sink.shape)}")
    if _is_tensor(learnable_sink):
        return learnable_sink.float()
    return learnable_sink.astype(np.float32, copy=False)


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, seed,
             kernel="auto", backward_kernel="auto", num_splits=0, block_mask=None, block_mask_block_size=0,
             sinks=None, *, attn_mask=None, causal_alignment="bottom_right", pack_gqa=None):
    o = _C.Options()
    o.pack_gqa = _pack_gqa_arg(pack_gqa)
    if attn_mask is not None:
        o.attn_mask, o.attn_mask_dtype = _attn_mask_raw(attn_mask)
    o.causal_alignment = causal_alignment
    o.num_splits = _int_arg("num_splits", num_splits, 0)
    o.block_mask = _block_mask_raw(block_mask, block_mask_block_size)
    o.block_mask_block_size = int(block_mask_block_size)
    o.kernel, o.backward_kernel = str(kernel), str(backward_kernel)
    o.softmax_scale = _scale_arg(softmax_scale)
    o.causal = bool(causal)
    window_size = _window_arg(window_size)
    o.window_left, o.window_right = int(window_size[0]), int(window_size[1])
    o.softcap = float(softcap)
    if alibi_slopes is not None:
        o.alibi_slopes, o.alibi_dtype = _raw(alibi_slopes, "alibi_slopes")
    if sinks is not None:  # float32 (heads_q): _learnable_sink's result
        o.sinks, o.sinks_dtype = _raw(sinks, "learnable_sink")
    o.dropout_p = float(dropout_p)
    o.seed = int(seed) & ((1 << 64) - 1) if seed is not None else 0  # any integer, modulo 2^64
    o.deterministic = bool(deterministic)
    return o


def _numpy_seed(dropout_p, seed):
    """NumPy calls: the explicit seed, else one drawn from numpy.random's global state (so
    numpy.random.seed reproduces a run)."""
    if dropout_p > 0.0 and seed is None:
        return int(np.random.randint(np.iinfo(np.int64).max, dtype=np.int64))
    return seed


def _torch_rng_state(dropout_p, seed):
    """Torch calls: the dropout (seed, offset) as an int64 tensor of shape (2,), drawn from
    torch's default CPU generator without an explicit seed (torch.manual_seed reproduces
    a run; torch.utils.checkpoint, which restores that generator, redraws the same mask);
    None without dropout, so that calls without it leave the generator alone."""
    if not dropout_p > 0.0:
        return None
    if seed is None:
        return torch.randint(-(1 << 63), (1 << 63) - 1, (2,), dtype=torch.int64)
    seed = int(seed) & ((1 << 64) - 1)
    return torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed, 0], dtype=torch.int64)


# ---- threads -------------------------------------------------------------------------------

_num_threads = 0  # flashattn.set_num_threads(); 0: unset


def _checked_threads(num_threads):
    """A num_threads argument as an int in [1, MAX_THREADS] (a team and a workspace per thread:
    more fails to create a team, which ends the process)."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)):
        raise TypeError(f"num_threads: expected a positive integer, got {num_threads!r}")
    if not 1 <= num_threads <= _C.MAX_THREADS:
        raise ValueError(f"num_threads: expected an integer in [1, {_C.MAX_THREADS}], got {num_threads!r}")
    return int(num_threads)


def set_num_threads(num_threads: int) -> None:
    """Worker threads of every later call that does not pass num_threads= (over torch's
    thread count for tensors and the OpenMP default for NumPy arrays)."""
    global _num_threads
    _num_threads = _checked_threads(num_threads)


def get_num_threads() -> int:
    """The threads a NumPy call uses now: set_num_threads()'s value, else the OpenMP default
    (OMP_NUM_THREADS, else all cores). Tensor calls use torch.get_num_threads() unless
    set_num_threads() was called."""
    return _num_threads or _C.thread_budget(0)


def last_num_threads() -> int:
    """The thread budget of the latest call into the native core (0 before the first): the
    worker threads its planner was given; a call with fewer work items starts fewer."""
    return _C.last_thread_budget()


def _resolve_threads(num_threads, torch_inputs):
    """The options' num_threads: the argument, else set_num_threads()'s value, else (tensors)
    torch.get_num_threads() — stated, not left to which OpenMP runtime the process loaded
    first — else 0, the OpenMP default."""
    if num_threads is not None and num_threads != 0:
        return _checked_threads(num_threads)
    if _num_threads:
        return _num_threads
    return torch.get_num_threads() if torch_inputs else 0


# ---- the computations, on raw views ------------------------------------------------------


def _forward(q, k, v, opts, return_attn_probs):
    raws, dts = _inputs(q=q, k=k, v=v, tensors=True)
    dt = dts["q"]
    if raws["q"].ndim != 4:
        raise ValueError(f"q: expected rank 4 (batch, seqlen_q, heads_q, head_dim), got rank {raws['q'].ndim}")
    b, sq, hq, _ = raws["q"].shape
    out, out_raw = _empty((b, sq, hq, raws["v"].shape[-1]), dt, q, tensor=True)
    lse, lse_raw = _empty((b, hq, sq), "f32", q, tensor=True)
    _C.forward(*_native(raws["q"], raws["k"], raws["v"], out_raw, lse_raw), {**dts, "out": dt}, opts)
    return out, lse, (_s_dmask(q, lambda o: _probs(q, k, v, o), opts) if return_attn_probs else None)


def _s_dmask(q, probs_of, opts):
    """upstream's S_dmask, a testing aid: empty (shape (0,)) without dropout; with it the
    softmax probabilities P in q's dtype, negated where dropout drops them (so kept entries
    are >= 0 and dropped ones < 0). probs_of(opts) gives the float32 probabilities after
    dropout from the float64 reference: the O(S^2) work is done only here."""
    dt = _dtype_of(q, "q")
    if not opts.dropout_p > 0.0:
        return _empty((0,), dt, q)[0]
    dropped = np.asarray(probs_of(opts))
    p = opts.dropout_p
    opts.dropout_p = 0.0
    try:
        probs = np.asarray(probs_of(opts))
    finally:
        opts.dropout_p = p
    signed = np.where((dropped == 0) & (probs > 0), -probs, probs).astype(_NUMPY_OF[dt])
    out, raw = _empty(signed.shape, dt, q)
    raw[...] = signed if dt == "f32" else signed.view(np.uint16)
    return out


def _probs(q, k, v, opts):
    raws, dts = _inputs(q=q, k=k, v=v)
    b, sq, hq, _ = raws["q"].shape
    probs, probs_raw = _empty((b, hq, sq, raws["k"].shape[1]), "f32", q)
    _C.attention_probs(raws["q"], raws["k"], raws["v"], probs_raw, dts, opts)
    return probs


def _backward_operands(dout, q, k, v, out, lse):
    """A backward's operands for the native core — dout, q, k, v, out, softmax_lse, then the new
    dq, dk, dv (_native hands the tensors over) — its dtype names, and dq, dk, dv."""
    raws, dts = _inputs(dout=dout, q=q, k=k, v=v, out=out, tensors=True)
    raws["softmax_lse"], dts["softmax_lse"] = _raw(lse, "softmax_lse", tensor=True)
    dt = dts["q"]
    grads = [_empty(raws[name].shape, dt, q, tensor=True) for name in ("q", "k", "v")]
    operands = _native(*(raws[name] for name in ("dout", "q", "k", "v", "out", "softmax_lse")),
                       *(raw for _, raw in grads))
    return operands, {**dts, "dq": dt, "dk": dt, "dv": dt}, tuple(g for g, _ in grads)


def _backward(dout, q, k, v, out, lse, opts):
    operands, dts, grads = _backward_operands(dout, q, k, v, out, lse)
    _C.backward(*operands, dts, opts)
    return grads


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, opts, return_attn_probs):
    raws, dts = _inputs(q=q, k=k, v=v, tensors=True)
    dt = dts["q"]
    if raws["q"].ndim != 3:
        raise ValueError(f"q: expected rank 3 (total_q, heads_q, head_dim), got rank {raws['q'].ndim}")
    total_q, hq, _ = raws["q"].shape
    out, out_raw = _empty((total_q, hq, raws["v"].shape[-1]), dt, q, tensor=True)
    lse, lse_raw = _empty((hq, total_q), "f32", q, tensor=True)
    cq = _raw(cu_q, "cu_seqlens_q", int32=True, tensor=True)[0]
    ck = _raw(cu_k, "cu_seqlens_k", int32=True, tensor=True)[0]
    _C.forward_varlen(*_native(raws["q"], raws["k"], raws["v"], cq, ck), int(max_q), int(max_k),
                      *_native(out_raw, lse_raw), {**dts, "out": dt}, opts)
    return out, lse, (_s_dmask(q, lambda o: _varlen_probs(q, k, v, cu_q, cu_k, max_q, max_k, o), opts)
                      if return_attn_probs else None)


def _varlen_probs(q, k, v, cu_q, cu_k, max_q, max_k, opts):
    raws, dts = _inputs(q=q, k=k, v=v)
    hq = raws["q"].shape[1]
    cq, ck = _raw(cu_q, "cu_seqlens_q", int32=True)[0], _raw(cu_k, "cu_seqlens_k", int32=True)[0]
    # As upstream: (batch, heads_q, max_seqlen_q, max_seqlen_k), zero beyond each sequence.
    batch = cq.shape[0] - 1
    probs, probs_raw = _empty((batch, hq, int(max_q), int(max_k)), "f32", q)
    probs_raw[...] = 0.0
    alibi = opts.alibi_slopes
    for b in range(batch):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if alibi is not None and alibi.ndim == 2:
            opts.alibi_slopes = alibi[b]
        # Sequence b draws its dropout as batch index b (the kernels' varlen rule).
        _C.attention_probs(raws["q"][None, q0:q1], raws["k"][None, k0:k1], raws["v"][None, k0:k1],
                           probs_raw[b:b + 1, :, :q1 - q0, :k1 - k0], dts, opts, b)
    opts.alibi_slopes = alibi
    return probs


def _varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, opts):
    operands, dts, grads = _backward_operands(dout, q, k, v, out, lse)
    cq = _raw(cu_q, "cu_seqlens_q", int32=True, tensor=True)[0]
    ck = _raw(cu_k, "cu_seqlens_k", int32=True, tensor=True)[0]
    _C.backward_varlen(*operands[:6], *_native(cq, ck), int(max_q), int(max_k), *operands[6:], dts, opts)
    return grads


# ---- dispatch: NumPy directly, torch through the custom ops (_torch_ops) ---------------------------


def _attention(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, seed, kernel, backward_kernel, num_threads, num_splits=0, block_mask=None,
               block_mask_block_size=0, descales=(None, None, None), learnable_sink=None, pack_gqa=None):
    if len({_is_tensor(x) for x in (q, k, v)}) > 1:
        raise TypeError("inputs mix numpy arrays and torch tensors: q, k, v")
    sinks = _learnable_sink(learnable_sink, q)
    window_size = _window_arg(window_size)
    if any(_is_fp8(x) for x in (q, k, v)):
        if varlen is not None:
            raise NotImplementedError("q: FP8 inputs are supported by flash_attn_func only, not the varlen functions")
        return _fp8_attention(q, k, v, descales, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, return_attn_probs, seed, kernel, num_threads, num_splits, block_mask,
                              block_mask_block_size, sinks, pack_gqa)
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        if d is not None:
            raise TypeError(f"{name}: descales belong to FP8 inputs (float8_e4m3fn or float8_e5m2), "
                            f"not q of dtype {_dtype_name(q)}")
    if _is_tensor(q):
        return _torch_attention(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, deterministic, return_attn_probs, seed, kernel, backward_kernel,
                                num_threads, num_splits, block_mask, block_mask_block_size, sinks, pack_gqa)
    seed = _numpy_seed(dropout_p, seed)
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, seed,
                    kernel, backward_kernel, num_splits, block_mask, block_mask_block_size, sinks,
                    pack_gqa=pack_gqa)
    opts.num_threads = _resolve_threads(num_threads, False)
    if varlen is None:
        out, lse, probs = _forward(q, k, v, opts, return_attn_probs)
    else:
        out, lse, probs = _varlen_forward(q, k, v, *varlen, opts, return_attn_probs)
    return (out, lse, probs) if return_attn_probs else out


def _torch_attention(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, return_attn_probs, seed, kernel, backward_kernel, num_threads, num_splits,
                     block_mask, block_mask_block_size, sinks=None, pack_gqa=None):
    _check_block_mask(block_mask, block_mask_block_size)  # its errors before the generator is drawn from
    pack_gqa = _pack_gqa_arg(pack_gqa)
    block_mask = _as_tensor(block_mask)
    rng_state = _torch_rng_state(dropout_p, seed)
    if alibi_slopes is not None and not _is_tensor(alibi_slopes):
        alibi_slopes = torch.as_tensor(alibi_slopes)
    if num_threads is not None and num_threads != 0:
        num_threads = _resolve_threads(num_threads, True)
    scalars = (float(dropout_p), _scale_arg(softmax_scale), bool(causal),
               int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes, bool(deterministic),
               rng_state, str(kernel), str(backward_kernel), int(num_threads or 0),
               _int_arg("num_splits", num_splits, 0), block_mask, int(block_mask_block_size), sinks, pack_gqa)
    ops = _torch_ops
    if varlen is None:
        fwd = ops._fwd if ops.direct(q, k, v, alibi_slopes, block_mask, sinks) else torch.ops.flashattn.fwd
        out, lse = fwd(q, k, v, *scalars)
    else:
        cu_q, cu_k, max_q, max_k = varlen
        cu_q, cu_k = _cu_seqlens_tensor(cu_q, "cu_seqlens_q"), _cu_seqlens_tensor(cu_k, "cu_seqlens_k")
        varlen = (cu_q, cu_k, max_q, max_k)
        direct = ops.direct(q, k, v, cu_q, cu_k, alibi_slopes, block_mask, sinks)
        fwd = ops._varlen_fwd if direct else torch.ops.flashattn.varlen_fwd
        out, lse = fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), *scalars)
    if not return_attn_probs:
        return out
    return out, lse, _torch_s_dmask(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, rng_state, block_mask, block_mask_block_size, sinks)


# The native options and dtype names of _direct_forward by (scale, causal, window, softcap,
# kernel, threads, q, k and v's dtypes): a model's layers share one entry, so a decode step
# builds none.
_DIRECT_OPTIONS = {}
# Each thread's last lse of _direct_forward, which returns out alone: a decode step's calls
# (one shape) write the same buffer instead of allocating one each. Per thread, since the
# native call runs without the GIL.
_LSE = threading.local()


def _lse_scratch(shape):
    lse = getattr(_LSE, "buffer", None)
    if lse is None or lse.shape != shape:
        lse = _LSE.buffer = torch.empty(shape, dtype=torch.float32)
    return lse


def _direct_forward(q, k, v, softmax_scale, causal, window_size, softcap, kernel="auto", num_threads=None):
    """out of a dense torch call without dropout or gradient, computed by the native forward on
    the tensors themselves (no dispatcher, no NumPy views, options built once per set of
    arguments), or None where the general route must take it (tracing, modes, gradients,
    strided last dimensions, other dtypes, arguments it would reject). The same kernel and
    options as that route: this saves its Python layers' 10-20 µs a call, as much as the
    kernel takes on a decode step over a short cache (flash_attn_func and the transformers
    integration take it). The caller holds q, k, v (and this function out, and the thread's
    lse scratch) while the native call reads them."""
    if (not _is_tensor(q) or q.dim() != 4 or not _torch_ops.direct(q, k, v) or 1 not in (q.stride(-1), q.shape[-1])
            or k.stride(-1) != 1 or v.stride(-1) != 1 or not isinstance(window_size, (tuple, list))
            or len(window_size) != 2):
        return None
    key = (softmax_scale, causal, tuple(window_size), softcap, kernel, _resolve_threads(num_threads, True), q.dtype,
           k.dtype, v.dtype)
    entry = _DIRECT_OPTIONS.get(key)
    if entry is None:
        names = (_TORCH_DTYPES.get(q.dtype), _TORCH_DTYPES.get(k.dtype), _TORCH_DTYPES.get(v.dtype))
        if None in names:
            return None
        options = _options(0.0, softmax_scale, causal, window_size, softcap, None, False, None, kernel)
        options.num_threads = key[5]
        if len(_DIRECT_OPTIONS) >= 256:  # a caller cycling through arguments: start over, never grow without bound
            _DIRECT_OPTIONS.clear()
        entry = _DIRECT_OPTIONS[key] = (options, {"q": names[0], "k": names[1], "v": names[2], "out": names[0]})
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[-1]))
    lse = _lse_scratch((b, hq, sq))
    # DLPack capsules made by torch's C function (_native): handing the tensors themselves
    # makes the binding call each one's Python-level __dlpack__.
    _C.forward(to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out), to_dlpack(lse), entry[1], entry[0])
    return out


def _direct_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, block_table, softmax_scale, causal,
                    window_size, softcap, kernel, num_threads, return_lse):
    """(out, lse or None) of a torch KV-cache call on a cache of values — appends allowed; no
    rotary, batch index, ALiBi, splits, sinks, scales or packed queries — computed by the
    native call directly as _direct_forward does, or None where the general route must take
    it. Bumps the caches' version counters as the op does."""
    if (q.dim() != 4 or (k is None) != (v is None) or not isinstance(window_size, (tuple, list))
            or len(window_size) != 2 or not _torch_ops.direct(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad,
                                                              block_table)):
        return None
    values = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}
    names = {}
    for name, x in values.items():
        if x is not None:
            names[name] = _TORCH_DTYPES.get(x.dtype)
            if names[name] is None or (x.stride(-1) != 1 and x.shape[-1] != 1):
                return None
    if any(x is not None and (x.dtype != torch.int32 or (x.dim() > 0 and x.stride(-1) != 1 and x.shape[-1] > 1))
           for x in (cache_seqlens, cache_leftpad, block_table)):  # the general route copies strided tables
        return None
    key = ("kvcache", softmax_scale, causal, tuple(window_size), softcap, kernel, _resolve_threads(num_threads, True))
    options = _DIRECT_OPTIONS.get(key)
    if options is None:
        options = _options(0.0, softmax_scale, causal, window_size, softcap, None, False, None, kernel)
        options.num_threads = key[6]
        if len(_DIRECT_OPTIONS) >= 256:
            _DIRECT_OPTIONS.clear()
        _DIRECT_OPTIONS[key] = options
    names["out"] = names["q"]
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v_cache.shape[-1]))
    lse = torch.empty((b, hq, sq), dtype=torch.float32) if return_lse else _lse_scratch((b, hq, sq))
    dl = [None if x is None else to_dlpack(x) for x in (q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad,
                                                         block_table, out, lse)]
    _C.forward_with_kvcache(dl[0], dl[1], dl[2], dl[3], dl[4], None, None, dl[5], None, dl[6], dl[7], True, dl[8],
                            dl[9], names, None, None, options, None, None, 0, None, None, {})
    torch.autograd.graph.increment_version([k_cache, v_cache])
    return out, (lse if return_lse else None)


def _as_tensor(x):
    """Small tables (masks, slopes) beside tensors: NumPy ones taken as tensors."""
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def _cu_seqlens_tensor(x, name):
    """cu_seqlens beside torch inputs: a NumPy array taken as a tensor (as _as_tensor), anything
    else that is no tensor a TypeError naming it (the ops' schemas take tensors)."""
    if isinstance(x, np.ndarray):
        return _as_tensor(x)
    if not _is_tensor(x):
        raise TypeError(f"{name}: expected an int32 torch.Tensor beside torch inputs, got {type(x).__name__}")
    return x


def _torch_s_dmask(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   rng_state, block_mask=None, block_mask_block_size=0, sinks=None):
    """S_dmask (see _s_dmask) of a torch call that drew rng_state: without dropout the empty
    tensor, made before any native object (torch.compile traces it: return_attn_probs=True
    compiles with fullgraph)."""
    if not dropout_p > 0.0:
        return q.new_empty((0,))
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, False, None,
                    block_mask=block_mask, block_mask_block_size=block_mask_block_size, sinks=sinks)
    if rng_state is not None:
        opts.seed, opts.offset = (int(x) & ((1 << 64) - 1) for x in rng_state.tolist())
    q, k, v = q.detach(), k.detach(), v.detach()
    if varlen is None:
        return _s_dmask(q, lambda o: _probs(q, k, v, o), opts)
    return _s_dmask(q, lambda o: _varlen_probs(q, k, v, *varlen, o), opts)


# ---- upstream's functions ----------------------------------------------------------------------


def _dtype_of(x, name):
    """The dtype name of an input; tensors by their torch dtype (fake tensors included)."""
    if _is_tensor(x):
        dt = _TORCH_DTYPES.get(x.dtype)
        if dt is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported (float32, float16, bfloat16)")
        return dt
    return _raw(x, name)[1]


def _check_packed(name, x, rank, axis, count, layout, q=None):
    """A packed input's shape, and its dtype (against q's, for kv), named as the argument."""
    shape = tuple(x.shape)
    if len(shape) != rank or shape[axis] != count:
        raise ValueError(f"{name}: expected shape {layout}, got {shape}")
    dt = _dtype_of(x, name)
    if q is not None and _dtype_of(q, "q") != dt:
        raise TypeError(f"{name}: dtype {dt} does not match q's dtype {_dtype_of(q, 'q')}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    seed=None, kernel="auto", backward_kernel="auto", num_threads=None, num_splits=0,
                    block_mask=None, block_mask_block_size=0, q_descale=None, k_descale=None, v_descale=None,
                    learnable_sink=None, sinks=None, pack_gqa=None):
    """Exact attention. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, Hq, Dv).

    With return_attn_probs: (out, softmax_lse (B, Hq, Sq) float32, S_dmask), as upstream: S_dmask
    is empty without dropout; with dropout_p > 0 it is (B, Hq, Sq, Sk) in q's dtype, the softmax
    probabilities with dropped entries negated — materialized, for testing only. kernel / backward_kernel:
    the CPU kernels by name ("auto", "tiled", "tiled_bf16", "decode", ...; see ForwardKernel
    and BackwardKernel in include/flashattn/options.hpp); a request the inputs or the CPU rule
    out raises ValueError. seed: the dropout seed (default: drawn from torch's generator for
    tensors, numpy.random's for arrays). num_threads: worker threads (default:
    flashattn.set_num_threads()'s, else torch.get_num_threads() for tensors, else OpenMP's).

    num_splits: split-KV parts of each Q tile's keys, merged exactly (0: the planner's choice,
    1: never). block_mask: bool or uint8 (ceil(Sq / block), ceil(Sk / block)) shared by every
    batch and head, with block_mask_block_size the block; score (i, j) is kept only where
    block_mask[i // block, j // block] is set. FP8: q, k, v of dtype float8_e4m3fn (or
    float8_e5m2) with q_descale, k_descale, v_descale float32 (B, Hkv), value = code *
    descale (None: 1), as upstream FA3; out is bfloat16, and there is no backward.
    pack_gqa: FA3's — stack the q heads of a kv head in one Q tile so each K/V tile is read
    once for the group (None: the planner's choice; True with alibi_slopes, dropout or an
    attn_mask raises ValueError); the result is the same bits either way.

    learnable_sink: upstream FA4's (gpt-oss's `sinks`), one logit per q head (Hq,) float32
    (float16 and bfloat16 are widened) joining every row's softmax denominator without a
    value, neither scaled nor softcapped; softmax_lse includes it, and autograd gives its
    gradient (docs/python.md, "Attention sinks")."""
    if (dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs and num_splits == 0 and block_mask is None
            and not block_mask_block_size and learnable_sink is None and sinks is None and pack_gqa is None
            and q_descale is None and k_descale is None and v_descale is None and seed is None
            and not deterministic and backward_kernel == "auto"):
        out = _direct_forward(q, k, v, softmax_scale, causal, window_size, softcap, kernel, num_threads)
        if out is not None:  # an inference call on plain tensors: the general route's result, without its layers
            return out
    learnable_sink = _sink_alias(learnable_sink, sinks)
    return _attention(q, k, v, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, seed, kernel, backward_kernel, num_threads, num_splits,
                      block_mask, block_mask_block_size, (q_descale, k_descale, v_descale), learnable_sink,
                      pack_gqa)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              seed=None, kernel="auto", backward_kernel="auto", num_threads=None, num_splits=0,
                              block_mask=None, block_mask_block_size=0, learnable_sink=None, sinks=None,
                              pack_gqa=None):
    """flash_attn_func on qkv (B, S, 3, H, D), sliced without copies."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    _check_packed("qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, seed=seed,
                           kernel=kernel, backward_kernel=backward_kernel, num_threads=num_threads,
                           num_splits=num_splits, block_mask=block_mask,
                           block_mask_block_size=block_mask_block_size, learnable_sink=learnable_sink,
                           pack_gqa=pack_gqa)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             seed=None, kernel="auto", backward_kernel="auto", num_threads=None, num_splits=0,
                             block_mask=None, block_mask_block_size=0, learnable_sink=None, sinks=None,
                             pack_gqa=None):
    """flash_attn_func on q and kv (B, Sk, 2, Hkv, D), sliced without copies."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    _check_packed("kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, heads_kv, head_dim)", q)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, seed=seed, kernel=kernel,
                           backward_kernel=backward_kernel, num_threads=num_threads, num_splits=num_splits,
                           block_mask=block_mask, block_mask_block_size=block_mask_block_size,
                           learnable_sink=learnable_sink, pack_gqa=pack_gqa)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *,
                           seed=None, kernel="auto", backward_kernel="auto", num_threads=None, num_splits=0,
                           seqused_k=None, k_scale=None, v_scale=None, learnable_sink=None, sinks=None,
                           prefix_block_table=None, prefix_seqused_k=None, prefix_idx=None, k_zero_point=None,
                           v_zero_point=None, k_quant=None, v_quant=None, pack_gqa=None):
    """Packed variable-length batch: q (total_q, Hq, D), k/v (total_k, Hkv, D), int32 cu_seqlens (B + 1).

    Each sequence attends only within itself; softmax_lse is (Hq, total_q). kernel /
    backward_kernel, seed, num_threads, num_splits and pack_gqa as flash_attn_func's.

    Paged (block_table int32 (B, max_pages), as upstream): k and v are page pools
    (num_pages, page_size, Hkv, D), read in place; sequence b's keys are its first
    seqused_k[b] (FA3's argument; default cu_seqlens_k[b + 1] - cu_seqlens_k[b]) slots of
    pages block_table[b, :], and its queries any number of rows — decode rows and prefill
    chunks mixed, causal aligned bottom-right. uint8 (or float8_e4m3fn) pools are FP8 e4m3
    codes with float32 k_scale/v_scale (num_pages, Hkv) descales; int8 pools as
    flash_attn_with_kvcache's (k_quant, v_quant, k_zero_point, v_zero_point). The whole batch runs in
    one parallel region and each sequence's result is bit-identical alone, in any batch, on
    any number of threads. Inference only: no dropout, no gradients. Returns out, or
    (out, softmax_lse, None) with return_attn_probs. learnable_sink as flash_attn_func's,
    paged or not.

    Shared prefixes (cascade attention, paged only): prefix_block_table int32 (P, max_prefix_pages),
    prefix_seqused_k int32 (P) and prefix_idx int32 (B), all three or none. Sequence b with
    prefix_idx[b] = p >= 0 attends to prefix p's keys followed by its own (block_table[b],
    seqused_k[b]: its suffix only); the prefix's keys are read once for the query rows of all
    its sequences, which must be consecutive in the batch. Under causal every query row sees the
    whole prefix (seqused_k[b] >= its rows - 1); window_size and alibi_slopes are rejected.
    Equal to the unshared call over the concatenated keys within float32 rounding."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    prefixes = (prefix_block_table, prefix_seqused_k, prefix_idx)
    max_seqlen_q = _seqlen_arg("max_seqlen_q", max_seqlen_q)
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, return_attn_probs, block_table, seqused_k,
                             k_scale, v_scale, kernel, num_threads, num_splits, learnable_sink, prefixes,
                             (k_zero_point, v_zero_point, k_quant, v_quant), pack_gqa)
    for name, x in (("seqused_k", seqused_k), ("k_scale", k_scale), ("v_scale", v_scale),
                    ("prefix_block_table", prefix_block_table), ("prefix_seqused_k", prefix_seqused_k),
                    ("prefix_idx", prefix_idx), ("k_zero_point", k_zero_point), ("v_zero_point", v_zero_point),
                    ("k_quant", k_quant), ("v_quant", v_quant)):
        if x is not None:
            raise ValueError(f"{name}: belongs to a paged batch (block_table)")
    max_seqlen_k = _seqlen_arg("max_seqlen_k", max_seqlen_k)
    return _attention(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, seed, kernel,
                      backward_kernel, num_threads, num_splits, learnable_sink=learnable_sink, pack_gqa=pack_gqa)


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, block_table, seqused_k, k_scale, v_scale,
                  kernel, num_threads, num_splits, learnable_sink=None, prefixes=(None, None, None),
                  int8=(None, None, None, None), pack_gqa=None):
    """flash_attn_varlen_func over page pools (forward_varlen_paged in include/flashattn/attention.hpp);
    prefixes: (prefix_block_table, prefix_seqused_k, prefix_idx) or Nones; int8: (k_zero_point,
    v_zero_point, k_quant, v_quant)."""
    k_zero_point, v_zero_point, k_quant, v_quant = int8
    k_quant, v_quant = _quant_name(k_cache, k_scale, k_quant, "k_quant"), _quant_name(v_cache, v_scale, v_quant, "v_quant")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: a paged batch is inference only, got {dropout_p}")
    if _is_tensor(q) and torch.is_grad_enabled() and any(
            _is_tensor(x) and x.requires_grad for x in (q, k_cache, v_cache, learnable_sink)):
        raise ValueError("q, k, v, learnable_sink: a paged batch is inference only (no gradients); call it under "
                         "torch.no_grad()")
    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("seqused_k: a paged batch needs seqused_k or cu_seqlens_k for its key counts")
        cu_seqlens_k = _raw(cu_seqlens_k, "cu_seqlens_k", int32=True, tensor=True)[0]
        table_shape = tuple(getattr(block_table, "shape", ()))  # block_table's own checks come later
        batch = table_shape[0] if len(table_shape) == 2 else None
        if cu_seqlens_k.ndim != 1 or (batch is not None and cu_seqlens_k.shape[0] != batch + 1):
            raise ValueError(f"cu_seqlens_k: shape {tuple(cu_seqlens_k.shape)} but expected ({batch} + 1,): one "
                             f"offset per sequence of block_table {table_shape} and the end")
        if _is_tensor(cu_seqlens_k):  # torch ops only, so that a compiled graph keeps it
            seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        else:
            seqused_k = np.diff(cu_seqlens_k)
        compiling = _is_tensor(cu_seqlens_k) and torch.compiler.is_compiling()  # no data read in a graph
        if not compiling and bool((seqused_k < 0).any()):
            at = next(i for i, n in enumerate(seqused_k.tolist()) if n < 0)
            raise ValueError(f"cu_seqlens_k: must be non-decreasing (it gives the key counts without seqused_k), "
                             f"got {int(cu_seqlens_k[at])} at [{at}] then {int(cu_seqlens_k[at + 1])}")
    window_size = _window_arg(window_size)
    if _is_tensor(q):
        if alibi_slopes is not None and not _is_tensor(alibi_slopes):
            alibi_slopes = torch.as_tensor(alibi_slopes)
        if num_threads is not None and num_threads != 0:
            num_threads = _resolve_threads(num_threads, True)
        tables = [_as_tensor(x) for x in (cu_seqlens_q, block_table, seqused_k, k_scale, v_scale, *prefixes,
                                          k_zero_point, v_zero_point)]
        args = (q, k_cache, v_cache, tables[0], int(max_seqlen_q), tables[1], tables[2], tables[3], tables[4],
                _scale_arg(softmax_scale), bool(causal), *window_size, float(softcap), alibi_slopes, str(kernel),
                int(num_threads or 0),
                _int_arg("num_splits", num_splits, 0), _learnable_sink(learnable_sink, q), *tables[5:],
                k_quant, v_quant, _pack_gqa_arg(pack_gqa))
        direct = _torch_ops.direct(*(a for a in args if isinstance(a, torch.Tensor)))
        out, lse = (_torch_ops._varlen_paged_fwd if direct else torch.ops.flashattn.varlen_paged_fwd)(*args)
    else:
        opts = _options(0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False, None, kernel,
                        num_splits=num_splits, sinks=_learnable_sink(learnable_sink, q), pack_gqa=pack_gqa)
        opts.num_threads = _resolve_threads(num_threads, False)
        out, lse = _paged_varlen_forward(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, block_table, seqused_k,
                                         k_scale, v_scale, opts, prefixes, k_zero_point, v_zero_point, k_quant,
                                         v_quant)
    return (out, lse, None) if return_attn_probs else out


def _paged_varlen_forward(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, block_table, seqused_k, k_scale, v_scale,
                          opts, prefixes=(None, None, None), k_zero_point=None, v_zero_point=None, k_quant="",
                          v_quant=""):
    """The paged variable-length call on raw views: (out, softmax_lse)."""
    if _is_codes(k_cache):
        raws, dts = _inputs(q=q, tensors=True)
        raws["k_cache"], raws["v_cache"] = _codes(k_cache, "k_cache"), _codes(v_cache, "v_cache")
        dts["k_cache"] = dts["v_cache"] = "u8"
        scales = [None if x is None else _raw(x, name)[0]
                  for name, x in (("k_scale", k_scale), ("v_scale", v_scale), ("k_zero_point", k_zero_point),
                                  ("v_zero_point", v_zero_point))]
    else:
        _reject_scales(k_cache, k_scale, v_scale, k_zero_point, v_zero_point)
        raws, dts = _inputs(q=q, k_cache=k_cache, v_cache=v_cache, tensors=True)
        scales = [None, None, None, None]
    total, hq, _ = _shape(raws["q"], ("total_q", "heads", "head_dim"))
    dt = dts["q"]
    out, out_raw = _empty((total, hq, raws["v_cache"].shape[-1]), dt, q, tensor=True)
    lse, lse_raw = _empty((hq, total), "f32", q, tensor=True)

    def ints(x, name):
        return None if x is None else _raw(x, name, int32=True, tensor=True)[0]

    _C.forward_varlen_paged(*_native(raws["q"], ints(cu_seqlens_q, "cu_seqlens_q"), int(max_seqlen_q),
                                     raws["k_cache"], raws["v_cache"], ints(block_table, "block_table"),
                                     ints(seqused_k, "seqused_k"), scales[0], scales[1],
                                     *(ints(x, name) for name, x in
                                       zip(("prefix_block_table", "prefix_seqused_k", "prefix_idx"), prefixes)),
                                     out_raw, lse_raw, {**dts, "out": dt}, opts, scales[2], scales[3],
                                     _quants(k_quant, v_quant)))
    return out, lse


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, *, seed=None, kernel="auto",
                                     backward_kernel="auto", num_threads=None, learnable_sink=None, sinks=None):
    """flash_attn_varlen_func on qkv (total, 3, H, D)."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    _check_packed("qkv", qkv, 4, 1, 3, "(total, 3, heads, head_dim)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                                  max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, seed=seed, kernel=kernel,
                                  backward_kernel=backward_kernel, num_threads=num_threads,
                                  learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, seed=None, kernel="auto", backward_kernel="auto",
                                    num_threads=None, learnable_sink=None, sinks=None):
    """flash_attn_varlen_func on q and kv (total_k, 2, Hkv, D)."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    _check_packed("kv", kv, 4, 1, 2, "(total_k, 2, heads_kv, head_dim)", q)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, seed=seed, kernel=kernel,
                                  backward_kernel=backward_kernel, num_threads=num_threads,
                                  learnable_sink=learnable_sink)


def _dtype_name(x):
    return str(x.dtype)


def _is_codes(x) -> bool:
    """Whether a KV cache holds codes: uint8 (FP8 e4m3, or u8 with k_quant="u8"), int8 (s8),
    or float8_e4m3fn (e4m3 codes)."""
    if _is_tensor(x):
        return x.dtype in (torch.uint8, torch.int8) or x.dtype == getattr(torch, "float8_e4m3fn", None)
    return isinstance(x, np.ndarray) and x.dtype in (np.dtype(np.uint8), np.dtype(np.int8),
                                                     np.dtype(ml_dtypes.float8_e4m3fn))


def _quant_name(cache, scale, quant, name):
    """A quantized pool's format as the extension takes it, "codes/granularity" (kv_quant.hpp):
    the codes named by `quant` ("e4m3", "u8", "s8"), else s8 for an int8 cache and e4m3 for
    the others; per token when the scales have rank 3 (pages, page_size, Hkv), else per page.
    Empty for a cache of values."""
    if not _is_codes(cache):
        if quant is not None:
            raise TypeError(f"{name}: {quant!r} describes a cache of codes, not a {_dtype_name(cache)} cache")
        return ""
    is_int8 = cache.dtype == (torch.int8 if _is_tensor(cache) else np.dtype(np.int8))
    codes = quant if quant is not None else ("s8" if is_int8 else "e4m3")
    if codes not in ("e4m3", "u8", "s8"):
        raise ValueError(f"{name}: expected 'e4m3', 'u8' or 's8', got {codes!r}")
    if is_int8 != (codes == "s8"):
        raise TypeError(f"{name}: {codes} codes but the cache is {_dtype_name(cache)}: s8 codes are int8, the others uint8")
    per_token = scale is not None and len(scale.shape) == 3
    return codes + ("/per_token" if per_token else "/per_page")


def _quants(k_quant, v_quant):
    return {name: q for name, q in (("k_quant", k_quant), ("v_quant", v_quant)) if q}


def _reject_scales(cache, k_scale, v_scale, k_zero_point, v_zero_point):
    if k_scale is not None or v_scale is not None:
        raise TypeError("k_scale, v_scale: descales belong to an FP8 cache (uint8 e4m3 codes), "
                        f"not a {_dtype_name(cache)} cache")
    if k_zero_point is not None or v_zero_point is not None:
        raise TypeError(f"k_zero_point, v_zero_point: zero points belong to a u8 cache, not a {_dtype_name(cache)} cache")


def _codes(x, name):
    """A zero-copy uint8 view of a cache of codes (written in place, so never copied)."""
    if not _is_codes(x):
        raise TypeError(f"{name}: dtype {_dtype_name(x)} but the cache holds codes: expected uint8 (e4m3 or u8), "
                        "int8 (s8) or float8_e4m3fn")
    if _is_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: only CPU tensors are supported, got device {x.device}")
        return x.detach().view(torch.uint8).numpy()
    return x.view(np.uint8)


def _f32_in_place(x, name, required=True):
    """A zero-copy float32 view of an array the call updates in place (descales, per-token
    scales and zero points); None where not required and not given."""
    if x is None:
        if not required:
            return None
        raise ValueError(f"{name}: an FP8 cache (uint8 e4m3 codes) needs its float32 descales "
                         "(num_pages or batch_cache, heads_kv)")
    if _is_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: only CPU tensors are supported, got device {x.device}")
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: dtype {x.dtype} but expected torch.float32 (updated in place)")
        return x.detach().numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name}: dtype {x.dtype} but expected float32 (updated in place)")
    return x


def _kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, block_table, rotary_interleaved, k_scale, v_scale, opts, cu_seqlens_q=None,
                     cu_seqlens_k_new=None, max_seqlen_q=0, k_zero_point=None, v_zero_point=None, k_quant="",
                     v_quant=""):
    """The KV-cache call on raw views: (out, softmax_lse); the caches (and a quantized cache's
    scales and zero points, as appends need) are written in place."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_writable(cache, name, "flash_attn_with_kvcache takes a writable cache (it appends k and v in place)")
    if _is_codes(k_cache):
        raws, dts = _inputs(q=q, tensors=True)
        raws["k_cache"], raws["v_cache"] = _codes(k_cache, "k_cache"), _codes(v_cache, "v_cache")
        dts["k_cache"] = dts["v_cache"] = "u8"
        scales = {name: _f32_in_place(x, name) for name, x in (("k_scale", k_scale), ("v_scale", v_scale))}
        scales.update({name: _f32_in_place(x, name, False)
                       for name, x in (("k_zero_point", k_zero_point), ("v_zero_point", v_zero_point))})
    else:
        _reject_scales(k_cache, k_scale, v_scale, k_zero_point, v_zero_point)
        raws, dts = _inputs(q=q, k_cache=k_cache, v_cache=v_cache, tensors=True)
        scales = {"k_scale": None, "v_scale": None, "k_zero_point": None, "v_zero_point": None}
    new, new_dts = _inputs(q=q, **{name: x for name, x in (("k", k), ("v", v)) if x is not None}, tensors=True)
    dt = dts["q"]

    def ints(x, name):
        return None if x is None else _raw(x, name, int32=True, tensor=True)[0]

    def floats(x, name):
        if x is None:
            return None
        raw, xdt = _raw(x, name, tensor=True)
        if xdt != "f32":  # the tables are small: convert instead of refusing
            raw = raw.float() if _is_tensor(raw) else np.asarray(x, dtype=np.float32)
        return raw

    dv = raws["v_cache"].shape[-1]
    if cu_seqlens_q is not None:  # packed (FA3): q (total_q, Hq, D)
        total, hq, _ = _shape(raws["q"], ("total_q", "heads", "head_dim"))
        (out, out_raw), (lse, lse_raw) = _empty((total, hq, dv), dt, q, True), _empty((hq, total), "f32", q, True)
    else:
        batch, sq, hq, _ = _shape(raws["q"], ("batch", "seqlen", "heads", "head_dim"))
        (out, out_raw), (lse, lse_raw) = (_empty((batch, sq, hq, dv), dt, q, True),
                                          _empty((batch, hq, sq), "f32", q, True))
    _C.forward_with_kvcache(*_native(raws["q"], raws["k_cache"], raws["v_cache"], new.get("k"), new.get("v"),
                                     floats(rotary_cos, "rotary_cos"), floats(rotary_sin, "rotary_sin"),
                                     ints(cache_seqlens, "cache_seqlens"), ints(cache_batch_idx, "cache_batch_idx"),
                                     ints(cache_leftpad, "cache_leftpad"), ints(block_table, "block_table"),
                                     bool(rotary_interleaved), out_raw, lse_raw, {**dts, **new_dts, "out": dt},
                                     scales["k_scale"], scales["v_scale"], opts, ints(cu_seqlens_q, "cu_seqlens_q"),
                                     ints(cu_seqlens_k_new, "cu_seqlens_k_new"), _seqlen_arg("max_seqlen_q", max_seqlen_q or 0),
                                     scales["k_zero_point"], scales["v_zero_point"], _quants(k_quant, v_quant)))
    return out, lse


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, k_scale=None, v_scale=None, kernel="auto",
                            num_threads=None, learnable_sink=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                            max_seqlen_q=None, k_zero_point=None, v_zero_point=None, k_quant=None, v_quant=None,
                            pack_gqa=None):
    """Attention over a KV cache, as upstream: k_cache/v_cache (B_cache, S_cache, Hkv, D) or paged
    (num_pages, page_size, Hkv, D) with block_table (B, max_pages); new k, v (B, S_new, Hkv, D)
    are written into the cache in place at cache_seqlens before attending; rotary_cos/sin
    (positions, rotary_dim / 2) rotate q and the new keys; cache_leftpad (B) int32 marks the
    first slot of each sequence of a contiguous cache (earlier slots are padding, never
    attended). Inference only (no gradients).

    FP8 e4m3 cache: k_cache/v_cache of dtype uint8 (or float8_e4m3fn, read as its codes) hold
    e4m3 codes and k_scale/v_scale float32 (num_pages or B_cache, Hkv) their descales, one per
    (page, kv head): value = code * descale. Appends quantize the new tokens and grow a page's
    descale in place when they need it (see KvCache in include/flashattn/attention.hpp).

    int8 cache (include/flashattn/kv_quant.hpp), K and V each in its own format: k_quant /
    v_quant "u8" — uint8 codes, value = (code - zero_point) * scale, with float32
    k_zero_point / v_zero_point of the scales' shape — or "s8" — int8 codes (the default for
    an int8 cache), value = code * scale ("e4m3", the default for uint8, is the FP8 cache
    above). k_scale / v_scale float32 (num_pages or B_cache, Hkv) are per (page, kv head): the
    caller's, appends saturate beyond them; (num_pages or B_cache, page_size or S_cache, Hkv)
    are per token: appends compute and write them (and the zero points) for the new tokens,
    each value within half a step, (1/2 + 2^-23 (1 + |zero_point|)) * scale.

    kernel: the CPU forward kernel by name — "auto" (the planner's choice), "decode",
    "decode_fp16" (an FP8 or int8 cache on AVX512-FP16: half-precision products), "decode_bf16"
    (the same on AVX512-BF16 dot products), "tiled" or
    "tiled_bf16" (see ForwardKernel in include/flashattn/options.hpp). num_threads,
    learnable_sink and pack_gqa as flash_attn_func's.

    Packed batch (FA3's cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q; paged caches only):
    q (total_q, Hq, D) with int32 cu_seqlens_q (B + 1), any number of query rows per sequence;
    new k, v (total_new, Hkv, D) with int32 cu_seqlens_k_new (B + 1): sequence b appends its
    rows at cache_seqlens[b] (rotated), then attends to all its keys; out (total_q, Hq, Dv),
    softmax_lse (Hq, total_q). Each sequence's result is that of flash_attn_varlen_func over
    the pools after the append, bit for bit."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not (_is_tensor(x) or isinstance(x, np.ndarray)):
            raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        step = cache.stride(-1) if _is_tensor(cache) else cache.strides[-1] // cache.itemsize
        # Written in place: a contiguous copy would lose the appended tokens. (An empty cache,
        # whose NumPy strides are 0, is left to the native shape checks.)
        if step != 1 and 0 not in cache.shape:
            raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {step}")
    window_size = _window_arg(window_size)
    batch = q.shape[0] if cu_seqlens_q is None else len(cu_seqlens_q) - 1
    sinks = _learnable_sink(learnable_sink, q)
    if _is_tensor(q):
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if x is not None and not _is_tensor(x):
                raise TypeError(f"inputs mix numpy arrays and torch tensors: q, {name}")
        cache_seqlens = _cache_seqlens_table(cache_seqlens, batch, True)
        if (rotary_cos is None and rotary_sin is None and cache_batch_idx is None and alibi_slopes is None
                and num_splits == 0 and k_scale is None and v_scale is None and sinks is None and cu_seqlens_q is None
                and cu_seqlens_k_new is None and max_seqlen_q is None and k_zero_point is None and v_zero_point is None
                and k_quant is None and v_quant is None and pack_gqa is None
                and all(_is_tensor(x) or x is None for x in (cache_seqlens, cache_leftpad, block_table))):
            result = _direct_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, block_table,
                                     softmax_scale, causal, window_size, softcap, kernel, num_threads,
                                     return_softmax_lse)
            if result is not None:  # an inference call: the general route's result, without its layers
                return result if return_softmax_lse else result[0]

        def tensor(x):  # small NumPy tables beside tensors are taken without a copy
            return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x

        if alibi_slopes is not None and not _is_tensor(alibi_slopes):
            alibi_slopes = torch.as_tensor(alibi_slopes)
        if num_threads is not None and num_threads != 0:
            num_threads = _resolve_threads(num_threads, True)
        args = (q, k_cache, v_cache, k, v, tensor(rotary_cos), tensor(rotary_sin), tensor(cache_seqlens),
                tensor(cache_batch_idx), tensor(cache_leftpad), tensor(block_table),
                _scale_arg(softmax_scale), bool(causal), *_window_arg(window_size), float(softcap),
                bool(rotary_interleaved), alibi_slopes,
                _int_arg("num_splits", num_splits, 0), tensor(k_scale), tensor(v_scale), str(kernel),
                int(num_threads or 0), sinks, tensor(cu_seqlens_q), tensor(cu_seqlens_k_new),
                _seqlen_arg("max_seqlen_q", max_seqlen_q or 0), tensor(k_zero_point), tensor(v_zero_point),
                _quant_name(k_cache, k_scale, k_quant, "k_quant"), _quant_name(v_cache, v_scale, v_quant, "v_quant"),
                _pack_gqa_arg(pack_gqa))
        direct = _torch_ops.direct(*(a for a in args if isinstance(a, torch.Tensor)))
        out, lse = (_torch_ops.fwd_kvcache_direct if direct else torch.ops.flashattn.fwd_kvcache)(*args)
        return (out, lse) if return_softmax_lse else out
    cache_seqlens = _cache_seqlens_table(cache_seqlens, batch, False)
    opts = _options(0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False, None, kernel, sinks=sinks,
                    pack_gqa=pack_gqa)
    opts.num_splits = _int_arg("num_splits", num_splits, 0)
    opts.num_threads = _resolve_threads(num_threads, False)
    out, lse = _kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, rotary_interleaved, k_scale, v_scale, opts, cu_seqlens_q,
                                cu_seqlens_k_new, max_seqlen_q, k_zero_point, v_zero_point,
                                _quant_name(k_cache, k_scale, k_quant, "k_quant"),
                                _quant_name(v_cache, v_scale, v_quant, "v_quant"))
    return (out, lse) if return_softmax_lse else out


def _backward_options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, seed,
                      backward_kernel, num_threads, torch_inputs, block_mask=None, block_mask_block_size=0,
                      sinks=None):
    if dropout_p > 0.0 and seed is None:
        raise ValueError("seed: backward with dropout needs the seed the forward used")
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, seed,
                    backward_kernel=backward_kernel, block_mask=block_mask,
                    block_mask_block_size=block_mask_block_size, sinks=sinks)
    opts.num_threads = _resolve_threads(num_threads, torch_inputs)
    return opts


def flash_attn_backward(dout, q, k, v, out, softmax_lse, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, *,
                        seed=None, backward_kernel="auto", num_threads=None, block_mask=None,
                        block_mask_block_size=0, learnable_sink=None, sinks=None):
    """Gradients (dq, dk, dv) of sum(dout * out) for NumPy users; P is recomputed from softmax_lse.

    With dropout, pass the seed the forward used; a forward's block_mask and learnable_sink
    come here too (with learnable_sink: (dq, dk, dv, dsinks), dsinks float32 (Hq,)).
    backward_kernel: the CPU kernel by name ("auto", "tiled", "tiled_bf16")."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    sinks = _learnable_sink(learnable_sink, q)
    opts = _backward_options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             seed, backward_kernel, num_threads, _is_tensor(q), block_mask, block_mask_block_size,
                             sinks)
    dsinks = _dsinks_output(opts, sinks, q)
    grads = _backward(dout, q, k, v, out, softmax_lse, opts)
    return grads if dsinks is None else (*grads, dsinks)


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, *,
                               seed=None, backward_kernel="auto", num_threads=None, learnable_sink=None, sinks=None):
    """Gradients (dq, dk, dv) of a packed variable-length batch (with learnable_sink, and dsinks,
    as flash_attn_backward's)."""
    learnable_sink = _sink_alias(learnable_sink, sinks)
    sinks = _learnable_sink(learnable_sink, q)
    opts = _backward_options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             seed, backward_kernel, num_threads, _is_tensor(q), sinks=sinks)
    dsinks = _dsinks_output(opts, sinks, q)
    grads = _varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, opts)
    return grads if dsinks is None else (*grads, dsinks)


def _dsinks_output(opts, sinks, like):
    """float32 (Hq) zeros of like's kind, set as the options' dsinks, or None without sinks."""
    if sinks is None:
        return None
    dsinks, raw = _empty((sinks.shape[0],), "f32", like)
    raw[...] = 0.0
    opts.dsinks = raw
    return dsinks

# ---- FP8 inputs (upstream FA3's q_descale, k_descale, v_descale) ------------------------------------


_FP8_NUMPY = {np.dtype(ml_dtypes.float8_e4m3fn): "e4m3", np.dtype(ml_dtypes.float8_e5m2): "e5m2"}
_FP8_TORCH = {} if torch is None else {getattr(torch, name): fmt for name, fmt in
                                       (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")) if hasattr(torch, name)}


def _fp8_format(x):
    """"e4m3" or "e5m2" for an FP8 array or tensor, else None."""
    if _is_tensor(x):
        return _FP8_TORCH.get(x.dtype)
    if isinstance(x, np.ndarray):
        return _FP8_NUMPY.get(x.dtype)
    return None


def _is_fp8(x) -> bool:
    return _fp8_format(x) is not None


def _fp8_input(x, name):
    """The codes of an FP8 input as a zero-copy uint8 view (last dimension made contiguous), and its format."""
    fmt = _fp8_format(x)
    if fmt is None:
        raise TypeError(f"{name}: dtype {_dtype_name(x)} but q is FP8: q, k, v are all float8_e4m3fn or float8_e5m2")
    if _is_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: only CPU tensors are supported, got device {x.device}")
        t = x.detach()
        if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
            t = t.contiguous()
        return t.view(torch.uint8).numpy(), fmt
    if x.ndim > 0 and x.strides[-1] != x.itemsize and x.shape[-1] > 1:
        x = np.ascontiguousarray(x)
    return x.view(np.uint8), fmt


def _fp8_descale(d, name, batch, heads_kv, group, seqlen):
    """FA3's descale, float32 (batch, heads_kv) or None (1), in the native layout: one block of
    all `seqlen` rows per (batch, head), (batch, heads, 1), q's heads taking their kv head's.
    Returns (descale, block_size); block_size 0 is one descale for the whole tensor."""
    if d is not None:
        if _is_tensor(d):
            if d.device.type != "cpu":
                raise ValueError(f"{name}: only CPU tensors are supported, got device {d.device}")
            if d.dtype != torch.float32:
                raise TypeError(f"{name}: dtype {d.dtype} but expected torch.float32")
            d = d.detach().numpy()
        elif not isinstance(d, np.ndarray):
            raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(d).__name__}")
        elif d.dtype != np.float32:
            raise TypeError(f"{name}: dtype {d.dtype} but expected float32")
        if d.shape != (batch, heads_kv):
            raise ValueError(f"{name}: expected shape (batch, heads_kv) = ({batch}, {heads_kv}), got {tuple(d.shape)}")
    if d is None or seqlen == 0 or batch == 0:
        return np.ones(1, dtype=np.float32), 0
    per_head = np.repeat(d, group, axis=1) if group > 1 else d
    return np.ascontiguousarray(per_head)[:, :, None], seqlen


def _fp8_forward(q, k, v, descales, opts):
    """The FP8 forward on raw views: (out bfloat16 (B, Sq, Hq, Dv), softmax_lse (B, Hq, Sq))."""
    codes = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        codes[name] = _fp8_input(x, name)
        rank = codes[name][0].ndim
        if rank != 4:
            raise ValueError(f"{name}: expected rank 4 (batch, seqlen, heads, head_dim), got rank {rank}")
    b, sq, hq, _ = codes["q"][0].shape
    _, sk, hkv, dv = codes["v"][0].shape
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: heads_q = {hq} is not a multiple of heads_kv = {hkv}")
    group = hq // hkv
    scales = [_fp8_descale(d, n + "_descale", b, hkv, group if n == "q" else 1, s)
              for n, d, s in (("q", descales[0], sq), ("k", descales[1], sk), ("v", descales[2], sk))]
    out, out_raw = _empty((b, sq, hq, dv), "bf16", q)
    lse, lse_raw = _empty((b, hq, sq), "f32", q)
    args = []
    for (raw, fmt), (scale, block) in zip((codes["q"], codes["k"], codes["v"]), scales):
        args += [raw, scale, fmt, block]
    _C.forward_fp8(*args, out_raw, lse_raw, "bf16", opts)
    return out, lse


def _fp8_attention(q, k, v, descales, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, seed, kernel, num_threads, num_splits, block_mask, block_mask_block_size,
                   sinks=None, pack_gqa=None):
    if return_attn_probs and dropout_p > 0.0:
        raise NotImplementedError("return_attn_probs: S_dmask under dropout is not available for FP8 inputs")
    if _is_tensor(q):
        _check_block_mask(block_mask, block_mask_block_size)
        rng_state = _torch_rng_state(dropout_p, seed)
        args = (q, k, v, *(_as_tensor(d) for d in descales), float(dropout_p),
                _scale_arg(softmax_scale), bool(causal), *_window_arg(window_size), float(softcap),
                _as_tensor(alibi_slopes), rng_state, str(kernel),
                int(_resolve_threads(num_threads, True) if num_threads else 0), _int_arg("num_splits", num_splits, 0),
                _as_tensor(block_mask), int(block_mask_block_size), sinks, _pack_gqa_arg(pack_gqa))
        direct = _torch_ops.direct(*(a for a in args if isinstance(a, torch.Tensor)))
        out, lse = (_torch_ops._fwd_fp8 if direct else torch.ops.flashattn.fwd_fp8)(*args)
        return (out, lse, out.new_empty((0,))) if return_attn_probs else out
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, False,
                    _numpy_seed(dropout_p, seed), kernel, "auto", num_splits, block_mask, block_mask_block_size, sinks,
                    pack_gqa=pack_gqa)
    opts.num_threads = _resolve_threads(num_threads, False)
    out, lse = _fp8_forward(q, k, v, descales, opts)
    return (out, lse, np.empty((0,), dtype=out.dtype)) if return_attn_probs else out


# ---- flash_attn_combine, hadamard_rotate, plan ----------------------------------------------------------


def _dtype_code(dtype, tensors, name):
    """The native dtype name of a requested output dtype (torch's for tensors, NumPy's otherwise)."""
    if tensors:
        code = _TORCH_DTYPES.get(dtype)
    else:
        try:
            code = _NUMPY_DTYPES.get(np.dtype(dtype))
        except TypeError:
            code = None
    if code is None:
        raise TypeError(f"{name}: {dtype!r} is not an output dtype (float32, float16, bfloat16)")
    return code


def _check_writable(x, name, what="it is written in place"):
    """A read-only NumPy array (np.broadcast_to's views, a read-only memmap) where the call
    writes: named, before the native binding refuses it without a name."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name}: a read-only array, but {what}")


def _output_raw(x, name):
    """A zero-copy view of an output the caller passed (written in place, so never copied)."""
    _check_writable(x, name)
    if _is_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: only CPU tensors are supported, got device {x.device}")
        step = x.stride(-1) if x.dim() else 1
    elif isinstance(x, np.ndarray):
        step = x.strides[-1] // x.itemsize if x.ndim else 1
    else:
        raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    if step != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {step}")
    return _raw(x, name)


def _combine(out_partial, lse_partial, out, out_dtype, num_threads):
    """flash_attn_combine on raw views: (out (B, Sq, H, Dv), softmax_lse (B, H, Sq))."""
    tensors = _is_tensor(out_partial)
    if len(out_partial.shape) != 5:
        raise ValueError("out_partial: expected rank 5 (num_splits, batch, seqlen, heads, head_dim), got rank "
                         f"{len(out_partial.shape)}")
    splits, b, sq, h, dv = out_partial.shape
    if tuple(lse_partial.shape) != (splits, b, sq, h):
        raise ValueError(f"lse_partial: expected shape (num_splits, batch, seqlen, heads) = {(splits, b, sq, h)}, "
                         f"got {tuple(lse_partial.shape)}")
    outs, dt = _raw(out_partial, "out_partial")
    # Upstream's (splits, B, Sq, H) lse, seqlen-contiguous, is the native (splits, B, H, Sq) transposed.
    lses, ldt = _raw(lse_partial.transpose(-1, -2) if tensors else np.swapaxes(lse_partial, -1, -2), "lse_partial")
    for name, d in (("out_partial", dt), ("lse_partial", ldt)):
        if d != "f32":
            raise TypeError(f"{name}: dtype {d} but expected float32 (partial results are float32)")
    if out is not None:
        out_code = _dtype_of(out, "out")
        if out_dtype is not None and _dtype_code(out_dtype, tensors, "out_dtype") != out_code:
            raise TypeError(f"out: dtype {out_code} does not match out_dtype {out_dtype!r}")
        o, o_raw = out, _output_raw(out, "out")[0]
    else:
        out_code = "f32" if out_dtype is None else _dtype_code(out_dtype, tensors, "out_dtype")
        o, o_raw = _empty((b, sq, h, dv), out_code, out_partial)
    lse, lse_raw = _empty((b, h, sq), "f32", out_partial)
    _C.merge_attention_states(outs, lses, o_raw, lse_raw, out_code, int(num_threads))
    return o, lse


def _spans_overlap(a, b):
    """Whether two tensors' address spans (first to last element's bytes) intersect: the native
    call's test of an output against an input, so both routes refuse the same buffers."""
    def span(t):
        lo = hi = t.data_ptr()
        for size, stride in zip(t.shape, t.stride()):
            reach = (size - 1) * stride * t.element_size()
            lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
        return lo, hi + t.element_size()
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, *, num_threads=None):
    """Exact combination of partial attention results over disjoint key sets, as upstream FA3's:
    out_partial float32 (num_splits, B, Sq, H, Dv), each normalized; lse_partial float32
    (num_splits, B, Sq, H) (-inf: a split that saw no key) -> (out (B, Sq, H, Dv) of out_dtype
    (default float32, or out's), softmax_lse (B, Sq, H) float32, a transposed view of
    (B, H, Sq) as upstream's). out: written in place when given. num_threads as
    flash_attn_func's."""
    tensors = _is_tensor(out_partial)
    for name, x in (("lse_partial", lse_partial), ("out", out)):
        if x is not None and _is_tensor(x) != tensors:
            raise TypeError(f"inputs mix numpy arrays and torch tensors: out_partial, {name}")
    if not tensors:
        o, lse = _combine(out_partial, lse_partial, out, out_dtype, _resolve_threads(num_threads, False))
        return o, np.swapaxes(lse, 1, 2)
    code = (_dtype_of(out, "out") if out is not None and out_dtype is None
            else "f32" if out_dtype is None else _dtype_code(out_dtype, True, "out_dtype"))
    threads = _resolve_threads(num_threads, True) if num_threads else 0  # 0: resolved in the op, as fwd's
    if _torch_ops.direct(out_partial, lse_partial, out):
        o, lse = _combine(out_partial, lse_partial, out, out_dtype, _resolve_threads(threads, True))
    else:
        if out is not None:  # the direct path's checks (the native call's), before anything runs
            if out.device.type != "cpu":  # a meta tensor would take the copy and hold nothing
                raise ValueError(f"out: only CPU tensors are supported, got device {out.device}")
            if _dtype_of(out, "out") != code:
                raise TypeError(f"out: dtype {out.dtype} does not match out_dtype {out_dtype!r}")
            want = tuple(out_partial.shape[1:]) if out_partial.dim() == 5 else None
            if want is not None and tuple(out.shape) != want:
                raise ValueError(f"out: shape {tuple(out.shape)} but expected {want} (batch, seqlen_q, heads_q, "
                                 "head_dim_v)")
            if not torch.compiler.is_compiling() and any(_spans_overlap(out, x) for x in (out_partial, lse_partial)):
                raise ValueError("out: shares memory with out_partial or lse_partial (inputs are never modified; pass "
                                 "a separate buffer)")
        o, lse = torch.ops.flashattn.combine(out_partial, lse_partial, code, int(threads))
        if out is not None:
            out.copy_(o)
            o = out
    return o, lse.transpose(1, 2)


def hadamard_dim(head_dim: int) -> int:
    """The size hadamard_rotate pads rows of head_dim features to: the power of two >= head_dim."""
    return _C.hadamard_dim(_int_arg("head_dim", head_dim, 1, 2**63 - 1))


def hadamard_rotate(x, seed=0):
    """x R along the last dimension, R = H diag(signs) / sqrt(n) the random orthogonal rotation
    FlashAttention-3 applies to q and k before quantizing them to FP8 (H Sylvester-Hadamard,
    signs drawn from seed; the same seed for q and k keeps their products): x (B, S, H, D)
    float32, float16 or bfloat16 -> float32 (B, S, H, hadamard_dim(D)), x zero-padded to that
    size (then pass softmax_scale = 1 / sqrt(D) to attention, whose default would take the
    padded size)."""
    raw, dt = _raw(x, "x")
    if raw.ndim != 4:
        raise ValueError(f"x: expected rank 4 (batch, seqlen, heads, head_dim), got rank {raw.ndim}")
    b, s, h, d = raw.shape
    if d < 1:
        raise ValueError(f"x: head_dim must be at least 1, got shape {tuple(raw.shape)}")
    y, y_raw = _empty((b, s, h, hadamard_dim(d)), "f32", x)
    _C.hadamard_rotate(raw, y_raw, dt, int(seed) & ((1 << 64) - 1))
    return y


def plan(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
         alibi_slopes=None, deterministic=False, *, kernel="auto", backward_kernel="auto", num_threads=None,
         num_splits=0, block_mask=None, block_mask_block_size=0, pack_gqa=None):
    """The plans flash_attn_func and its backward run for these inputs and options, from the
    planner the library calls (plan_forward, plan_backward on CpuHardware::detect): a dict with
    "forward" (kernel, block_q, block_k, splits, heads_per_item (pack_gqa), work_items, threads,
    workspace bytes, ...),
    "backward" (kernel, block_q, block_k, kv_work_items, threads, workspace bytes, ...) and
    "problem" (the validated problem, described). Nothing is computed; inputs are validated as
    a call validates them (a kernel this CPU cannot run raises ValueError)."""
    window_size = _window_arg(window_size)
    raws, dts = _inputs(q=q, k=k, v=v)
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, None,
                    kernel, backward_kernel, num_splits, block_mask, block_mask_block_size, pack_gqa=pack_gqa)
    opts.num_threads = _resolve_threads(num_threads, _is_tensor(q))
    return _C.plan(raws["q"], raws["k"], raws["v"], dts, opts)


def simd_target() -> str:
    """The SIMD instruction set the CPU kernels dispatch to on this machine, e.g. 'AVX2'."""
    return _C.simd_target()


if torch is not None:
    if not hasattr(torch.library, "register_autograd"):
        raise ImportError(f"flashattn needs PyTorch >= 2.4 (torch.library custom ops), found {torch.__version__}; "
                          "upgrade it, or run without PyTorch importable for NumPy arrays only")
    from . import _torch_ops  # noqa: E402,F401  (registers the flashattn:: ops)
