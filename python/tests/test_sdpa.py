"""flashattn.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention.

Every combination of mask (none, bool, float) and its broadcast shape, is_causal (top-left,
Sq != Sk both ways), enable_gqa, scale and dtype (float32, bfloat16), forward and backward
(dq, dk, dv, and a float mask's gradient in its own shape and dtype, as torch's
attn_mask.grad), with the project's tolerance rule: the float64 reference is torch's SDPA in
float64, the naive same-precision implementation SDPA's formula in torch ops on the inputs'
dtype (every product, score and probability rounded to it); float32: error <= 1e-5 out /
1e-4 grads; bfloat16: <= 2x / 3x the naive one's error. Then an
expanded mask's gradient, dropout (the library's RNG, as flash_attn_func's), NumPy arrays,
bad inputs, opcheck and torch.compile(fullgraph=True), mask gradient included; the keyword-only
extras softcap and learnable_sink (not torch's) against the same rule, with the sinks' gradient.
Skipped without torch."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashattn  # noqa: E402
from conftest import run_grads as run, seed_for, torch_inputs as inputs, within_torch  # noqa: E402

# (name, shape of the mask given (B, Hq, Sq, Sk) sizes): SDPA's broadcasting from the right.
MASK_SHAPES = {
    "2d": lambda b, h, sq, sk: (sq, sk),
    "3d": lambda b, h, sq, sk: (h, sq, sk),
    "keys": lambda b, h, sq, sk: (1, sk),
    "batch": lambda b, h, sq, sk: (b, 1, sq, sk),
    "full": lambda b, h, sq, sk: (b, h, sq, sk),
    "heads_keys": lambda b, h, sq, sk: (1, h, 1, sk),
}
MASKS = [("none", None, False), ("none", None, True)] + [
    (kind, shape, False) for kind in ("bool", "float") for shape in MASK_SHAPES]
MASK_IDS = ["none", "causal"] + [f"{kind}-{shape}" for kind, shape, _ in MASKS[2:]]
SEQLENS = [(37, 53), (53, 37)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def make_mask(gen, kind, shape, dtype):
    if kind == "bool":
        return torch.rand(shape, generator=gen) > 0.3
    m = torch.randn(shape, generator=gen)
    m[torch.rand(shape, generator=gen) < 0.1] = float("-inf")
    return m.to(dtype)


def naive_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, softcap=0.0,
               learnable_sink=None):
    """SDPA's definition in torch ops, in q's dtype (the naive same-precision implementation);
    softcap caps the scaled scores before the mask is added, learnable_sink joins every row's
    softmax as one more logit per head (dropped from the product with v)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q * (q.shape[-1] ** -0.5 if scale is None else scale)) @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if is_causal:
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    if learnable_sink is None:
        return torch.softmax(s, dim=-1) @ v
    sink = learnable_sink.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default_scale", "scale"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=["sq<sk", "sq>sk"])
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_matches_torch(mask, seqlens, gqa, scale, dtype):
    kind, shape, is_causal = mask
    sq, sk = seqlens
    b, hq, hkv, d = 2, 4, (2 if gqa else 4), 24
    dt = DTYPES[dtype]
    seed = seed_for("sdpa", kind, shape, is_causal, seqlens, gqa, scale, dtype)
    gen, q, k, v, dout = inputs(seed, b, hq, hkv, sq, sk, d, dt)
    attn_mask = None if kind == "none" else make_mask(gen, kind, MASK_SHAPES[shape](b, hq, sq, sk), dt)
    kw = dict(is_causal=is_causal, scale=scale, enable_gqa=gqa, grad_of=("attn_mask",) if kind == "float" else ())
    got = run(flashattn.scaled_dot_product_attention, q, k, v, dout, attn_mask=attn_mask, **kw)
    naive = run(naive_sdpa, q, k, v, dout, attn_mask=attn_mask, **kw)
    ref_mask = attn_mask if attn_mask is None or kind == "bool" else attn_mask.double()
    ref = run(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), dout.double(), attn_mask=ref_mask,
              **kw)
    context = f"seed={seed}"
    assert got[0].shape == (b, hq, sq, d) and got[0].dtype == dt
    if kind == "float":
        assert got[4].shape == attn_mask.shape and got[4].dtype == dt
    for name, g, r, n in zip(("out", "dq", "dk", "dv", "dmask"), got, ref, naive):
        within_torch(name, g, r, n, name != "out", context)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("fill", [-1e4, -1e9, "min"])
