"""flashattn.flex_attention and flashattn.create_block_mask: PyTorch's FlexAttention on the native core.

The user's mods are Python callables; the kernels never call them. They are evaluated here,
vectorised (torch.vmap over index tensors, as torch evaluates them), before the native call:

* mask_mod by create_block_mask, once per block mask: every BLOCK_SIZE x BLOCK_SIZE block of
  each (b, h) classified empty, partial or full (the native ScoreBlock), and the boolean
  content of the partial blocks kept, compactly (only those, with an index), so the kernels
  skip empty blocks, keep full ones without a lookup and read one byte per key elsewhere.
* score_mod by flex_attention, once per call: its operations on the score are checked to be
  affine (add, subtract, multiply or divide by what does not depend on the score, where and
  masked_fill on conditions that do not, floating casts) by running it once under a dispatch
  mode, then it is evaluated at scores 0 and 1 to give f(s) = a*s + c per score, a and c each
  stored only along the dims (b, h, q_idx, kv_idx) it depends on, only where not constant,
  and once per diagonal where it reads q_idx and kv_idx only through kv_idx - q_idx (relative
  position biases, ALiBi: Sq + Sk - 1 values, not Sq x Sk). The derivative of f is a: the
  backward needs nothing else. Soft-capping first — cap * tanh(score / cap), one constant
  cap — becomes the kernels' softcap, and what follows must be affine in it: f(s) =
  a*cap*tanh(s/cap) + c, evaluated at scores 0 and cap*atanh(1/2). Other score_mods raise
  NotImplementedError naming the operation.

The native hook (src/python/module.cpp, FlexHook) applies both per span of a score row, with
the GIL released. The ops flashattn::flex_fwd / flashattn::flex_bwd take the evaluated tensors,
so they have fake kernels and an autograd formula; flex_attention and create_block_mask
themselves run outside torch.compile's graph (the mods' evaluation checks data), which
graph-breaks around them. docs/python.md, "FlexAttention".
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from typing import Optional

import numpy as np

from . import _interface as _impl
from . import _sdpa

torch = _impl.torch
Tensor = torch.Tensor if torch is not None else np.ndarray  # the ops' schema reads the annotations

# Elements of one vmapped evaluation of a mod (bools, or float64 pairs for score_mod): bounds
# the temporaries, 2^22 float64 pairs being 64 MiB. Evaluations are split along q_idx.
_EVAL_ELEMENTS = 1 << 22

_BLOCK_EMPTY, _BLOCK_PARTIAL, _BLOCK_FULL = 0, 1, 2  # flashattn::ScoreBlock


def _need_torch(name):
    if torch is None:
        raise ImportError(f"flashattn.{name} needs PyTorch (its mods are evaluated with torch tensors)")


# ---- which indices a mod reads, and whether it is affine in the score ------------------------

# The index arguments, in the mods' order after the score: (b, h, q_idx, kv_idx).
_INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
_SCORE = 1 << 4  # the score's bit; bit d (0..3) is index d's
_UNIT = 1 << 5  # a score-dependent value that is score + (what does not depend on it), or -inf
_RAW = 1 << 6  # depends on the score other than through a soft-capping tanh
_CAPPED = 1 << 7  # depends on the score through tanh(score / cap)
_DIRECT = 1 << 8  # reads q_idx or kv_idx other than through their difference kv_idx - q_idx

# aten operations through which a value stays affine in the score (by their overload packet).
_AFFINE_UNARY = {"neg", "positive", "clone", "alias", "view", "_unsafe_view", "reshape", "expand", "squeeze",
                 "unsqueeze", "permute", "t", "transpose", "detach", "contiguous", "lift_fresh", "lift_fresh_copy",
                 "_to_copy", "to", "select", "slice", "broadcast_to", "expand_copy", "view_copy"}
_AFFINE_SUM = {"add", "sub", "rsub"}
# aten factories that read only their first (tensor) argument's shape, dtype and device, not its
# values: their result depends on no index and not on the score (torch.full_like(score, -inf),
# zeros_like(b)). The random ones (rand_like, ...) are left out: a mod is evaluated on copies of
# the inputs and at two scores, so random values would not be torch's anyway.
_FACTORIES = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
              "new_full", "new_empty_strided"}


def _affine_step(name, args, kwargs, on_score):
    """Why the aten operation `name`, some of whose inputs depend on the score, is not affine in
    it (None when it is); on_score(x): whether the argument x depends on the score."""
    score_args = [i for i, a in enumerate(args) if on_score(a)]
    score_kwargs = [k for k, a in kwargs.items() if on_score(a)]
    if name in _AFFINE_SUM:
        return f"{name} with a score-dependent {score_kwargs[0]}" if score_kwargs else None
    if name in _AFFINE_UNARY:
        dtype = kwargs.get("dtype")
        if name in ("_to_copy", "to") and dtype is not None and not dtype.is_floating_point:
            return f"a cast of the score to {dtype}"
        return None
    if name == "mul":
        return "a product of two score-dependent values" if len(score_args) + len(score_kwargs) > 1 else None
    if name == "div":
        if kwargs.get("rounding_mode") is not None:
            return f"div with rounding_mode={kwargs['rounding_mode']!r}"
        return None if score_args == [0] and not score_kwargs else "a division by a score-dependent value"
    if name == "where":
        return "where on a score-dependent condition" if 0 in score_args else None
    if name == "masked_fill":
        return None if score_args == [0] and not score_kwargs else "masked_fill with a score-dependent mask or value"
    return name


def _keeps_unit(name, args, kwargs, bits_of):
    """Whether the aten operation `name` gives score + (a score-independent value), or -inf,
    wherever its score-dependent inputs are such (their d/d score is 1, or they hide the key)."""
    def unit(x):
        return bool(bits_of(x) & _UNIT)

    def independent(x):
        return not bits_of(x) & _SCORE

    def neg_inf(x):  # a constant -inf: a float, or a tensor that depends on no index
        if isinstance(x, torch.Tensor):
            return bits_of(x) == 0 and bool((x == -math.inf).all())
        return isinstance(x, float) and x == -math.inf

    if name == "add":
        x, y = args[:2]
        return (unit(x) and independent(y)) or (independent(x) and unit(y) and kwargs.get("alpha", 1) == 1)
    if name == "sub":
        return unit(args[0]) and independent(args[1])
    if name in _AFFINE_UNARY and name != "neg":
        return unit(args[0])
    if name == "where":
        return all(unit(x) or neg_inf(x) for x in args[1:3])
    if name == "masked_fill":
        return unit(args[0]) and neg_inf(args[2])
    return False


def _is_difference(name, args, kwargs, pristine):
    """Whether the aten operation `name` subtracts the untouched q_idx and kv_idx inputs (ids in
    `pristine`) from each other, in either order, with no alpha: its result is a function of
    kv_idx - q_idx alone."""
    if name not in ("sub", "rsub") or len(args) < 2 or any(k != "alpha" for k in kwargs):
        return False
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    return alpha == 1 and {id(args[0]), id(args[1])} == set(pristine)


def _trace(fn, n_scores, mod_name, score=0.0):
    """Runs fn once on (1,)-shaped tensors — n_scores float64 scores of value `score`, then b, h,
    q_idx, kv_idx as int64 zeros — and returns (the bits of what its result depends on, why it
    is not affine in the score or None, whether its d/d score is 1 wherever it does not hide
    the key, the inputs of its tanh on the score, whether it reads q_idx and kv_idx only through
    kv_idx - q_idx). Tensors are followed by identity through a
    dispatch mode (every tensor made is kept alive meanwhile, so no id is reused); a result
    that is no tensor depends on nothing. tanh of the score times a constant (soft-capping)
    is taken as a new score: what follows must be affine in it, and the result may not depend
    on the score otherwise (_score_coefficients checks that the constant is one). q_idx and
    kv_idx are read "only through their difference" when every use of them is q_idx - kv_idx
    or kv_idx - q_idx on the inputs themselves (no view, no in-place change before): anything
    else marks the result _DIRECT, and the caller evaluates it over every (q_idx, kv_idx)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    bits, alive, reasons, tanh_inputs = {}, [], [], []

    def bits_of(x):
        return functools.reduce(operator.or_, (bits.get(id(t), 0) for t in tree_leaves(x)
                                               if isinstance(t, torch.Tensor)), 0)

    def capping(x):
        """Why tanh(x) is not soft-capping of the raw score, or None (x's value recorded)."""
        got = bits_of(x)
        if got & _CAPPED:
            return "tanh of a soft-capped score"
        if got & 0b1111:
            return ("tanh of a value that depends on " +
                    ", ".join(n for d, n in enumerate(_INDEX_NAMES) if got & (1 << d)) + " besides the score")
        tanh_inputs.append(float(x.item()))
        return None

    class Follow(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__.rstrip("_")
            # A factory's first argument gives only the shape, dtype and device of the result.
            dep = bits_of((args[1:] if name in _FACTORIES else args, kwargs)) & ~_UNIT
            mutable = func._schema.is_mutable
            if mutable:  # an index changed in place is no longer the index
                for t in tree_leaves((args, kwargs)):
                    pristine.pop(id(t), None)
            elif _is_difference(name, args, kwargs, pristine):
                dep &= ~_DIRECT
            if dep & _SCORE:
                if name == "tanh":
                    why = capping(args[0])
                    dep = dep & ~_RAW | _CAPPED
                else:
                    why = _affine_step(name, args, kwargs, lambda a: bool(bits_of(a) & _SCORE))
                if why is not None:
                    reasons.append(why)
                elif name != "tanh" and _keeps_unit(name, args, kwargs, bits_of):
                    dep |= _UNIT
            written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            for t in written:
                bits[id(t)] = dep
                alive.append(t)
            if mutable:  # the tensor written in place changed its views' values too
                storages = {t.untyped_storage().data_ptr() for t in written}
                for t in inputs + alive:
                    if t.untyped_storage().data_ptr() in storages and all(t is not w for w in written):
                        old = bits.get(id(t), 0)
                        bits[id(t)] = (old | dep) & ~_UNIT | (old & dep & _UNIT)
                        pristine.pop(id(t), None)
            return out

    inputs = [torch.full((1,), score, dtype=torch.float64) for _ in range(n_scores)]
    inputs += [torch.zeros(1, dtype=torch.int64) for _ in _INDEX_NAMES]
    for i, t in enumerate(inputs):
        bits[id(t)] = _SCORE | _UNIT | _RAW if i < n_scores else 1 << (i - n_scores)
    pristine = {id(t): t for t in inputs[n_scores + 2:]}  # q_idx and kv_idx, while untouched
    for t in pristine.values():
        bits[id(t)] |= _DIRECT
    with Follow():
        result = fn(*inputs)
    if isinstance(result, torch.Tensor) and result.requires_grad:
        raise NotImplementedError(f"{mod_name}: its result requires grad (it reads a tensor that does): flashattn "
                                  "evaluates the mods outside autograd, so only query, key and value get gradients; "
                                  "detach the tensor or run under torch.no_grad()")
    dep = bits_of(result)
    if dep & _RAW and dep & _CAPPED:
        reasons.append("the soft-capped score (tanh) combined with the score itself")
    relative = dep & 0b1100 == 0b1100 and not dep & _DIRECT
    return dep & 0b11111, (reasons[0] if reasons else None), bool(dep & _UNIT), tanh_inputs, relative


def _soft_cap(score_mod, name, inputs_at_zero):
    """The cap of score_mod's tanh(score / cap), or None without a tanh; NotImplementedError
    unless every tanh takes the score times one constant: its inputs are 0 at score 0 (no
    offset) and all equal at score 1 (1 / cap, the same cap, positive)."""
    if not inputs_at_zero:
        return None
    at_one = _trace(score_mod, 1, name, 1.0)[3]
    if any(x != 0.0 for x in inputs_at_zero):
        why = "tanh of the score plus an offset"
    elif len(set(at_one)) != 1:
        why = "tanh of the score scaled differently in two places"
    elif not 0.0 < at_one[0] < math.inf:
        why = f"tanh of the score times {at_one[0]!r} (soft-capping takes score / cap with cap > 0)"
    else:
        return 1.0 / at_one[0]
    raise NotImplementedError(f"{name}: not soft-capping ({why}); flashattn takes tanh only as "
                              "cap * tanh(score / cap) with one constant cap > 0, then operations affine in it")


def _evaluate(fn, prefix, sizes, dep, rows, q0, mod_name):
    """fn vmapped over (b, h, q_idx, kv_idx) — each read index of its size (q_idx from q0, `rows`
    of them), each unread one of size 1 — with `prefix` the leading arguments (0-d tensors:
    the score), each given as one copy per element, so that a mod may change it in place by a
    value that depends on an index (score.add_(bias[kv_idx])): a tensor of shape (1 or B,
    1 or H, rows or 1, 1 or KV)."""
    index = []
    for d, size in enumerate(sizes):
        if not dep & (1 << d):
            index.append(torch.zeros(1, dtype=torch.int64))
        elif d == 2:
            index.append(torch.arange(q0, q0 + rows, dtype=torch.int64))
        else:
            index.append(torch.arange(size, dtype=torch.int64))
    shape = tuple(len(i) for i in index)
    prefix = tuple(torch.full(shape, p.item(), dtype=p.dtype) for p in prefix)
    f = fn
    for d in reversed(range(4)):
        f = torch.vmap(f, in_dims=(0,) * len(prefix) + tuple(0 if e == d else None for e in range(4)))
    with torch.no_grad():
        out = f(*prefix, *index)
    return _one_per_element(out, shape, mod_name)


def _one_per_element(out, shape, mod_name):
    """out, the vmapped result of a mod over the (b, h, q_idx, kv_idx) batch `shape`; TypeError
    unless it is a tensor, ValueError unless the mod gave one value (a 0-d tensor) per element
    (a size-1 tensor is taken as one value)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{mod_name}: expected a tensor result, got {type(out).__name__}")
    if out.numel() != math.prod(shape):
        what = "bool (True keeps the key)" if mod_name.startswith("mask_mod") else "score"
        raise ValueError(f"{mod_name}: returned a value of shape {tuple(out.shape[len(shape):])} per element; "
                         f"it must return one {what} per element, a 0-d tensor for each (b, h, q_idx, kv_idx) "
                         "(it is evaluated with torch.vmap over them, as torch evaluates it)")
    return out


def _row_chunk(sizes, dep, per_element):
    """q_idx rows per evaluation, under _EVAL_ELEMENTS (at least one)."""
    others = 1
    for d in (0, 1, 3):
        if dep & (1 << d):
            others *= sizes[d]
    return max(1, _EVAL_ELEMENTS // (others * per_element))


# ---- the block mask --------------------------------------------------------------------------


class BlockMask:
    """FlexAttention's BlockMask, as flashattn.create_block_mask builds it: per (b, h), every
    BLOCK_SIZE x BLOCK_SIZE block of the (Q_LEN, KV_LEN) scores empty (skipped), partial
    (mask_mod's values kept, one byte per score) or full (kept without a look-up). torch's
    attribute names: shape (B, H, Q_LEN, KV_LEN), BLOCK_SIZE (Q, KV), seq_lengths, mask_mod,
    sparsity(), to_dense(). Block states are stored once along a dim mask_mod does not read
    (B, H None, or mask_mod independent of b, h)."""

    def __init__(self, states, partial_index, partial_blocks, shape, block_size, mask_mod):
        self._states = states                  # uint8 (B or 1, H or 1, q blocks, kv blocks): ScoreBlock
        self._partial_index = partial_index    # int32 like _states: the slot of a partial block, else -1
        self._partial_blocks = partial_blocks  # bool (slots, BLOCK_SIZE, BLOCK_SIZE): True keeps the key
        self.shape = tuple(shape)
        self.BLOCK_SIZE = (block_size, block_size)
        self.mask_mod = mask_mod
        self._reads = None  # bits 0, 1: whether mask_mod reads b, h (None: not traced yet)

    def _reads_index(self, d):
        """Whether mask_mod reads index d (0: b, 1: h); a BlockMask without one reads none."""
        if self._reads is None:
            name = f"mask_mod {getattr(self.mask_mod, '__name__', type(self.mask_mod).__name__)}"
            self._reads = 0 if self.mask_mod is None else _trace(self.mask_mod, 0, name)[0] & 0b11
        return bool(self._reads & (1 << d))

    @property
    def seq_lengths(self):
        return self.shape[2], self.shape[3]

    def _expanded_states(self):
        b, h = self.shape[:2]
        return self._states.expand(b, h, *self._states.shape[2:])

    def sparsity(self) -> float:
        """The percentage of blocks skipped (empty), over (B, H) as given."""
        return 100.0 * (self._states == _BLOCK_EMPTY).double().mean().item()

    def to_dense(self):
        """int32 (B, H, q blocks, kv blocks): 1 where a block is computed (partial or full), as
        torch's BlockMask.to_dense()."""
        return (self._expanded_states() != _BLOCK_EMPTY).to(torch.int32)

    def to_states(self):
        """uint8 (B, H, q blocks, kv blocks): 0 empty, 1 partial, 2 full (flashattn::ScoreBlock)."""
        return self._expanded_states().clone()

    def __repr__(self):
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, "
                f"partial_blocks={self._partial_blocks.shape[0]})")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _block_size_arg(block_size):
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2 or block_size[0] != block_size[1]:
            raise ValueError(f"BLOCK_SIZE: flashattn's blocks are square, got {tuple(block_size)!r}")
        block_size = block_size[0]
    return _positive_int("BLOCK_SIZE", block_size)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128):
    """torch.nn.attention.flex_attention.create_block_mask for flashattn.flex_attention.

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor (True keeps the key) is evaluated with
    torch.vmap over the indices it reads, BLOCK_SIZE rows of q at a time or more, and every
    block classified; partial blocks keep their content, so flex_attention never calls
    mask_mod. B, H None: one mask for every batch element / head (as torch). device: "cpu"."""
    _need_torch("create_block_mask")
    return _create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE)


