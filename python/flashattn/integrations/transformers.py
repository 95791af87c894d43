"""flashattn as a Hugging Face transformers attention backend.

    from flashattn.integrations.transformers import ATTN_IMPLEMENTATION, register

    register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION)

``register()`` adds two functions under one name: the attention function (transformers'
``AttentionInterface``) and the mask function (``AttentionMaskInterface``) that the model's
mask utilities call instead of building a 4-d mask. The mask function takes exactly the
pattern the model asks for (causal or bidirectional, padding, sliding window, cache offsets,
any overlay a model adds) and expresses it as what flashattn computes: either a dense batch,
or a variable-length batch of the tokens left after removing padding (``cu_seqlens``, as
transformers' own flash-attention path does), each with one ``causal`` flag and one
``window_size`` in flashattn's bottom-right-aligned convention. Sequences packed in one row
(``position_ids`` restarting at 0 without an attention mask: padding-free training batches)
and chunked attention (Llama 4: causal within chunks) are sequences of that batch too. The
offsets ``cu_seq_lens_q/k`` and ``max_length_q/k`` of transformers' padding-free collator cut
the row into sequences as its flash-attention path does (where ``position_ids`` restart too,
the sequences must be the same; a dense mask is cut to them). Any other pattern (a prefix-LM
overlay, rows with gaps, a mask per head, a caller's attention bias) runs as a dense
``attn_mask`` of flashattn's ``scaled_dot_product_attention``, as transformers' SDPA path runs
it, and so does T5's relative position bias (``position_bias``, with the mask applied to it as
that path applies it, differentiable): nothing is approximated. Under ``torch.compile``
planning cannot read a mask's values, so a mask made inside the compiled region, or a 4-d mask
passed in, runs as that dense ``attn_mask`` (a custom op with fake kernels: ``fullgraph=True``
compiles); plans made outside it (``generate()``'s static-cache masks) run as they are.

Under a causal or windowed mask, outputs at padding positions are 0 (as in transformers'
flash-attention path): queries on padding tokens are left out, since no real token sees them.
Under a bidirectional mask every query row is computed against its batch element's real keys,
as SDPA computes it: its queries may be another sequence's tokens (cross-attention from a
decoder to a padded encoder's states). A decode step of a left-padded batch reads the KV cache
in place (``flash_attn_with_kvcache`` with ``cache_leftpad``) when no gradient is needed.
Refused with ValueError naming the argument: ``output_attentions=True``, an argument named
``sinks``, a paged cache (``block_table``), head masks, and a model that uses the mask as a
tensor in attention of its own (BLOOM, MPT, Falcon with ALiBi). gpt-oss's attention sinks
(``s_aux``, one logit per q head in every row's softmax denominator) are taken, as flashattn's
``learnable_sink``, with their gradient, and Gemma 2's ``softcap``, on every route (the dense
``attn_mask`` one included, so both models compile).

Where the model passes no mask, the module's ``is_causal`` (or the ``is_causal`` argument) and
``sliding_window`` decide, as in transformers' flash-attention path: a causal window of
``sliding_window`` tokens is the token itself and the ``sliding_window - 1`` before it.

The name has no "flash" in it: transformers 5 reads any implementation name containing
"flash" as a request for a FlashAttention package or a Hub kernel. Written against the mask
utilities (transformers.masking_utils) of transformers 5.24.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .. import _interface as _impl

ATTN_IMPLEMENTATION = "fa_cpu"

# Arguments some models pass to the attention function that change what it computes and that
# flashattn does not take (sinks of unknown semantics, head masks, paged caches).
_REFUSED = ("sinks", "head_mask", "indices", "block_indices", "block_table")
# transformers' padding-free batches (DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
# the sequences' offsets in the one packed row, as its flash-attention path takes them.
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_PACKED_SET = frozenset(_PACKED)
_REFUSED_SET = frozenset(_REFUSED)

# Rows of a materialized mask checked at a time (bounds the checker's memory at long lengths).
_ROW_CHUNK = 1024


def _used_as_tensor(what):
    return (f"attention_mask: the model used the {ATTN_IMPLEMENTATION!r} mask plan as a tensor ({what}): its attention "
            "does not go through transformers' attention interface (BLOOM, MPT and Falcon with ALiBi add their bias "
            "to the mask themselves); load it with attn_implementation='sdpa' or 'eager'")


class _PlanUsedAsTensor(ValueError, AttributeError):
    """A tensor's attribute asked of a _Plan: a ValueError for the caller, an AttributeError
    for hasattr and getattr with a default."""


class _Plan:
    """One attention call in flashattn's terms, for a (batch, q_length, kv_length) problem.

    Dense: every query row of the batch is computed against keys[k0:k1]. Varlen: only the rows
    in q_index and the keys in k_index (flat indices into batch * length) take part, packed by
    cu_seqlens; the other rows of the output are 0 (they are padding: no key is visible). Cache:
    for one query per batch element over keys [leftpad, seqlens) of each row (a decode step of
    a left-padded batch), the same computation read in place by flash_attn_with_kvcache. Dense
    attn_mask: a mask none of those express (rows with gaps, masks that differ between heads,
    attention biases), computed exactly by flashattn's SDPA with it (B or 1, Hq or 1, Sq, Sk)."""

    __slots__ = ("batch", "q_length", "kv_length", "causal", "window", "keys", "varlen", "cache", "dense",
                 "bool_mask")
    # transformers' mask utilities take a plan made ahead of the forward (generate() does so for
    # static caches) for a prepared 4-d mask and hand it back to attention_mask_function.
    ndim = 4

    @property
    def shape(self):
        return (self.batch, 1, self.q_length, self.kv_length)

    def __init__(self, batch, q_length, kv_length, causal, window, keys=None, varlen=None, cache=None, dense=None):
        self.batch, self.q_length, self.kv_length = int(batch), int(q_length), int(kv_length)
        self.causal, self.window = bool(causal), (int(window[0]), int(window[1]))
        self.keys = (0, self.kv_length) if keys is None else keys
        self.varlen, self.cache, self.dense = varlen, cache, dense
        # () -> transformers' own bool mask (batch or 1, 1, q_length, kv_length) that this plan
        # computes, materialized only when asked (T5's position_bias needs it); None: unknown.
        self.bool_mask = None

    def __getattr__(self, name):  # only names the plan lacks: a tensor's (dtype, to, ...)
        raise _PlanUsedAsTensor(_used_as_tensor(f"attribute {name!r}"))

    def __getitem__(self, index):  # a model slicing the mask (attention_mask[:, 0]) before the interface
        raise _PlanUsedAsTensor(_used_as_tensor("indexing"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise ValueError(_used_as_tensor(getattr(func, "__name__", repr(func))))

    def __repr__(self):
        kind = ("in place over the cache" if self.cache is not None else "varlen" if self.varlen is not None
                else "as a dense attn_mask" if self.dense is not None else f"dense keys[{self.keys[0]}:{self.keys[1]}]")
        return (f"flashattn mask plan (batch {self.batch}, q_length {self.q_length}, kv_length {self.kv_length}, "
                f"{kind}, causal={self.causal}, window_size={self.window})")


def _plan_from_bool(mask):
    """A _Plan computing exactly the bool mask (batch, q_length, kv_length), True = attend.

    Rows that see no key are padding; keys that no row sees are dropped. What remains is cut
    into segments: a row whose keys all come after every earlier row's starts one (the next
    document of a packed batch, the next chunk of chunked attention), and each segment is one
    sequence of a variable-length batch. In every segment each row must see one band
    j - i - (n_k - n_q) in [-left, right] of the segment's keys (bottom-right aligned, -1
    unbounded), with the same (left, right) everywhere. Checked from each row's first and last
    key and count: count = last - first + 1 among the kept keys makes the row one interval,
    which must then be the band's."""
    batch, q_length, kv_length = mask.shape
    raw = mask.view(torch.uint8)
    count, first, last = (torch.empty(batch, q_length, dtype=torch.long) for _ in range(3))
    for r0 in range(0, q_length, _ROW_CHUNK):
        chunk = raw[:, r0:r0 + _ROW_CHUNK]
        count[:, r0:r0 + _ROW_CHUNK] = chunk.sum(-1, dtype=torch.int32)
        first[:, r0:r0 + _ROW_CHUNK] = chunk.argmax(-1)  # the first True of each row
        last[:, r0:r0 + _ROW_CHUNK] = kv_length - 1 - chunk.flip(-1).argmax(-1)
    rows, cols = count > 0, mask.any(-2)
    n_q, n_k = rows.sum(-1), cols.sum(-1)
    ck = cols.cumsum(-1) - 1  # index of each kept key among the kept keys of its batch element
    first_c, last_c = torch.gather(ck, 1, first), torch.gather(ck, 1, last)
    if not bool((~rows | (last_c - first_c + 1 == count)).all()):
        raise ValueError("attention_mask: a query row sees keys with gaps between them (not padding): no band "
                         "plan expresses it")
    if not bool(rows.any()):  # no row sees a key: every output row is 0
        empty, cu = torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32)
        return _Plan(batch, q_length, kv_length, False, (-1, -1), varlen=(empty, empty, cu, cu, 0, 0))
    # Segments: the rows from one whose first key follows every earlier row's last key.
    earlier_last = F.pad(torch.where(rows, last_c, -1).cummax(-1).values[:, :-1], (1, 0), value=-1)
    starts = rows & (first_c > earlier_last)
    segment = (starts.flatten().cumsum(0) - 1).view(batch, q_length)  # over the whole batch, rows in order
    segments = int(starts.sum())
    seg_rows = segment[rows]
    n_q_seg = torch.bincount(seg_rows, minlength=segments)
    seg_first = first_c[starts]  # in kept keys, batch element by batch element
    seg_last = torch.full((segments,), -1, dtype=torch.long).scatter_reduce(0, seg_rows, last_c[rows], "amax")
    n_k_seg = seg_last - seg_first + 1
    s = segment.clamp(min=0)  # rows' segments (padding rows: any, they are masked out below)
    position = rows.flatten().cumsum(0).view(batch, q_length) - 1  # index among the batch's rows
    row_in_segment = position - F.pad(n_q_seg.cumsum(0), (1, 0))[s]
    diagonal = row_in_segment + (n_k_seg - n_q_seg)[s] + seg_first[s]  # bottom-right aligned, in kept keys
    # A row whose band is cut by its segment's first (last) key says nothing about left (right).
    cut_left, cut_right = rows & (first_c > seg_first[s]), rows & (last_c < seg_last[s])
    left = int((diagonal - first_c)[cut_left].max()) if bool(cut_left.any()) else -1
    right = int((last_c - diagonal)[cut_right].max()) if bool(cut_right.any()) else -1
    if (bool(cut_left.any()) and left < 0) or (bool(cut_right.any()) and right < 0):
        raise ValueError(f"attention_mask: a query row that does not see its own diagonal (window ({left}, "
                         f"{right}) in flashattn's bottom-right convention) cannot be expressed")
    lo = torch.maximum(diagonal - left, seg_first[s]) if left >= 0 else seg_first[s]
    hi = torch.minimum(diagonal + right, seg_last[s]) if right >= 0 else seg_last[s]
    wrong = rows & ((first_c != lo) | (last_c != hi))
    if bool(wrong.any()):
        b, r = (int(x) for x in wrong.nonzero()[0])
        raise ValueError(
            f"attention_mask: row {r} of batch element {b} is not a padding mask combined with one causal or "
            f"sliding window band (window ({left}, {right}) in flashattn's bottom-right convention fits the other "
            "rows), in one sequence or in each of packed ones: no band plan expresses it")
    causal = right == 0
    if segments == batch and bool(rows.all()) and bool((cols == cols[:1]).all()):
        idx = cols[0].nonzero().flatten()
        k0, k1 = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
        if k1 - k0 == idx.numel():
            return _Plan(batch, q_length, kv_length, causal, (left, right), keys=(k0, k1))
    cu_q = F.pad(n_q_seg.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = F.pad(n_k_seg.cumsum(0), (1, 0)).to(torch.int32)
    varlen = (rows.flatten().nonzero().flatten(), cols.flatten().nonzero().flatten(), cu_q, cu_k,
              int(n_q_seg.max()), int(n_k_seg.max()))
    cache = None
    if segments == batch and q_length == 1 and bool(rows.all()) and bool((n_k == last[:, 0] - first[:, 0] + 1).all()):
        cache = (first[:, 0].to(torch.int32), (last[:, 0] + 1).to(torch.int32))
    return _Plan(batch, q_length, kv_length, causal, (left, right), varlen=varlen, cache=cache)


def _plan_from_padding(padding, causal, window):
    """The varlen _Plan of a prompt (queries = keys, no offsets) whose padding mask (batch, length)
    leaves one contiguous run of real tokens in every row (left or right padding), for the
    pattern (causal, window) among the real tokens: what _plan_from_bool makes of the
    materialized mask, found in O(batch * length) instead of O(batch * length²). None where a
    row has no real token or a gap between real tokens (the general check decides those)."""
    batch, length = padding.shape
    real = padding.to(torch.bool)
    n = real.sum(-1)
    first = real.to(torch.uint8).argmax(-1)
    last = length - 1 - real.flip(-1).to(torch.uint8).argmax(-1)
    if not bool(((n > 0) & (last - first + 1 == n)).all()):
        return None
    index = real.flatten().nonzero().flatten()
    cu = F.pad(n.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(n.max())
    return _Plan(batch, length, length, causal, window, varlen=(index, index, cu, cu, longest, longest))


def _plan_from_key_padding(real_keys, q_length):
    """The varlen _Plan of a bidirectional mask over the keys real_keys (batch, kv_length)
    marks: every query row sees the same keys — an encoder's, or a cross-attention's, whose
    queries are not the padded sequence's tokens — so every row is computed, as SDPA computes
    it, against its batch element's real keys (none: out 0)."""
    batch, kv_length = real_keys.shape
    real = real_keys.to(torch.bool)
    n_k = real.sum(-1)
    cu_q = torch.arange(0, (batch + 1) * q_length, q_length, dtype=torch.int32)
    cu_k = F.pad(n_k.cumsum(0), (1, 0)).to(torch.int32)
    varlen = (torch.arange(batch * q_length), real.flatten().nonzero().flatten(), cu_q, cu_k, q_length,
              int(n_k.max()))
    return _Plan(batch, q_length, kv_length, False, (-1, -1), varlen=varlen)


def _sliding_window_of(mask_function, masking_utils):
    """w when mask_function is transformers' sliding_window_causal_mask_function(w) unchanged (an
    and_masks of its sliding_window_overlay(w) and causal_mask_function), else None."""
    def cells(fn):
        names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
        return dict(zip(names, (c.cell_contents for c in fn.__closure__ or ())))

    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = cells(mask_function).get("mask_functions")
    if (not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not masking_utils.causal_mask_function
            or getattr(parts[0], "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask"
            or getattr(parts[0], "__module__", "") != masking_utils.__name__):
        return None
    window = cells(parts[0]).get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None


def attention_mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                            attention_mask=None, use_vmap=False, device="cpu", **kwargs):
    """The AttentionMaskInterface function: a _Plan instead of a 4-d mask.

    The plain patterns (causal or sliding-window causal with the queries ending where the
    keys end, or bidirectional, without padding) are planned from their arguments; anything
    else is materialized as transformers' own bool mask (what eager and SDPA would use) and
    checked exactly."""
    from transformers import masking_utils

    if isinstance(attention_mask, _Plan):
        if attention_mask.shape != (batch_size, 1, q_length, kv_length):
            raise ValueError(f"attention_mask: {attention_mask} does not match this forward (batch {batch_size}, "
                             f"q_length {q_length}, kv_length {kv_length})")
        return attention_mask

    def materialize():  # transformers' own bool mask (batch or 1, 1, q_length, kv_length)
        return masking_utils.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)

    if torch.compiler.is_compiling():  # planning reads the mask's values: the dense mask, traced as SDPA's
        return _Plan(batch_size, q_length, kv_length, False, (-1, -1), dense=materialize())
    # materialize may run after this call returns (bool_mask: position_bias models): with the
    # offsets as they are now — generate() on a static cache moves its 0-d cache_position on
    # in place before the plan is used, and the mask built then let a query see the next,
    # unwritten slot.
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    plan = _plan_for(masking_utils, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                     attention_mask, materialize)
    plan.bool_mask = materialize
    return plan


def _plan_for(masking_utils, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
              materialize):
    padding = None
    if attention_mask is not None:
        padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, int(kv_offset))
    if padding is None or bool(padding[:, int(kv_offset):int(kv_offset) + kv_length].all()):
        if mask_function is masking_utils.bidirectional_mask_function:
            return _Plan(batch_size, q_length, kv_length, False, (-1, -1))
        if int(q_offset) + q_length == int(kv_offset) + kv_length:
            if mask_function is masking_utils.causal_mask_function:
                return _Plan(batch_size, q_length, kv_length, True, (-1, 0))
            window = _sliding_window_of(mask_function, masking_utils)
            if window is not None:  # keys kv > q - window: the query's and the window - 1 before
                return _Plan(batch_size, q_length, kv_length, True, (window - 1, 0))
    if padding is not None and mask_function is masking_utils.bidirectional_mask_function:
        return _plan_from_key_padding(padding[:, int(kv_offset):int(kv_offset) + kv_length], q_length)
    if padding is not None and int(q_offset) == int(kv_offset) == 0 and 1 < q_length == kv_length == padding.shape[-1]:
        if mask_function is masking_utils.causal_mask_function:
            band = (True, (-1, 0))
        else:
            window = _sliding_window_of(mask_function, masking_utils)
            band = None if window is None else (True, (window - 1, 0))
        plan = None if band is None else _plan_from_padding(padding, *band)
        if plan is not None:
            return plan
    mask = full = materialize()
    mask = mask.expand(batch_size, 1, q_length, kv_length)[:, 0]
    q0 = int(q_offset)
    if padding is not None and q0 + q_length <= padding.shape[-1] and not bool((mask == mask[:, :1]).all()):
        # Rows that see different keys (causal, windows) are self-attention: query i is token
        # q0 + i of the padded sequence. One on a padding token (right padding, as in training
        # batches) sees keys, but no real token sees it, so its output reaches nothing: it is
        # left out (0, as in transformers' flash-attention path) and the real rows keep one
        # bottom-right band. Rows that all see the same keys are computed as they are: their
        # queries may be another sequence's tokens (cross-attention to a padded encoder).
        mask = mask & padding[:, q0:q0 + q_length, None].to(torch.bool)
    return _plan_or_dense(mask, full)


def _plan_or_dense(mask, full):
    """_plan_from_bool(mask), or where no band plan expresses it, the dense plan of `full`
    (batch or 1, heads or 1, q_length, kv_length): transformers' own mask, bool or additive."""
    try:
        return _plan_from_bool(mask)
    except ValueError:
        return _Plan(mask.shape[0], mask.shape[1], mask.shape[2], False, (-1, -1), dense=full)


def _plan_from_tensor(mask, batch, q_length, kv_length):
    """A _Plan for a 4-d mask tensor a model or its caller built itself: bool, or additive
    float — 0 for attend and the dtype's minimum or -inf for masked planned as a bool mask, any
    other values (an attention bias) and masks that differ between heads as a dense attn_mask.
    A row at the minimum on every key then sees no key (out 0, as transformers' flash-attention
    path gives padding rows; SDPA and eager weigh its keys alike)."""
    if mask.dim() != 4 or mask.shape[-2:] != (q_length, kv_length) or mask.shape[0] not in (1, batch):
        raise ValueError(f"attention_mask: expected a plan from this backend's mask function or a 4-d mask "
                         f"({batch} or 1, heads or 1, {q_length}, {kv_length}), got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attention_mask: dtype {mask.dtype} is neither bool nor floating point")
    dense = _Plan(batch, q_length, kv_length, False, (-1, -1), dense=mask)
    if torch.compiler.is_compiling() or not bool((mask == mask[:, :1]).all()):  # planning reads its values
        return dense
    visible = mask[:, 0]
    if mask.dtype != torch.bool:
        blocked = visible <= torch.finfo(mask.dtype).min
        if not bool((blocked | (visible == 0)).all()):
            return dense
        visible = ~blocked
    return _plan_or_dense(visible.expand(batch, q_length, kv_length).contiguous(), mask)


def _layer_causal(module, is_causal):
    """Whether a layer called without a mask is causal: its is_causal argument, else the
    module's attribute, else causal (transformers' rule)."""
    return is_causal if is_causal is not None else getattr(module, "is_causal", True)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """The AttentionInterface function: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) from the
    model (rotary already applied, keys from the cache included) -> ((B, Sq, Hq, Dv), None)."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"output_attentions=True: attn_implementation={ATTN_IMPLEMENTATION!r} never forms the "
                         "attention probabilities; load the model with attn_implementation='eager' to get them")
    if not _REFUSED_SET.isdisjoint(kwargs):
        for name in _REFUSED:
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: not supported by attn_implementation={ATTN_IMPLEMENTATION!r}")
    batch, _, q_length, _ = query.shape
    kv_length = key.shape[2]
    sinks = kwargs.get("s_aux")  # gpt-oss: (Hq) unscaled logits, as learnable_sink
    dropout, softcap = float(dropout), 0.0 if softcap is None else float(softcap)
    packed = not _PACKED_SET.isdisjoint(kwargs) and any(kwargs.get(name) is not None for name in _PACKED)
    offsets = tuple(kwargs.get(name) for name in _PACKED) if packed else None
    if kwargs.get("position_bias") is not None:
        return _biased_forward(module, query, key, value, attention_mask, kwargs["position_bias"], dropout, scaling,
                               softcap, is_causal, sinks, offsets), None
    if isinstance(attention_mask, _Plan):
        plan = attention_mask
        if (plan.batch, plan.q_length, plan.kv_length) != (batch, q_length, kv_length):
            window = getattr(getattr(module, "config", None), "sliding_window", None)
            hint = (f"; the model's cache holds {kv_length} keys where its mask covers {plan.kv_length} "
                    f"(transformers' sliding-window cache with sliding_window={window} keeps more keys than the "
                    f"mask it builds for them: eager would spread that mask over every key)"
                    if window is not None and plan.kv_length < kv_length else "")
            raise ValueError(f"attention_mask: {plan} does not match query/key (batch {batch}, q_length "
                             f"{q_length}, kv_length {kv_length}){hint}")
    elif attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a torch.Tensor or None, got {type(attention_mask).__name__}")
        plan = _plan_from_tensor(attention_mask, batch, q_length, kv_length)
    else:
        causal = _layer_causal(module, is_causal)
        window = (-1, 0) if causal else (-1, -1)
        if sliding_window is not None and kv_length > sliding_window:
            if not causal:
                raise ValueError(f"sliding_window: {sliding_window} without a mask on a bidirectional layer is "
                                 "ambiguous; pass the model's attention_mask")
            window = (int(sliding_window) - 1, 0)
        plan = _Plan(batch, q_length, kv_length, causal, window)
    if plan.dense is not None:
        dense = plan.dense if offsets is None else _packed_dense(plan.dense, batch, q_length, kv_length, *offsets)
        return _sdpa_forward(query, key, value, dense, dropout, scaling, softcap, sinks), None
    if offsets is not None:
        plan = _packed_plan(plan, batch, q_length, kv_length, *offsets)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad or (
        sinks is not None and sinks.requires_grad))
    if plan.varlen is None:
        k0, k1 = plan.keys
        if (k0, k1) != (0, kv_length):
            k, v = k[:, k0:k1], v[:, k0:k1]
        if not needs_grad and dropout == 0.0 and sinks is None:  # a decode step's route
            out = _impl._direct_forward(q, k, v, scaling, plan.causal, plan.window, softcap)
            if out is not None:
                return out, None
        return flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling, causal=plan.causal,
                               window_size=plan.window, softcap=softcap, learnable_sink=sinks), None
    if plan.cache is not None and not needs_grad and dropout == 0.0:
        leftpad, seqlens = plan.cache  # the keys stay where the model's cache holds them
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, softmax_scale=scaling,
                                      causal=plan.causal, window_size=plan.window, softcap=softcap,
                                      learnable_sink=sinks)
        return out, None
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=plan.causal, window_size=plan.window,
                   softcap=softcap, learnable_sink=sinks)
    q_index, k_index, cu_q, cu_k, max_q, max_k = plan.varlen
    heads, heads_kv = q.shape[2], k.shape[2]
    if q_index.numel() == 0:  # no row sees a key
        return q.new_zeros(batch, q_length, heads, v.shape[-1]), None
    out = flash_attn_varlen_func(q.reshape(batch * q_length, heads, -1).index_select(0, q_index),
                                 k.reshape(batch * kv_length, heads_kv, -1).index_select(0, k_index),
                                 v.reshape(batch * kv_length, heads_kv, -1).index_select(0, k_index),
                                 cu_q, cu_k, max_q, max_k, **options)
    full = out.new_zeros(batch * q_length, heads, out.shape[-1]).index_copy(0, q_index, out)
    return full.view(batch, q_length, heads, -1), None


def _packed_offsets(batch, q_length, kv_length, cu_q, cu_k, max_q, max_k):
    """(cu_q, cu_k) int32 of a padding-free batch given by its offsets (cu_seq_lens_q/k,
    max_length_q/k: all four, one packed row, every token of it in a sequence), checked —
    their values only outside torch.compile, where reading them would break the graph."""
    missing = [name for name, x in zip(_PACKED, (cu_q, cu_k, max_q, max_k)) if x is None]
    if missing:
        raise ValueError(f"{missing[0]}: a padding-free batch needs all of {', '.join(_PACKED)}")
    if batch != 1:
        raise ValueError(f"cu_seq_lens_q: a padding-free batch is one packed row, got batch {batch}")
    cu_q, cu_k = (torch.as_tensor(c).to(torch.int32) for c in (cu_q, cu_k))
    for name, cu, total in (("cu_seq_lens_q", cu_q, q_length), ("cu_seq_lens_k", cu_k, kv_length)):
        if cu.dim() != 1 or cu.numel() < 2 or (not torch.compiler.is_compiling() and (
                int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu.diff() < 0).any()))):
            raise ValueError(f"{name}: expected offsets from 0 to the row's {total} tokens, non-decreasing, got "
                             f"{cu.tolist()}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seq_lens_k: {cu_k.numel() - 1} sequences, cu_seq_lens_q {cu_q.numel() - 1}")
    return cu_q, cu_k


def _packed_plan(plan, batch, q_length, kv_length, *offsets):
    """The varlen plan of a padding-free batch (_packed_offsets), with the layer's band
    (causal, window) in each sequence, as transformers' flash-attention path computes it.
    Where the model's mask already cut the row into sequences (position_ids restarting), they
    must be these."""
    cu_q, cu_k = _packed_offsets(batch, q_length, kv_length, *offsets)
    if plan.varlen is not None and not (torch.equal(plan.varlen[2], cu_q) and torch.equal(plan.varlen[3], cu_k)):
        raise ValueError(f"cu_seq_lens_q: the sequences {cu_q.tolist()} are not those of the model's attention mask "
                         f"and position_ids ({plan.varlen[2].tolist()})")
    if plan.keys != (0, kv_length):
        raise ValueError(f"cu_seq_lens_k: the model's attention mask hides keys outside [{plan.keys[0]}, "
                         f"{plan.keys[1]}) of the packed row")
    rows, keys = torch.arange(q_length), torch.arange(kv_length)
    return _Plan(batch, q_length, kv_length, plan.causal, plan.window,
                 varlen=(rows, keys, cu_q, cu_k, int(cu_q.diff().max()), int(cu_k.diff().max())))


def _packed_dense(dense, batch, q_length, kv_length, *offsets):
    """A dense mask (bool, or additive float) cut to a padding-free batch's sequences
    (_packed_offsets): query i sees key j only where both lie in the same sequence."""
    cu_q, cu_k = _packed_offsets(batch, q_length, kv_length, *offsets)
    same = (torch.bucketize(torch.arange(q_length), cu_q[1:], right=True)[:, None]
            == torch.bucketize(torch.arange(kv_length), cu_k[1:], right=True)[None, :])
    if dense.dtype == torch.bool:
        return dense & same
    return torch.where(same, dense, torch.finfo(dense.dtype).min)


def _biased_forward(module, query, key, value, attention_mask, position_bias, dropout, scaling, softcap, is_causal,
                    sinks, offsets):
    """T5's relative position bias (position_bias (1 or B, Hq, Sq, Sk), added to the scaled
    scores) under the model's mask, combined as transformers' SDPA path combines them — the
    bias where the mask attends, the lower of the two dtypes' minimum elsewhere, a float mask
    added — into one additive attn_mask of flashattn's SDPA, which differentiates it (the bias
    is learned); cut to a padding-free batch's sequences where offsets are given.
    -> (B, Sq, Hq, Dv)."""
    q_length, kv_length = query.shape[2], key.shape[2]
    if isinstance(attention_mask, _Plan) and attention_mask.dense is not None:
        mask = attention_mask.dense
    elif isinstance(attention_mask, _Plan):
        if attention_mask.bool_mask is None:
            raise ValueError(f"attention_mask: {attention_mask} was not made by this backend's mask function, so "
                             "position_bias cannot be combined with it")
        mask = attention_mask.bool_mask()
    elif attention_mask is None:
        causal = _layer_causal(module, is_causal)
        mask = torch.arange(q_length)[:, None] >= torch.arange(kv_length) if causal and q_length > 1 else None
    else:
        mask = attention_mask
    if mask is None:
        bias = position_bias
    elif mask.dtype == torch.bool:
        bias = torch.where(mask, position_bias, max(torch.finfo(key.dtype).min, torch.finfo(position_bias.dtype).min))
    else:
        bias = position_bias + mask
    if offsets is not None:
        bias = _packed_dense(bias, query.shape[0], q_length, kv_length, *offsets)
    return _sdpa_forward(query, key, value, bias, dropout, scaling, softcap, sinks)


def _sdpa_forward(query, key, value, attn_mask, dropout, scaling, softcap, sinks):
    """flashattn's SDPA with a dense attn_mask (bool, or added to the scaled scores), as
    transformers' SDPA path computes it, and the layer's softcap and sinks (Gemma 2, gpt-oss),
    which that path lacks; its gradient flows to a float mask and to sinks that require it.
    -> (B, Sq, Hq, Dv)."""
    from .. import scaled_dot_product_attention

    out = scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout, scale=scaling,
                                       enable_gqa=query.shape[1] != key.shape[1], softcap=softcap,
                                       learnable_sink=sinks)
    return out.transpose(1, 2)


def register():
    """Registers the attention and mask functions with transformers under ATTN_IMPLEMENTATION
    (idempotent) and returns that name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask_function)
    return ATTN_IMPLEMENTATION