def test_rows_whose_every_score_is_huge(fill, dtype):
    """Rows whose float mask holds the same huge negative value on every key (padding rows of
    -1e4, -1e9 or finfo.min), with a gradient flowing into them: their lse, m + log l, rounds
    to m in float32, and gradients recomputed from it came out up to Sk times too large. Every
    gradient is within 3x the naive same-precision implementation's error (which, its scores
    rounded near the bias, is large on those rows) of the float64 definition. The reference is
    SDPA's formula in float64 ops: torch's own float64 SDPA keeps m + log l in one double and
    meets the same rounding at finfo.min."""
    dt = DTYPES[dtype]
    seed = seed_for("huge_rows", fill, dtype)
    gen, q, k, v, dout = inputs(seed, 2, 4, 2, 37, 53, 24, dt)
    value = torch.finfo(dt).min if fill == "min" else fill
    mask = make_mask(gen, "float", (2, 1, 37, 53), dt)
    mask[:, :, 3:9] = value
    mask[1, :, 20] = value
    kw = dict(attn_mask=mask, enable_gqa=True, grad_of=("attn_mask",))
    got = run(flashattn.scaled_dot_product_attention, q, k, v, dout, **kw)
    naive = run(naive_sdpa, q, k, v, dout, **kw)
    ref = run(naive_sdpa, q.double(), k.double(), v.double(), dout.double(), **{**kw, "attn_mask": mask.double()})
    for name, g, r, n in zip(("dq", "dk", "dv", "dmask"), got[1:], ref[1:], naive[1:]):
        err, naive_err = ((x.double() - r).abs().max().item() for x in (g, n))
        assert err <= 3 * naive_err + 1e-4, f"{name}: max error {err:.3e}, naive {naive_err:.3e} (seed={seed})"


def test_strided_views_not_copies():
    """Inputs in SDPA's layout reach the library as transposed views: a (B, S, H, D) tensor
    transposed to (B, H, S, D) gives the same result, and the output is a view of (B, Sq, Hq, Dv)."""
    gen, q, k, v, _ = inputs(seed_for("views"), 2, 4, 4, 33, 40, 16, torch.float32)
    q_bshd = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = flashattn.scaled_dot_product_attention(q_bshd, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=0)
    assert out.transpose(1, 2).is_contiguous()


def test_expanded_mask_read_in_place():
    """A mask expanded with stride-0 dims (torch's expand) is accepted as it is."""
    gen, q, k, v, _ = inputs(seed_for("expand"), 2, 4, 4, 20, 30, 16, torch.float32)
    m = (torch.rand(20, 30, generator=gen) > 0.4).expand(2, 4, 20, 30)
    torch.testing.assert_close(flashattn.scaled_dot_product_attention(q, k, v, attn_mask=m),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=m), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_expanded_mask_gradient(dtype):
    """A float mask expanded (stride 0) from (Sq, Sk) to (B, Hq, Sq, Sk) and requiring grad
    through the expand: its leaf's gradient, summed over the expanded dims, is torch's."""
    dt = DTYPES[dtype]
    seed = seed_for("expand_grad", dtype)
    gen, q, k, v, dout = inputs(seed, 2, 4, 2, 19, 27, 16, dt)
    leaf = make_mask(gen, "float", (19, 27), dt)
    expanded = lambda m: m.expand(2, 4, 19, 27)  # noqa: E731
    grads = [run(lambda q, k, v, m: fn(q, k, v, attn_mask=expanded(m), scale=0.4, enable_gqa=True), *args,
                 grad_of=("m",), m=m)
             for fn, args, m in ((flashattn.scaled_dot_product_attention, (q, k, v, dout), leaf),
                                 (naive_sdpa, (q, k, v, dout), leaf),
                                 (F.scaled_dot_product_attention, (q.double(), k.double(), v.double(), dout.double()),
                                  leaf.double()))]
    got, naive, ref = grads
    assert got[4].shape == (19, 27) and got[4].dtype == dt
    for name, g, r, n in zip(("out", "dq", "dk", "dv", "dmask"), got, ref, naive):
        within_torch(name, g, r, n, name != "out", f"seed={seed}")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_softcap_and_sinks(kind, dtype):
    """softcap and learnable_sink (keyword-only, not torch's) with every kind of mask, GQA, Sq <
    Sk: out, dq, dk, dv, the float mask's and the sinks' gradients within the rule against the
    float64 definition (naive_sdpa); each of the two changes the result."""
    dt = DTYPES[dtype]
    seed = seed_for("softcap_sinks", kind, dtype)
    gen, q, k, v, dout = inputs(seed, 2, 4, 2, 23, 41, 16, dt)
    mask = None if kind == "none" else make_mask(gen, kind, (2, 1, 23, 41), dt)
    sinks = torch.empty(4).uniform_(-1.0, 3.0, generator=gen).to(dt)
    grad_of = ("learnable_sink",) + (("attn_mask",) if kind == "float" else ())
    extras = dict(attn_mask=mask, scale=0.4, enable_gqa=True, softcap=1.5, learnable_sink=sinks)
    got, naive = (run(fn, q, k, v, dout, grad_of=grad_of, **extras)
                  for fn in (flashattn.scaled_dot_product_attention, naive_sdpa))
    wide = {name: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for name, x in extras.items()}
    ref = run(naive_sdpa, q.double(), k.double(), v.double(), dout.double(), grad_of=grad_of, **wide)
    names = ("out", "dq", "dk", "dv", "dsinks", "dmask")[:len(got)]
    for name, g, r, n in zip(names, got, ref, naive):
        assert g.dtype == dt and g.shape == r.shape, name
        within_torch(name, g, r, n, name != "out", f"seed={seed}")
    for change in (dict(softcap=0.0), dict(learnable_sink=None)):
        other = flashattn.scaled_dot_product_attention(q, k, v, **{**extras, **change})
        assert (other - got[0]).abs().max() > 1e-2, change
    if dt == torch.float32:
        arrays = {name: x.numpy() if isinstance(x, torch.Tensor) else x for name, x in extras.items()}
        numpy_out = flashattn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), **arrays)
        np.testing.assert_allclose(numpy_out, got[0].detach().numpy(), atol=1e-6, rtol=0)