def _create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE):
    if not callable(mask_mod):
        raise TypeError(f"mask_mod: expected a callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
    b = 1 if B is None else _positive_int("B", B)
    h = 1 if H is None else _positive_int("H", H)
    q_len, kv_len = _positive_int("Q_LEN", Q_LEN), _positive_int("KV_LEN", KV_LEN)
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: not a device ({e}), got {device!r}") from None
    if kind != "cpu":
        raise ValueError(f"device: flashattn runs on the CPU, got {device!r}")
    bs = _block_size_arg(BLOCK_SIZE)
    name = f"mask_mod {getattr(mask_mod, '__name__', type(mask_mod).__name__)}"
    sizes = (b, h, q_len, kv_len)
    dep = _trace(mask_mod, 0, name)[0]
    kv_blocks = -(-kv_len // bs)
    sb, sh = (b if dep & 1 else 1), (h if dep & 2 else 1)
    rows = max(1, _EVAL_ELEMENTS // (sb * sh * kv_blocks * bs * bs)) * bs
    states, index, blocks, slots = [], [], [], 0
    for q0 in range(0, q_len, rows):
        n = min(rows, q_len - q0)
        r = _evaluate(mask_mod, (), sizes, dep, n, q0, name)
        if r.dtype != torch.bool:
            raise TypeError(f"{name}: expected a bool tensor result (True keeps the key), got dtype {r.dtype}")
        r = r.reshape(sb, sh, n if dep & 4 else 1, kv_len if dep & 8 else 1).expand(sb, sh, n, kv_len)
        nb = -(-n // bs)
        kept = torch.zeros(sb, sh, nb * bs, kv_blocks * bs, dtype=torch.bool)
        kept[:, :, :n, :kv_len] = r
        tiles = kept.view(sb, sh, nb, bs, kv_blocks, bs)
        kept_count = tiles.sum(dim=(3, 5), dtype=torch.int32)
        rows_in = (n - torch.arange(nb, dtype=torch.int32) * bs).clamp(max=bs)  # the tail blocks are cut
        cols_in = (kv_len - torch.arange(kv_blocks, dtype=torch.int32) * bs).clamp(max=bs)
        full = kept_count == rows_in[:, None] * cols_in[None, :]
        st = torch.where(kept_count == 0, _BLOCK_EMPTY,
                         torch.where(full, _BLOCK_FULL, _BLOCK_PARTIAL)).to(torch.uint8)
        partial = st == _BLOCK_PARTIAL
        ix = torch.full(st.shape, -1, dtype=torch.int32)
        n_partial = int(partial.sum())
        ix[partial] = torch.arange(slots, slots + n_partial, dtype=torch.int32)
        blocks.append(tiles.permute(0, 1, 2, 4, 3, 5)[partial])
        states.append(st)
        index.append(ix)
        slots += n_partial
    states, index = torch.cat(states, dim=2), torch.cat(index, dim=2)
    blocks = torch.cat(blocks, dim=0) if slots else torch.zeros(0, bs, bs, dtype=torch.bool)
    mask = BlockMask(states, index, blocks.contiguous(), (b, h, q_len, kv_len), bs, mask_mod)
    mask._reads = dep & 0b11
    return mask


# ---- score_mod -------------------------------------------------------------------------------


def _compact(x):
    """x cut to size 1 along every dim along which it is constant (it broadcasts back to x)."""
    for d in range(x.dim()):
        if x.shape[d] > 1:
            first = x.narrow(d, 0, 1)
            if bool((x == first).all()):
                x = first
    return x.contiguous()


# The largest |c| of f(s) = a*s + c the kernels take: they add c * log2(e) in float32.
_C_LIMIT = _sdpa.LARGEST_SCALED


def _check_values(name, f0, f1, position):
    """(f0, the slope f1 − f0 (None for None)); where f0 and f1 are both finite and below
    -_C_LIMIT (a mask value such as torch.finfo(score.dtype).min, which the kernels cannot
    add), f0 is -_C_LIMIT and the slope 0 — as the SDPA path clamps attn_mask, such a key
    weighs nothing beside others and a row of only such keys weighs them alike, as torch's —
    and where f0 is -inf (a key hidden at every score) the slope is 0; ValueError unless every
    f0 is then -inf or finite of magnitude at most _C_LIMIT and every slope finite, naming the
    (b, h, q_idx, kv_idx) that position(index into f0) gives. Two reductions per tensor when
    all is well."""
    slope = None if f1 is None else f1 - f0
    lo, hi = (x.item() for x in torch.aminmax(f0))  # nan: the comparisons below fail
    if lo < -_C_LIMIT:
        below = (f0 < -_C_LIMIT) & (f0 != -math.inf)
        if f1 is not None:
            below &= (f1 < -_C_LIMIT) & (f1 != -math.inf)
            slope = slope.masked_fill(below, 0.0)
        f0 = f0.masked_fill(below, -_C_LIMIT)
        lo = torch.amin(f0).item()
    in_range = hi <= _C_LIMIT and (lo >= -_C_LIMIT or (
        lo == -math.inf and not bool(((f0 < -_C_LIMIT) & (f0 != -math.inf)).any())))
    if in_range and (slope is None or math.isfinite(slope.sum().item())):
        return f0, slope
    hidden = f0 == -math.inf
    bad = ~hidden & ~(f0.abs() <= _C_LIMIT)
    if slope is not None:
        slope.masked_fill_(hidden, 0.0)
        bad |= ~torch.isfinite(slope)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        got = f0[at].item() if f1 is None else (f0[at].item(), f1[at].item())
        raise ValueError(f"{name}: returned {got!r} at score {'0' if f1 is None else '(0, 1)'} for "
                         f"(b, h, q_idx, kv_idx) = {position(at)} (each 0 where score_mod "
                         f"does not read it): only -inf and finite values of magnitude up to {_C_LIMIT:.4g} "
                         "(float32's largest over log2(e)) are taken, and values below minus that (at every "
                         "score evaluated) as minus that")
    return f0, slope


class _Coefficient:
    """One coefficient of f(s) = a*s + c over the (B, Hq, Sq, Sk) scores, along the dims score_mod
    reads (`shape`), stored a chunk of q rows at a time. Where score_mod reads q_idx and kv_idx
    only through kv_idx - q_idx (relative position biases, ALiBi), one value per diagonal,
    shape (., ., 1, Sq + Sk - 1) with index kv_idx - q_idx + Sq - 1 — memory linear in the
    lengths; each chunk is checked to be so, and at the first one that is not, the whole
    (., ., Sq, Sk) is stored from there on (the rows before rebuilt from the diagonals)."""

    def __init__(self, shape, rows_before=0, value_before=None):
        self.shape = shape
        sq, sk = shape[2], shape[3]
        self.diagonal = shape[2] > 1 and shape[3] > 1  # Sq == 1 or Sk == 1: a plain broadcast already
        if self.diagonal:
            self.data = torch.empty(shape[0], shape[1], 1, sq + sk - 1, dtype=torch.float64)
        else:
            self.data = torch.empty(shape, dtype=torch.float32)
        self.first = sq + sk - 1  # the diagonals held so far: [first, Sq + Sk - 1)
        if rows_before:
            self._constant(rows_before, value_before)

    def _constant(self, rows, value):
        if self.diagonal:
            self.first = self.shape[2] - rows
            self.data[..., self.first:] = value
        else:
            self.data[:, :, :rows] = value

    def put(self, q0, x):
        """Rows q0.. (every row before them put already) of float64 x, (., ., n, Sk)."""
        n, sk = x.shape[2], x.shape[3]
        if self.diagonal:
            # The chunk's diagonals from its first column (bottom row up) and its first row.
            d = torch.cat([x[:, :, :, 0].flip(-1), x[:, :, 0, 1:]], dim=-1)
            at = torch.arange(sk).view(1, sk) - torch.arange(n).view(n, 1) + (n - 1)
            lo = self.shape[2] - q0 - n  # the chunk's first diagonal
            seen = self.data[:, :, 0, self.first:lo + d.shape[-1]]
            if torch.equal(d[..., at], x) and torch.equal(d[..., self.first - lo:], seen):
                self.data[:, :, 0, lo:lo + d.shape[-1]] = d
                self.first = lo
                return
            self._to_full(q0)
        self.data[:, :, q0:q0 + n] = x

    def _to_full(self, rows):
        sq, sk = self.shape[2], self.shape[3]
        full = torch.empty(self.shape, dtype=torch.float32)
        at = torch.arange(sk).view(1, sk) - torch.arange(rows).view(rows, 1) + (sq - 1)
        full[:, :, :rows] = self.data[:, :, 0][..., at]
        self.data, self.diagonal = full, False

    def result(self):
        return _compact(self.data.to(torch.float32))


def _score_coefficients(score_mod, sizes):
    """(a, c, softcap) with score_mod(s) = a*s + c at every score — or, where score_mod
    soft-caps the score first (cap * tanh(score / cap), then operations affine in that),
    score_mod(s) = a*cap*tanh(s/cap) + c and softcap = cap (0.0 without). a and c are float32
    tensors of rank 4 broadcastable to (B, Hq, Sq, Sk) — or, where score_mod reads q_idx and
    kv_idx only through their difference, of shape (., ., 1, Sq + Sk - 1) holding the value at
    kv_idx - q_idx + Sq - 1 (_Coefficient); a None where it is 1 everywhere, c None where it is
    0. Raises NotImplementedError for a score_mod that is neither. A score_mod that only adds
    to the score (biases, ALiBi, where/masked_fill with -inf) is evaluated once, at score 0;
    others also at a second score (1, or cap * atanh(1/2) with soft-capping) for a."""
    name = f"score_mod {getattr(score_mod, '__name__', type(score_mod).__name__)}"
    dep, why, unit, tanh_inputs, relative = _trace(score_mod, 1, name)
    if why is not None:
        raise NotImplementedError(
            f"{name}: not affine in the score ({why}); flashattn evaluates score_mod per block as a*score + c, "
            "so it takes sums, differences, products and quotients with score-independent values, where and "
            "masked_fill on score-independent conditions, and soft-capping cap * tanh(score / cap) before them")
    cap = _soft_cap(score_mod, name, tanh_inputs)
    # The second score f is evaluated at, and what f(probe) - f(0) is a times: with soft-capping
    # the kernel applies a * (cap * tanh(score / cap)) + c.
    probe = 1.0 if cap is None else cap * math.atanh(0.5)
    per_slope = 1.0 if cap is None else cap * math.tanh(probe / cap)
    shape = tuple(s if dep & (1 << d) else 1 for d, s in enumerate(sizes))
    if relative and shape[2] > 1 and shape[3] > 1:
        return _relative_coefficients(score_mod, name, shape, unit, cap, probe, per_slope)
    c = _Coefficient(shape)
    a, a_value = None, (1.0 if unit else None)  # a is stored once some slope differs from the first one
    rows = _row_chunk(sizes, dep, 1 if unit else 2) if dep & 4 else 1
    for q0 in range(0, shape[2], rows):
        n = min(rows, shape[2] - q0)
        def at_score(x):
            f = _evaluate(score_mod, (torch.tensor(x, dtype=torch.float64),), sizes, dep, n, q0, name)
            if not f.dtype.is_floating_point:
                raise TypeError(f"{name}: expected a floating result, got dtype {f.dtype}")
            return f.to(torch.float64).reshape(shape[0], shape[1], n, shape[3])

        f0, f1 = at_score(0.0), (None if unit else at_score(probe))
        f0, slope = _check_values(name, f0, f1, lambda at, q0=q0: (at[0], at[1], at[2] + q0, at[3]))
        if slope is not None and cap is not None:
            slope /= per_slope
        c.put(q0, f0)
        if slope is None:
            continue
        if a is None:
            a_value = slope.flatten()[0].item() if a_value is None else a_value
            lo, hi = torch.aminmax(slope)
            if lo.item() == a_value and hi.item() == a_value:
                continue
            a = _Coefficient(shape, q0, a_value)
        a.put(q0, slope)
    if a is None:
        a = None if a_value == 1.0 else torch.full((1, 1, 1, 1), a_value, dtype=torch.float32)
    else:
        a = a.result()
    c = c.result()
    return a, (None if c.numel() == 1 and c.item() == 0.0 else c), (0.0 if cap is None else cap)


def _relative_coefficients(score_mod, name, shape, unit, cap, probe, per_slope):
    """_score_coefficients for a score_mod that _trace showed to read q_idx and kv_idx only
    through kv_idx - q_idx: evaluated once per diagonal (Sq + Sk - 1 of them per (b, h) it
    reads), not per element, and held per diagonal."""
    sq, sk = shape[2], shape[3]
    diagonals = sq + sk - 1
    planes = shape[0] * shape[1]
    c = torch.empty(shape[0], shape[1], 1, diagonals, dtype=torch.float64)
    a = None if unit else torch.empty_like(c)
    chunk = max(1, _EVAL_ELEMENTS // (planes * (1 if unit else 2)))
    for t0 in range(0, diagonals, chunk):
        n = min(chunk, diagonals - t0)
        t = torch.arange(t0, t0 + n, dtype=torch.int64)
        q_idx, kv_idx = (sq - 1 - t).clamp(min=0), (t - (sq - 1)).clamp(min=0)  # each diagonal's first element

        def at_score(x):
            f = _evaluate_diagonals(score_mod, (torch.tensor(x, dtype=torch.float64),), shape, q_idx, kv_idx, name)
            if not f.dtype.is_floating_point:
                raise TypeError(f"{name}: expected a floating result, got dtype {f.dtype}")
            return f.to(torch.float64).reshape(shape[0], shape[1], 1, n)

        f0, f1 = at_score(0.0), (None if unit else at_score(probe))

        def position(at):
            return at[0], at[1], int(q_idx[at[3]]), int(kv_idx[at[3]])

        f0, slope = _check_values(name, f0, f1, position)
        c[..., t0:t0 + n] = f0
        if slope is not None:
            a[..., t0:t0 + n] = slope / per_slope if cap is not None else slope
    if a is not None:
        lo, hi = torch.aminmax(a)
        if lo.item() == hi.item():
            a = None if lo.item() == 1.0 else torch.full((1, 1, 1, 1), lo.item(), dtype=torch.float32)
        else:
            a = _compact(a.to(torch.float32))
    c = _compact(c.to(torch.float32))
    return a, (None if c.numel() == 1 and c.item() == 0.0 else c), (0.0 if cap is None else cap)


def _evaluate_diagonals(fn, prefix, shape, q_idx, kv_idx, mod_name):
    """fn vmapped over (b, h) — each read one of its size, each unread one of size 1 — and over
    the pairs (q_idx[t], kv_idx[t]) together, with `prefix` the leading arguments (0-d tensors:
    the score), each given as one copy per element as in _evaluate, so that a mod may change it
    in place by a value that depends on an index (score.add_(bias[kv_idx - q_idx])): a tensor
    of shape (1 or B, 1 or H, len(q_idx))."""
    b, h = (torch.arange(n, dtype=torch.int64) if n > 1 else torch.zeros(1, dtype=torch.int64) for n in shape[:2])
    batch = (len(b), len(h), len(q_idx))
    prefix = tuple(torch.full(batch, p.item(), dtype=p.dtype) for p in prefix)
    first = (0,) * len(prefix)
    f = torch.vmap(fn, in_dims=first + (None, None, 0, 0))
    f = torch.vmap(f, in_dims=first + (None, 0, None, None))
    f = torch.vmap(f, in_dims=first + (0, None, None, None))
    with torch.no_grad():
        out = f(*prefix, b, h, q_idx, kv_idx)
    return _one_per_element(out, batch, mod_name)


def _is_diagonal(x, sq, sk):
    """Whether coefficient x holds one value per diagonal (_Coefficient), not a broadcast."""
    return sq > 1 and sk > 1 and x.shape[2] == 1 and x.shape[3] == sq + sk - 1


def _native_coefficient(x, sq, sk):
    """x as the native hook reads it, a float32 array broadcastable to (B, Hq, Sq, Sk): one
    held per diagonal is viewed so, (q_idx, kv_idx) at element kv_idx - q_idx + Sq - 1 (a
    negative stride along q_idx), nothing copied."""
    a = x.numpy()
    if not _is_diagonal(x, sq, sk):
        return a
    step = a.strides[3]
    return np.lib.stride_tricks.as_strided(a[..., sq - 1:], shape=(a.shape[0], a.shape[1], sq, sk),
                                           strides=(a.strides[0], a.strides[1], -step, step))


# ---- flex_attention --------------------------------------------------------------------------


def _check(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not _impl._is_tensor(x):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected rank 4 (batch, heads, seqlen, head_dim), got shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"{name}: only CPU tensors are supported, got device {x.device}")
        if x.layout != torch.strided:
            raise TypeError(f"{name}: layout {x.layout} is not supported (dense, strided tensors only)")
        _impl._dtype_of(x, name)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod: expected a callable (score, b, h, q_idx, kv_idx) or None, got "
                        f"{type(score_mod).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if kernel_options is not None:
        raise ValueError(f"kernel_options: flashattn's CPU kernels take none, got {kernel_options!r}")
    _sdpa.check_layout(query, key, value, scale, enable_gqa)
    b, hq, sq, _ = query.shape
    sk = key.shape[2]
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a flashattn.BlockMask (from flashattn.create_block_mask), got "
                        f"{type(block_mask).__module__}.{type(block_mask).__name__}; build it with "
                        "flashattn.create_block_mask(block_mask.mask_mod, ...)")
    mb, mh, mq, mk = block_mask.shape
    if (mq, mk) != (sq, sk) or mb not in (1, b) or mh not in (1, hq):
        raise ValueError(f"block_mask: built for (B, H, Q_LEN, KV_LEN) = {block_mask.shape}, which does not fit "
                         f"query and key's ({b}, {hq}, {sq}, {sk}) (B and H may be 1)")
    for d, (arg, index, built, size) in enumerate((("B", "b", mb, b), ("H", "h", mh, hq))):
        if built == 1 < size and block_mask._reads_index(d):
            raise ValueError(f"block_mask: built with {arg} = 1 (or None), so its mask_mod was evaluated at {index} = 0 "
                             f"only, but mask_mod reads {index} and query has {size} of them; build it with "
                             f"create_block_mask(mask_mod, ..., {arg}={size}, ...) (torch's eager flex_attention "
                             f"calls mask_mod with every {index})")


def _mods(score_mod, block_mask, sizes):
    """The op arguments that carry the evaluated mods: block states, partial index, partial
    blocks, block size, a, c, softcap."""
    a, c, softcap = (None, None, 0.0) if score_mod is None else _score_coefficients(score_mod, sizes)
    if block_mask is None:
        return None, None, None, 0, a, c, softcap
    return (block_mask._states, block_mask._partial_index, block_mask._partial_blocks, block_mask.BLOCK_SIZE[0],
            a, c, softcap)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None):
    """torch.nn.attention.flex_attention.flex_attention on flashattn's CPU kernels.

    query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv), torch
    CPU tensors (float32, float16, bfloat16). score_mod(score, b, h, q_idx, kv_idx) must be
    affine in the score, or in cap * tanh(score / cap) (soft-capping; NotImplementedError
    otherwise); block_mask from
    flashattn.create_block_mask. scale: default 1/sqrt(D). enable_gqa: Hq a multiple of Hkv.
    return_lse: also the log-sum-exp (B, Hq, Sq), float32, natural log. Gradients of query, key
    and value through autograd, of the output and of lse (a loss on lse, such as a z-loss)."""
    _need_torch("flex_attention")
    return _flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options)


def _flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options):
    _check(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options)
    b, hq, sq, _ = query.shape
    mods = _mods(score_mod, block_mask, (b, hq, sq, key.shape[2]))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    args = (q, k, v, None if scale is None else float(scale), *mods, 0)
    direct = _impl._torch_ops.direct(q, k, v)
    out, lse = (_flex_fwd if direct else torch.ops.flashattn.flex_fwd)(*args)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _check_mods(q, k, score_a, score_c):
    """What the native hook reads without bounds checks, checked against q, k (B, S, H, D): a
    and c float32 broadcastable to (B, Hq, Sq, Sk). (The native side checks the block states,
    every partial block's slot and the partial blocks' shape.)"""
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    for name, x in (("score_a", score_a), ("score_c", score_c)):
        if x is not None and (x.dtype != torch.float32 or x.dim() != 4
                              or any(n not in (1, f) for n, f in zip(x.shape[:2], full))
                              or not (_is_diagonal(x, *full[2:])
                                      or all(n in (1, f) for n, f in zip(x.shape[2:], full[2:])))):
            raise ValueError(f"{name}: expected float32 broadcastable to (B, Hq, Sq, Sk) = {full} or of shape "
                             f"(B or 1, Hq or 1, 1, Sq + Sk - 1) = one value per diagonal, got "
                             f"{x.dtype} {tuple(x.shape)}")


def _opts(q, k, scale, block_states, partial_index, partial_blocks, block_size, score_a, score_c, softcap,
          num_threads):
    o = _impl._options(0.0, scale, False, (-1, -1), softcap, None, False, None)
    if block_states is not None:
        o.flex_block_states = block_states.numpy()
        o.flex_partial_index = partial_index.numpy()
        o.flex_partial_blocks = partial_blocks.view(torch.uint8).numpy()
        o.flex_block_size = int(block_size)
        # The native side refines the blocks for the kernels over this call's (Sq, Sk).
        o.flex_seqlen_q, o.flex_seqlen_k = int(q.shape[1]), int(k.shape[1])
    sq, sk = int(q.shape[1]), int(k.shape[1])
    if score_a is not None:
        o.flex_score_a = _native_coefficient(score_a, sq, sk)
    if score_c is not None:
        o.flex_score_c = _native_coefficient(score_c, sq, sk)
    o.num_threads = _impl._resolve_threads(num_threads, True)
    return o


def _flex_fwd(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], block_states: Optional[Tensor],
              partial_index: Optional[Tensor], partial_blocks: Optional[Tensor], block_size: int,
              score_a: Optional[Tensor], score_c: Optional[Tensor], softcap: float,
              num_threads: int) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, Dv) and softmax_lse (B, Hq, Sq) float32 of (B, S, H, D) views."""
    _check_mods(q, k, score_a, score_c)
    o = _opts(q, k, scale, block_states, partial_index, partial_blocks, block_size, score_a, score_c, softcap,
              num_threads)
    out, lse, _ = _impl._forward(q, k, v, o, False)
    return out, lse


def _flex_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
              scale: Optional[float], block_states: Optional[Tensor], partial_index: Optional[Tensor],
              partial_blocks: Optional[Tensor], block_size: int, score_a: Optional[Tensor],
              score_c: Optional[Tensor], softcap: float, num_threads: int,
              dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (B, S, H, D) of sum(dout * out) + sum(dlse * softmax_lse); P is recomputed
    from softmax_lse."""
    _check_mods(q, k, score_a, score_c)
    o = _opts(q, k, scale, block_states, partial_index, partial_blocks, block_size, score_a, score_c, softcap,
              num_threads)
    if dlse is not None:
        o.dlse = dlse.numpy()
    return _impl._backward(dout, q, k, v, out, softmax_lse, o)