def test_numpy_arrays():
    gen, q, k, v, _ = inputs(seed_for("numpy"), 1, 4, 2, 17, 29, 16, torch.float32)
    m = torch.randn(17, 29, generator=gen)
    got = flashattn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=m.numpy(),
                                                 enable_gqa=True)
    assert isinstance(got, np.ndarray) and got.shape == (1, 4, 17, 16)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)
    causal = flashattn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(causal, want.numpy(), atol=1e-5, rtol=0)


def test_dropout_is_the_librarys():
    """dropout_p > 0 draws the library's (seed, offset) from torch's generator as flash_attn_func
    does: the same generator state gives flash_attn_func's result and gradients; a mask joins it."""
    gen, q, k, v, dout = inputs(seed_for("dropout"), 2, 4, 2, 31, 45, 16, torch.float32)
    torch.manual_seed(7)
    got = run(flashattn.scaled_dot_product_attention, q, k, v, dout, dropout_p=0.3, enable_gqa=True)
    torch.manual_seed(7)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    want = run(lambda a, b, c: t(flashattn.flash_attn_func(t(a), t(b), t(c), dropout_p=0.3)), q, k, v, dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    without = flashattn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert (got[0] - without).abs().max() > 1e-2
    torch.manual_seed(7)
    masked = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(31, 45, dtype=torch.bool),
                                                    dropout_p=0.3, enable_gqa=True)
    torch.testing.assert_close(masked, got[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("call, error, fragment", [
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q[0], k[0], v[0]), ValueError, "query: expected rank 4"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 9, dtype=torch.bool),
                                                            is_causal=True), ValueError, "attn_mask: must be None"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k[:, :1], v[:, :1]), ValueError, "enable_gqa"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 9, dtype=torch.int32)),
     TypeError, "attn_mask: dtype"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 8, 9)), ValueError,
     "attn_mask: shape"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(1, 1, 1, 8, 9)),
     ValueError, "attn_mask: rank 5"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=[[True]]), TypeError, "attn_mask"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, dropout_p=1.0), ValueError, "dropout_p"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, scale="x"), TypeError, "scale"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k.numpy(), v), TypeError, "mix"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q.to(torch.float64), k, v), TypeError, "query: dtype"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, softcap=True), TypeError, "softcap"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, softcap=-1.0), ValueError, "softcap"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, learnable_sink=torch.zeros(3)), ValueError,
     "learnable_sink: expected shape"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, learnable_sink=torch.zeros(2).numpy()),
     TypeError, "learnable_sink"),
    # SDPA's names, not the native (B, S, H, D) views' q, k, v.
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k.bfloat16(), v), TypeError,
     "key: dtype torch.bfloat16 but query has torch.float32"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v.half()), TypeError, "value: dtype"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(torch.cat([q, q]), k, v), ValueError,
     "key: batch 1 but query has 2"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v[:, :, :5]), ValueError,
     r"value: \(heads, seqlen\) \(2, 5\) but key has \(2, 9\)"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k[..., :4], v), ValueError,
     "key: head_dim 4 but query has 8"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q[:, :0], k, v, enable_gqa=True), ValueError,
     "query: 0 heads"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(torch.cat([q, q[:, :1]], 1), k, v, enable_gqa=True),
     ValueError, "query: 3 heads, not a multiple of key's and value's 2"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, scale=math.inf), ValueError,
     "scale: must be finite"),
    (lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v, scale=3e38), ValueError,
     "scale: must be finite, of magnitude at most"),
], ids=["rank", "causal_and_mask", "heads", "mask_dtype", "mask_shape", "mask_rank", "mask_type", "dropout",
        "scale", "mixed", "float64", "softcap_type", "softcap_negative", "sinks_shape", "sinks_mixed", "key_dtype",
        "value_dtype", "key_batch", "value_shape", "key_head_dim", "no_heads", "gqa_ratio", "scale_inf", "scale_huge"])