if torch is not None:
    create_block_mask = torch.compiler.disable(create_block_mask)
    flex_attention = torch.compiler.disable(flex_attention)

    flex_fwd = torch.library.custom_op("flashattn::flex_fwd", _flex_fwd, mutates_args=())
    flex_bwd = torch.library.custom_op("flashattn::flex_bwd", _flex_bwd, mutates_args=())

    _impl._torch_ops.register_fake(flex_fwd, _flex_fwd, _sdpa.SDPA_NAMES)(_sdpa.fake_out_lse)

    @_impl._torch_ops.register_fake(flex_bwd, _flex_bwd, _sdpa.SDPA_NAMES)
    def _(dout, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    _MOD_ARGS = ("block_states", "partial_index", "partial_blocks", "score_a", "score_c")

    def _setup(ctx, inputs, output):
        q, k, v, scale, states, index, blocks, block_size, a, c, softcap, num_threads = inputs
        mods = dict(zip(_MOD_ARGS, (states, index, blocks, a, c)))
        ctx.present = tuple(n for n in _MOD_ARGS if mods[n] is not None)
        ctx.options = (scale, block_size, softcap, num_threads)
        ctx.save_for_backward(q, k, v, *output, *(mods[n] for n in ctx.present))

    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mods = dict.fromkeys(_MOD_ARGS)
        mods.update(zip(ctx.present, rest))
        scale, block_size, softcap, num_threads = ctx.options
        dq, dk, dv = torch.ops.flashattn.flex_bwd(dout.to(q.dtype), q, k, v, out, lse, scale, mods["block_states"],
                                                  mods["partial_index"], mods["partial_blocks"], block_size,
                                                  mods["score_a"], mods["score_c"], softcap, num_threads,
                                                  None if dlse is None else dlse.to(torch.float32).contiguous())
        return dq, dk, dv, None, None, None, None, None, None, None, None, None

    torch.library.register_autograd("flashattn::flex_fwd", _backward, setup_context=_setup)