def test_bad_inputs_name_the_argument(call, error, fragment):
    _, q, k, v, _ = inputs(1, 1, 2, 2, 8, 9, 8, torch.float32)
    with pytest.raises(error, match=fragment):
        call(q, k, v)


def test_largest_scale_is_taken_and_finite_just_beyond_it_refused():
    """One limit for scale, softcap, sinks, slopes and score_mod constants (the C++
    AttentionProblem::kLargestScaled): at it the kernels' scale·log2(e) stays finite; just
    past it (below float32's largest / log2(e), where the product can round to inf) refused."""
    limit = flashattn._C.LARGEST_SCALED
    assert limit == float(np.float32(2.35e38))
    assert np.isfinite(np.float32(limit) * np.float32(math.log2(math.e)))
    _, q, k, v, _ = inputs(1, 1, 2, 2, 8, 9, 8, torch.float32)
    small = (q * 1e-37, k * 1e-2, v)  # scores of order 1 after the scale
    got = flashattn.scaled_dot_product_attention(*small, scale=limit)
    scores = (small[0].double() @ small[1].double().transpose(-1, -2)) * limit
    want = torch.softmax(scores, -1) @ v.double()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="scale: must be finite, of magnitude at most 2.35e\\+38"):
        flashattn.scaled_dot_product_attention(q, k, v, scale=2.355e38)


def test_sparse_inputs_are_type_errors_naming_them():
    """A tensor without strides (sparse) is a TypeError naming the argument, in the SDPA drop-in,
    flex_attention and flash_attn_func (before: torch's RuntimeError from reading its strides)."""
    _, q, k, v, _ = inputs(3, 1, 2, 2, 4, 4, 8, torch.float32)
    with pytest.raises(TypeError, match="key: layout torch.sparse_coo"):
        flashattn.scaled_dot_product_attention(q, k.to_sparse(), v)
    with pytest.raises(TypeError, match="query: layout torch.sparse_coo"):
        flashattn.flex_attention(q.to_sparse(), k, v)
    with pytest.raises(TypeError, match="v: layout torch.sparse_coo"):
        flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2).to_sparse())


def test_sparse_masks_are_type_errors_naming_them():
    """A sparse attn_mask (COO of any rank, CSR) is a TypeError naming its layout, as q, k, v
    (before: torch's RuntimeError from reshape or contiguous, rank below 4 or bool)."""
    _, q, k, v, _ = inputs(4, 1, 2, 2, 4, 4, 8, torch.float32)
    dense = torch.rand(4, 4) > 0.3
    for mask in (dense.to_sparse(), dense[None, None].to_sparse(), dense.float().to_sparse(),
                 dense.float()[None, None].to_sparse(), dense.float().to_sparse_csr()):
        with pytest.raises(TypeError, match="attn_mask: layout torch.sparse_c"):
            flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_numpy_scalars_for_dropout_and_softcap():
    """dropout_p and softcap take any real number, NumPy's included (torch's SDPA takes
    np.float32 dropout); a string is a TypeError, a value out of range a ValueError."""
    _, q, k, v, _ = inputs(5, 1, 2, 2, 5, 6, 8, torch.float32)
    want = flashattn.scaled_dot_product_attention(q, k, v, softcap=5.0)
    assert torch.equal(flashattn.scaled_dot_product_attention(q, k, v, softcap=np.float32(5)), want)
    torch.manual_seed(3)
    a = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=np.float32(0.25))
    torch.manual_seed(3)
    b = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="dropout_p: expected a float in \\[0, 1\\), got str"):
        flashattn.scaled_dot_product_attention(q, k, v, dropout_p="0.1")
    with pytest.raises(ValueError, match="dropout_p: expected a float in \\[0, 1\\), got .*1.0"):
        flashattn.scaled_dot_product_attention(q, k, v, dropout_p=np.float32(1.0))
    with pytest.raises(ValueError, match="dropout_p"):
        flashattn.scaled_dot_product_attention(q, k, v, dropout_p=float("nan"))


def test_numpy_negative_strides_named_in_sdpa_layout():
    """A NumPy view running backwards is refused naming the argument and its dim in SDPA's
    (B, H, S, D) layout (before: q/k/v and the dim of the transposed native view)."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 4, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="query: negative stride -8 in dim 2"):
        flashattn.scaled_dot_product_attention(q[:, :, ::-1], q, q)
    with pytest.raises(ValueError, match="value: negative stride -1 in dim 3"):
        flashattn.scaled_dot_product_attention(q, q, q[..., ::-1])
    with pytest.raises(ValueError, match="attn_mask: negative stride -4 in dim 0"):
        flashattn.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((4, 4), bool)[::-1])


def test_numpy_scalar_scale_is_a_scale():
    """scale takes any real number, NumPy's included (as torch's does), in the SDPA drop-in and
    flex_attention; a bool is a TypeError."""
    _, q, k, v, _ = inputs(2, 1, 2, 2, 5, 6, 8, torch.float32)
    want = flashattn.scaled_dot_product_attention(q, k, v, scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5)):
        assert torch.equal(flashattn.scaled_dot_product_attention(q, k, v, scale=scale), want)
        assert torch.equal(flashattn.flex_attention(q, k, v, scale=scale), flashattn.flex_attention(q, k, v, scale=0.5))
    with pytest.raises(TypeError, match="scale"):
        flashattn.scaled_dot_product_attention(q, k, v, scale=True)


def test_opcheck():
    gen, q, k, v, _ = inputs(seed_for("opcheck"), 1, 2, 2, 9, 12, 8, torch.float32)
    m = torch.rand(1, 1, 9, 12, generator=gen) > 0.3
    t = lambda x: x.transpose(1, 2).requires_grad_(True)  # noqa: E731
    bias = torch.randn(1, 2, 9, 12, generator=gen)
    for mask, causal in ((None, True), (m, False), (bias, False), (bias.detach().requires_grad_(True), False)):
        torch.library.opcheck(torch.ops.flashattn.sdpa_fwd, (t(q), t(k), t(v), mask, 0.0, causal, None, None, 1))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    mask2d = bias[0, 0]
    out, lse = torch.ops.flashattn.sdpa_fwd(qt, kt, vt, mask2d, 0.0, False, 0.3, None, 1)
    dout = torch.randn(out.shape, generator=gen)
    for mask, mask_grad in ((None, False), (mask2d, False), (mask2d, True)):
        torch.library.opcheck(torch.ops.flashattn.sdpa_bwd, (dout, qt, kt, vt, out, lse, mask, 0.0, False, 0.3, None, 1,
                                                             mask_grad))
    sinks = torch.randn(2, generator=gen)
    torch.library.opcheck(torch.ops.flashattn.sdpa_fwd, (t(q), t(k), t(v), bias, 0.0, False, None, None, 1, 2.0,
                                                         sinks.clone().requires_grad_(True)))
    out, lse = torch.ops.flashattn.sdpa_fwd(qt, kt, vt, mask2d, 0.0, False, 0.3, None, 1, 2.0, sinks)
    torch.library.opcheck(torch.ops.flashattn.sdpa_bwd, (dout, qt, kt, vt, out, lse, mask2d, 0.0, False, 0.3, None, 1,
                                                         True, 2.0, sinks))


def test_compile_fullgraph_matches_eager():
    gen, q, k, v, dout = inputs(seed_for("compile"), 2, 4, 2, 21, 34, 16, torch.float32)
    m = torch.randn(2, 1, 21, 34, generator=gen)

    def f(q, k, v, m):
        return flashattn.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.2, enable_gqa=True) * 2.0

    eager = run(f, q, k, v, dout, grad_of=("m",), m=m)
    compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager"), q, k, v, dout, grad_of=("m",), m=m)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=0, rtol=0)
