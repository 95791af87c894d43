"""flashattn.flex_attention and create_block_mask against a float64 reference and torch's FlexAttention.

Mods (causal, sliding window, prefix-LM, a document mask over a packed batch, a hidden-rows
mask, relative position bias, ALiBi, a per-(b, h) scale and bias, where with -inf or a
constant), B/H given or None, MHA and GQA, Sq != Sk both ways with lengths that are not
multiples of the block and few query rows (the decode kernel), float32 and bfloat16,
threads 1, 2, 3 (one count per pair of lengths): out and dq, dk, dv with the project's
tolerance rule (float32: error <= 1e-5 out / 1e-4 grads; bfloat16: <= 2x / 3x the
error of a naive same-precision implementation, plus those). The float64 reference is the
definition in torch ops (scores materialized, mods applied by broadcasting); the torch
comparison is torch.nn.attention.flex_attention in eager mode on float64 inputs (torch
refuses a CPU backward there, a device check its eager path does not need: the test lifts
it). Then: the block mask's blocks against torch's, evaluation once per chunk of blocks
(never per element), compact storage, non-affine score_mods refused by name, in-place
score_mods on the per-diagonal path, shape-only factories (full_like, new_zeros, ...),
torch.finfo(dtype).min as a mask value, bad inputs (non-scalar mod results among them),
opcheck, torch.compile and return_lse. Skipped without torch."""

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import _flex  # noqa: E402
from conftest import run_grads as run, seed_for, torch_inputs, within_torch  # noqa: E402

B, HQ, D, BLOCK = 2, 4, 24, 16
SEQLENS = [(37, 53), (53, 37), (3, 70)]  # (3, 70): few query rows per kv head, the decode kernel's forward
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
NEG_INF = float("-inf")


def make_case(name, sq, sk, gen):
    """(score_mod, mask_mod, (B, H) for create_block_mask) of a named case; the mods broadcast
    (for the dense references) and run under vmap (for flashattn and torch)."""
    doc = torch.randint(0, 3, (B, max(sq, sk)), generator=gen).sort(dim=1).values  # packed documents
    table = torch.randn(sq + sk, generator=gen)  # a bias per relative position
    slopes = torch.rand(HQ, generator=gen) * 0.3
    bh_scale, bh_bias = torch.rand(B, HQ, generator=gen) + 0.5, torch.randn(B, HQ, generator=gen)

    def causal(b, h, q, kv):
        return q >= kv

    def sliding_window(b, h, q, kv):
        return (q >= kv) & (q - kv <= 9)

    def prefix_lm(b, h, q, kv):
        return (kv < 11) | (q >= kv)

    def document(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    def hidden_rows(b, h, q, kv):
        return (q >= 5) & (kv <= q + 3)

    def rel_bias(score, b, h, q, kv):
        return score + table[q - kv + sk - 1]

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv).abs()

    def scale_bias(score, b, h, q, kv):
        return score * bh_scale[b, h] + bh_bias[b, h]

    def where_causal(score, b, h, q, kv):
        return torch.where(q >= kv, score, NEG_INF)

    def where_const(score, b, h, q, kv):  # slope 1 below the diagonal, 0 above: a differs per score
        return torch.where(q >= kv, score + 1.0, 0.5)

    def softcap(score, b, h, q, kv):  # Gemma-2's, as FlexAttention's examples write it
        score = score / 1.5
        score = torch.tanh(score)
        return score * 1.5

    def softcap_rel(score, b, h, q, kv):  # capped, then scaled per (b, h) and a relative bias added
        return 1.5 * torch.tanh(score * (1 / 1.5)) * bh_scale[b, h] + table[q - kv + sk - 1]

    def softcap_causal(score, b, h, q, kv):
        return torch.where(q >= kv, 2.0 * torch.tanh(score / 2.0), NEG_INF)

    return {
        "causal": (None, causal, (None, None)),
        "sliding_window": (None, sliding_window, (None, None)),
        "prefix_lm": (None, prefix_lm, (None, HQ)),
        "document": (None, document, (B, None)),
        "hidden_rows": (None, hidden_rows, (B, HQ)),
        "rel_bias": (rel_bias, None, None),
        "alibi": (alibi, None, None),
        "alibi_causal": (alibi, causal, (None, None)),
        "rel_bias_document": (rel_bias, document, (B, HQ)),
        "scale_bias": (scale_bias, None, None),
        "where_causal": (where_causal, None, None),
        "where_const": (where_const, None, None),
        "softcap": (softcap, None, None),
        "softcap_rel_document": (softcap_rel, document, (B, HQ)),
        "softcap_causal": (softcap_causal, None, None),
    }[name]


CASES = ["causal", "sliding_window", "prefix_lm", "document", "hidden_rows", "rel_bias", "alibi", "alibi_causal",
         "rel_bias_document", "scale_bias", "where_causal", "where_const", "softcap", "softcap_rel_document",
         "softcap_causal"]


def dense_flex(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False):
    """FlexAttention's definition in torch ops in q's dtype, scores materialized: float64 inputs
    give the reference, others the naive same-precision implementation (every score and
    probability rounded to the dtype). A row without visible keys gives zeros, as torch's."""
    b, hq, sq, d = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    sk = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    idx = (torch.arange(b).view(b, 1, 1, 1), torch.arange(hq).view(1, hq, 1, 1), torch.arange(sq).view(1, 1, sq, 1),
           torch.arange(sk).view(1, 1, 1, sk))
    if score_mod is not None:
        s = score_mod(s, *idx).to(q.dtype)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx), NEG_INF)
    e = torch.exp(s - s.amax(dim=-1, keepdim=True).clamp(min=-1e30))
    p = (e / e.sum(dim=-1, keepdim=True).clamp(min=1e-30)).to(q.dtype)
    return p @ v


def torch_flex(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False):
    """torch.nn.attention.flex_attention eager, with its block mask from torch's create_block_mask."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")
    bm = None if mask_mod is None else fa.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2],
                                                            device="cpu", BLOCK_SIZE=BLOCK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=enable_gqa)


def ours(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False, mask_bh=(None, None), block=BLOCK):
    bm = None if mask_mod is None else flashattn.create_block_mask(mask_mod, *mask_bh, q.shape[2], k.shape[2],
                                                                   BLOCK_SIZE=block)
    return flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=enable_gqa)


def inputs(seed, hkv, sq, sk, dtype):
    return torch_inputs(seed, B, HQ, hkv, sq, sk, D, dtype)


@pytest.fixture
def torch_cpu_backward(monkeypatch):
    """torch's flex_attention refuses requires_grad inputs on the CPU in a device check; its eager
    (math) path computes the gradients on any device, so the check is lifted for the reference."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)


def check_case(case, seqlens, gqa, dtype, threads, reference, block=BLOCK):
    sq, sk = seqlens
    dt = DTYPES[dtype]
    seed = seed_for("flex", case, seqlens, gqa, dtype, threads)
    gen, q, k, v, dout = inputs(seed, 2 if gqa else HQ, sq, sk, dt)
    score_mod, mask_mod, mask_bh = make_case(case, sq, sk, gen)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa)
    flashattn.set_num_threads(threads)
    try:
        got = run(ours, q, k, v, dout, mask_bh=mask_bh or (None, None), block=block, **kw)
        assert flashattn.last_num_threads() == threads
    finally:
        flashattn._interface._num_threads = 0
    naive = run(dense_flex, q, k, v, dout, **kw)
    ref = run(reference, q.double(), k.double(), v.double(), dout.double(), **kw)
    assert got[0].shape == (B, HQ, sq, D) and got[0].dtype == dt
    for name, g, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        within_torch(name, g, r, n, name != "out", f"seed={seed}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("seqlens, threads", list(zip(SEQLENS, (1, 2, 3))), ids=["sq<sk-1t", "sq>sk-2t", "decode-3t"])
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case, seqlens, threads, gqa, dtype):
    """Each case on 1, 2 and 3 threads, one thread count per pair of lengths."""
    check_case(case, seqlens, gqa, dtype, threads, dense_flex)


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("case", ["causal", "sliding_window", "prefix_lm", "document", "hidden_rows", "rel_bias_document"])
def test_large_blocks_are_refined_for_the_kernels(case, block):
    """Blocks of 64 and 128 reach the kernels as blocks of 32 (each partial block's sub-blocks
    classified from its content): ragged lengths, per-batch and per-head masks, forward and
    backward against the float64 reference."""
    check_case(case, (203, 290), True, "f32", 2, dense_flex, block)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=["sq<sk", "sq>sk", "decode"])
@pytest.mark.parametrize("case", CASES)
def test_matches_torch_flex_attention(case, seqlens, gqa, dtype, torch_cpu_backward):
    check_case(case, seqlens, gqa, dtype, 2, torch_flex)


@pytest.mark.parametrize("case", [c for c in CASES if make_case(c, 37, 53, torch.Generator())[1] is not None])
@pytest.mark.parametrize("seqlens", SEQLENS + [(300, 300)], ids=["sq<sk", "sq>sk", "decode", "square"])
def test_block_mask_matches_torch(case, seqlens):
    """The same blocks computed as torch's create_block_mask (to_dense, sparsity), full blocks
    exactly those with every key kept, and each partial block's content mask_mod's."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")
    sq, sk = seqlens
    _, mask_mod, (mb, mh) = make_case(case, sq, sk, torch.Generator().manual_seed(seed_for("bm", case, seqlens)))
    got = flashattn.create_block_mask(mask_mod, mb, mh, sq, sk, BLOCK_SIZE=BLOCK)
    want = fa.create_block_mask(mask_mod, mb, mh, sq, sk, device="cpu", BLOCK_SIZE=BLOCK)
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == (sq, sk)
    assert torch.equal(got.to_dense(), want.to_dense().to(torch.int32))
    assert got.sparsity() == pytest.approx(want.sparsity())
    b, h = got.shape[:2]
    dense = mask_mod(torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
                     torch.arange(sq).view(1, 1, sq, 1), torch.arange(sk).view(1, 1, 1, sk)).expand(b, h, sq, sk)
    states, index = got.to_states(), got._partial_index.expand(b, h, -1, -1)
    for bi, hi, i, j in np.ndindex(*states.shape):
        block = dense[bi, hi, i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
        state = int(states[bi, hi, i, j])
        assert state == (0 if not block.any() else 2 if block.all() else 1), (bi, hi, i, j)
        if state == 1:
            content = got._partial_blocks[int(index[bi, hi, i, j])][:block.shape[0], :block.shape[1]]
            assert torch.equal(content, block), (bi, hi, i, j)


@pytest.mark.parametrize("case", ["alibi_causal", "rel_bias_document", "where_const"])
def test_native_reference_applies_the_same_mods(case):
    """The float64 reference of the native library (its attention probabilities) reads the
    same evaluated mods as the kernels, through the hook's per-score forms."""
    gen, q, k, v, _ = inputs(seed_for("probs", case), 2, 29, 41, torch.float32)
    score_mod, mask_mod, mask_bh = make_case(case, 29, 41, gen)
    bm = None if mask_mod is None else flashattn.create_block_mask(mask_mod, *mask_bh, 29, 41, BLOCK_SIZE=8)
    mods = _flex._mods(score_mod, bm, (B, HQ, 29, 41))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    probs = flashattn._interface._probs(qt, kt, vt, _flex._opts(qt, kt, None, *mods, 1))
    want = dense_flex(q.double(), k.double(), torch.eye(41, dtype=torch.float64).expand(B, 2, 41, 41),
                      score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    torch.testing.assert_close(probs.double(), want, atol=1e-6, rtol=0)


def test_mods_evaluated_per_chunk_of_blocks():
    """Each mod is called a few times per call (once to follow its operations, then once per
    vmapped chunk of q rows — of diagonals where score_mod reads q_idx and kv_idx only through
    kv_idx - q_idx —, a score_mod that only adds to the score at score 0, others at 0 and 1),
    never per block or per element."""
    calls = {"mask": 0, "score": 0}
    bias = torch.randn(600)

    def mask_mod(b, h, q, kv):
        calls["mask"] += 1
        return (q >= kv) | (kv < 7)

    def score_mod(score, b, h, q, kv):
        calls["score"] += 1
        return score + bias[q - kv + 300]

    q, k, v = (torch.randn(1, 2, 300, 16) for _ in range(3))
    bm = flashattn.create_block_mask(mask_mod, None, None, 300, 300, BLOCK_SIZE=32)
    flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    assert calls == {"mask": 2, "score": 2}
    _flex_elements, _flex._EVAL_ELEMENTS = _flex._EVAL_ELEMENTS, 300 * 64
    try:
        chunked = flashattn.create_block_mask(mask_mod, None, None, 300, 300, BLOCK_SIZE=32)
        out = flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=chunked)
    finally:
        _flex._EVAL_ELEMENTS = _flex_elements
    # 10 chunks of 32 rows (blocks); the 599 diagonals of score_mod in one chunk of 300 * 64
    assert calls == {"mask": 2 + 1 + 10, "score": 2 + 1 + 1}
    assert torch.equal(chunked.to_states(), bm.to_states())
    torch.testing.assert_close(out, flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                               atol=0, rtol=0)
    _flex._EVAL_ELEMENTS = 100
    try:
        calls["score"] = 0
        out = flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    finally:
        _flex._EVAL_ELEMENTS = _flex_elements
    assert calls["score"] == 1 + 6  # the diagonals in 6 chunks of 100
    torch.testing.assert_close(out, flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                               atol=0, rtol=0)
    scales = torch.rand(300) + 0.5

    def scaled(score, b, h, q, kv):
        calls["score"] += 1
        return score * scales[kv] + bias[q - kv + 300]

    calls["score"] = 0
    flashattn.flex_attention(q, k, v, score_mod=scaled, block_mask=bm)
    assert calls["score"] == 1 + 2


def test_storage_follows_what_the_mods_read():
    """Block states are stored once along b or h where mask_mod ignores them; a score_mod's
    coefficients only along the indices it reads, and not at all where constant."""
    doc = torch.tensor([[0] * 20 + [1] * 20, [0] * 10 + [1] * 30])
    bm = flashattn.create_block_mask(lambda b, h, q, kv: doc[b, q] == doc[b, kv], 2, 8, 40, 40, BLOCK_SIZE=8)
    assert bm._states.shape == (2, 1, 5, 5) and bm.shape == (2, 8, 40, 40) and bm.to_dense().shape == (2, 8, 5, 5)
    slopes = torch.rand(8)
    a, c, cap = _flex._score_coefficients(lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), (2, 8, 40, 50))
    assert a is None and c.shape == (1, 8, 1, 40 + 50 - 1) and cap == 0.0  # one value per diagonal
    a, c, _ = _flex._score_coefficients(lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), (1, 8, 2048, 2048))
    assert a is None and c.shape == (1, 8, 1, 4095)  # 128 KiB, where (Sq, Sk) per head would be 128 MiB
    a, c, _ = _flex._score_coefficients(lambda s, b, h, q, kv: s * 2.0, (2, 8, 40, 50))
    assert a.shape == (1, 1, 1, 1) and a.item() == 2.0 and c is None
    assert _flex._score_coefficients(lambda s, b, h, q, kv: s, (2, 8, 40, 50)) == (None, None, 0.0)
    a, c, cap = _flex._score_coefficients(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), (2, 8, 40, 50))
    assert a is None and c is None and cap == 30.0


def expanded(x, sizes):
    """A coefficient from _score_coefficients over the whole (B, H, Sq, Sk): one held per
    diagonal (shape (., ., 1, Sq + Sk - 1)) gathered at kv_idx - q_idx + Sq - 1."""
    b, h, sq, sk = sizes
    if x.shape[2] == 1 and x.shape[3] == sq + sk - 1 and sq > 1 and sk > 1:
        x = x[:, :, 0][..., torch.arange(sk).view(1, sk) - torch.arange(sq).view(sq, 1) + sq - 1]
    return x.expand(sizes)


@pytest.mark.parametrize("rows", [64, 5, 1], ids=["one-chunk", "chunks-of-5", "row-by-row"])
def test_relative_coefficients_are_held_per_diagonal(rows):
    """A score_mod that reads q_idx and kv_idx only through kv_idx - q_idx keeps Sq + Sk - 1
    values per (b, h); one that does so for its first rows only, or not at all, the whole
    (Sq, Sk) — each equal to the score_mod itself at every score, evaluated over any chunks of
    rows (the switch to the whole matrix midway rebuilds the rows before it)."""
    sizes = (2, 3, 23, 31)
    table, slopes = torch.randn(60), torch.rand(3)
    mods = {  # name: (score_mod, per diagonal: a, c; None: not stored)
        "rel_bias": (lambda s, b, h, q, kv: s + table[q - kv + 30], (None, True)),
        "alibi_scaled": (lambda s, b, h, q, kv: s * (1.0 + h) - slopes[h] * (q - kv).abs(), (False, True)),
        "slope_per_diagonal": (lambda s, b, h, q, kv: torch.where(kv - q > 4, 2.0 * s, s) + (kv - q) * 0.25,
                               (True, True)),
        "slope_from_row_19": (lambda s, b, h, q, kv: torch.where(kv - q < -18, 3.0 * s, s), (True, None)),
        "relative_until_row_12": (lambda s, b, h, q, kv: s + table[q - kv + 30] + torch.where(q > 11, kv * 0.5, 0.0),
                                  (None, False)),
        "product": (lambda s, b, h, q, kv: s + q * kv * 0.01, (None, False)),
        "softcap_alibi": (lambda s, b, h, q, kv: (1.0 + h) * 4.0 * torch.tanh(s / 4.0) - slopes[h] * (q - kv).abs(),
                          (False, True)),
    }
    idx = (torch.arange(sizes[0]).view(-1, 1, 1, 1), torch.arange(sizes[1]).view(1, -1, 1, 1),
           torch.arange(sizes[2]).view(1, 1, -1, 1), torch.arange(sizes[3]).view(1, 1, 1, -1))
    saved, _flex._EVAL_ELEMENTS = _flex._EVAL_ELEMENTS, rows * sizes[3]  # rows per chunk for a mod of (q, kv)
    try:
        for name, (mod, diagonal) in mods.items():
            a, c, cap = _flex._score_coefficients(mod, sizes)
            assert cap == (4.0 if name.startswith("softcap") else 0.0), name
            # f(s) = a * t(s) + c, t the score or cap * tanh(score / cap): a from one more score
            probe = 1.0 if cap == 0.0 else cap * math.atanh(0.5)
            t = probe if cap == 0.0 else cap * math.tanh(probe / cap)
            f0 = mod(torch.zeros((), dtype=torch.float64), *idx).expand(sizes)
            f1 = mod(torch.tensor(probe, dtype=torch.float64), *idx).expand(sizes)
            for x, want, per_diagonal, label in ((a, (f1 - f0) / t, diagonal[0], "a"), (c, f0, diagonal[1], "c")):
                if per_diagonal is None:
                    assert x is None or x.numel() == 1, (name, label)
                    continue
                assert (x.shape[2:] == (1, sizes[2] + sizes[3] - 1)) == per_diagonal, (name, label, x.shape)
                assert not per_diagonal or x.shape[2:] != sizes[2:]
                torch.testing.assert_close(expanded(x, sizes).double(), want.float().double(), atol=0, rtol=0,
                                           msg=f"{name} {label}")
    finally:
        _flex._EVAL_ELEMENTS = saved


def test_difference_only_score_mods_are_evaluated_per_diagonal():
    """_trace takes a score_mod as reading q_idx and kv_idx only through kv_idx - q_idx when every
    use of them is that difference of the inputs themselves — then it is evaluated once per
    diagonal, so a wrong "yes" would silently give every element its diagonal's first value —
    and says no to anything else (a scaled difference, an index changed in place, a view, a
    second use), which the element-wise evaluation then handles."""
    table, slopes = torch.randn(80), torch.rand(4)

    def in_place(s, b, h, q, kv):
        q.mul_(2)
        return s + (q - kv) * 0.5

    relative = {
        "table": lambda s, b, h, q, kv: s + table[q - kv + 40],
        "alibi": lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(),
        "rsub": lambda s, b, h, q, kv: s + torch.rsub(q, kv).float() * 0.1,
        "two_differences": lambda s, b, h, q, kv: torch.where(kv - q > 4, 2.0 * s, s) + (q - kv) * 0.25,
    }
    direct = {
        "alpha": lambda s, b, h, q, kv: s + torch.sub(kv, q, alpha=2) * 0.5,
        "in_place": in_place,
        "view": lambda s, b, h, q, kv: s + (q.view(-1) - kv) * 0.5,
        "difference_and_q": lambda s, b, h, q, kv: s + (q - kv) * 0.5 + q,
        "shifted": lambda s, b, h, q, kv: s + ((q + 1) - kv) * 0.5,
        "q_only": lambda s, b, h, q, kv: s + (q - q) * 0.5 + q,
        "product": lambda s, b, h, q, kv: s + q * kv * 0.01,
    }
    for name, mod in {**relative, **direct}.items():
        assert _flex._trace(mod, 1, name)[4] == (name in relative), name
    # An inf on one diagonal is named at that diagonal's first element.
    with pytest.raises(ValueError, match=r"returned inf .*\(b, h, q_idx, kv_idx\) = \(0, 0, 0, 3\)"):
        _flex._score_coefficients(lambda s, b, h, q, kv: s + torch.where(kv - q == 3, math.inf, 0.0), (1, 2, 9, 11))
    with pytest.raises(ValueError, match=r"returned inf .*\(b, h, q_idx, kv_idx\) = \(0, 1, 5, 0\)"):
        _flex._score_coefficients(lambda s, b, h, q, kv: s + torch.where((kv - q == -5) & (h == 1), math.inf, 0.0),
                                  (1, 2, 9, 11))


@pytest.mark.parametrize("score_mod, op", [
    (lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0 + 1.0), "tanh of the score plus an offset"),
    (lambda s, b, h, q, kv: torch.tanh(s / (h + 1.0)), "tanh of a value that depends on h besides the score"),
    (lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0) + s, r"soft-capped score \(tanh\) combined with the score"),
    (lambda s, b, h, q, kv: torch.tanh(torch.tanh(s)), "tanh of a soft-capped score"),
    (lambda s, b, h, q, kv: torch.tanh(s / 2.0) + torch.tanh(s / 3.0), "scaled differently in two places"),
    (lambda s, b, h, q, kv: torch.tanh(-s / 2.0), r"times -0.5 \(soft-capping takes score / cap with cap > 0\)"),
    (lambda s, b, h, q, kv: torch.tanh(s) * torch.tanh(s), "product of two score-dependent"),
    (lambda s, b, h, q, kv: s * s, "product of two score-dependent"),
    (lambda s, b, h, q, kv: torch.where(s > 0, s, 0.5 * s), r"\(gt\)"),
    (lambda s, b, h, q, kv: s.abs() + q, "abs"),
    (lambda s, b, h, q, kv: s.clamp(min=-5.0), "clamp"),
    (lambda s, b, h, q, kv: 1.0 / s, "reciprocal"),
    (lambda s, b, h, q, kv: (q + 1) / s, "division by a score-dependent value"),
    (lambda s, b, h, q, kv: s.int().float(), "cast of the score to torch.int32"),
], ids=["tanh-offset", "tanh-per-head", "tanh-and-score", "tanh-tanh", "two-caps", "negative-cap", "tanh-squared",
        "square", "where", "abs", "clamp", "reciprocal", "divisor", "int"])
def test_score_mod_neither_affine_nor_soft_capping_is_refused_by_name(score_mod, op):
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    with pytest.raises(NotImplementedError, match=f"score_mod <lambda>: not (affine in the score|soft-capping).*{op}"):
        flashattn.flex_attention(q, k, v, score_mod=score_mod)


def test_bad_inputs_name_the_argument():
    fa = pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    bm = flashattn.create_block_mask(causal, None, None, 9, 9, BLOCK_SIZE=4)
    learned = torch.zeros(2, requires_grad=True)
    calls = [
        (lambda: flashattn.flex_attention(q[0], k[0], v[0]), ValueError, "query: expected rank 4"),
        (lambda: flashattn.flex_attention(q.numpy(), k, v), TypeError, "query: expected a torch.Tensor"),
        (lambda: flashattn.flex_attention(q.double(), k, v), TypeError, "query: dtype"),
        (lambda: flashattn.flex_attention(q, k[:, :1], v[:, :1]), ValueError, "key: 1 heads.*enable_gqa"),
        (lambda: flashattn.flex_attention(q, k, v, score_mod=3), TypeError, "score_mod: expected a callable"),
        (lambda: flashattn.flex_attention(q, k, v, scale="x"), TypeError, "scale"),
        (lambda: flashattn.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64}), ValueError, "kernel_options"),
        (lambda: flashattn.flex_attention(q[:, :, :8], k, v, block_mask=bm), ValueError, "block_mask: built for"),
        (lambda: flashattn.flex_attention(q, k, v, block_mask=fa.create_block_mask(causal, None, None, 9, 9,
                                                                                   device="cpu")),
         TypeError, "block_mask: expected a flashattn.BlockMask"),
        (lambda: flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + math.nan), ValueError,
         "score_mod <lambda>: returned nan"),
        (lambda: flashattn.create_block_mask(causal, 0, None, 9, 9), ValueError, "B: expected a positive integer"),
        (lambda: flashattn.create_block_mask(causal, None, None, 9, 9, device="cuda"), ValueError, "device"),
        (lambda: flashattn.create_block_mask(causal, None, None, 9, 9, device="bogus"), ValueError,
         "device: not a device"),
        (lambda: flashattn.create_block_mask(causal, None, None, 9, 9, BLOCK_SIZE=(4, 8)), ValueError,
         "BLOCK_SIZE: flashattn's blocks are square"),
        (lambda: flashattn.create_block_mask(lambda b, h, i, j: (i - j).float(), None, None, 9, 9), TypeError,
         "mask_mod <lambda>: expected a bool tensor"),
        (lambda: flashattn.create_block_mask("causal", None, None, 9, 9), TypeError, "mask_mod: expected a callable"),
        # One value per (b, h, q_idx, kv_idx), not a raw reshape error.
        (lambda: flashattn.create_block_mask(lambda b, h, i, j: torch.stack([i >= j, i < j]), 1, 1, 9, 9), ValueError,
         r"mask_mod <lambda>: returned a value of shape \(2,\) per element; it must return one bool"),
        (lambda: flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + torch.zeros(2) + i), ValueError,
         r"score_mod <lambda>: returned a value of shape \(2,\) per element; it must return one score"),
        (lambda: flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (j - i) * torch.ones(3)),
         ValueError, r"score_mod <lambda>: returned a value of shape \(3,\) per element"),  # per diagonal
        (lambda: flashattn.flex_attention(torch.cat([q, q]), k, v), ValueError, "key: batch 1 but query has 2"),
        (lambda: flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + learned[h]),
         NotImplementedError, "score_mod <lambda>: its result requires grad"),
        # flex_attention's names, not the native views' q, k, v.
        (lambda: flashattn.flex_attention(q, k.bfloat16(), v), TypeError, "key: dtype torch.bfloat16 but query"),
        (lambda: flashattn.flex_attention(q, k, v, scale=math.nan), ValueError, "scale: must be finite"),
        (lambda: flashattn.flex_attention(q[:, :0], k[:, :0], v[:, :0]), ValueError, "query: 0 heads"),
        # c * log2(e) overflows float32 above float32's largest over log2(e): refused, not NaN.
        (lambda: flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + torch.where(j == 3, 3e38, 0.0)),
         ValueError, r"score_mod <lambda>: returned 3\.0+\d*e\+38 .* \(0, 0, 0, 3\).*magnitude up to 2\.35e\+38"),
        # A mask evaluated at b = 0 (or h = 0) only cannot stand for a mask_mod that reads b (h).
        (lambda: flashattn.flex_attention(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]),
                                          block_mask=flashattn.create_block_mask(lambda b, h, i, j: (i >= j) | (b == 1),
                                                                                 None, None, 9, 9, BLOCK_SIZE=4)),
         ValueError, "block_mask: built with B = 1 .* mask_mod reads b and query has 2 of them"),
        (lambda: flashattn.flex_attention(q, k, v, block_mask=flashattn.create_block_mask(
            lambda b, h, i, j: (i >= j) | (h == 1), 1, 1, 9, 9, BLOCK_SIZE=4)),
         ValueError, "block_mask: built with H = 1 .* mask_mod reads h and query has 2 of them"),
    ]
    for call, error, fragment in calls:
        with pytest.raises(error, match=fragment):
            call()


def test_block_mask_broadcast_where_mask_mod_ignores_the_index():
    """B = None / H = None stand for every batch element and head when mask_mod does not read
    b / h: the result equals the mask built per (b, h)."""
    q, k, v = (torch.randn(2, 3, 9, 8) for _ in range(3))
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    got = flashattn.flex_attention(q, k, v, block_mask=flashattn.create_block_mask(causal, None, None, 9, 9, BLOCK_SIZE=4))
    want = flashattn.flex_attention(q, k, v, block_mask=flashattn.create_block_mask(causal, 2, 3, 9, 9, BLOCK_SIZE=4))
    assert torch.equal(got, want)


@pytest.mark.parametrize("score_mod, slope, offset", [
    (lambda s, b, h, i, j: (lambda t: (s.mul_(2.0), t + 0.5)[1])(s.view(s.shape)), 2.0, 0.5),
    (lambda s, b, h, i, j: (lambda t: (s.div_(4.0), t - 0.25 * j)[1])(s[...]), 0.25, "kv"),
    (lambda s, b, h, i, j: (lambda c: (c.mul_(-1.0), c - 1.0)[1])(s.clone()), -1.0, -1.0),
    (lambda s, b, h, i, j: s.add_(-0.25 * j), 1.0, "kv"),
    (lambda s, b, h, i, j: (s * 1.0).add_(-0.25 * j), 1.0, "kv"),
], ids=["view-then-mul_", "slice-then-div_", "clone-then-mul_", "add_-by-index", "copy-then-add_-by-index"])
def test_score_mod_writing_the_score_in_place_is_followed_through_its_views(score_mod, slope, offset):
    """A score_mod that changes the score in place is evaluated with the change seen by every
    view of it (a view taken before mul_ was taken for the score itself: slope 1), also by a
    value that depends on an index (each score evaluated from a copy of its own)."""
    _, q, k, v, _ = inputs(seed_for("in-place"), HQ, 7, 10, torch.float32)
    bias = -0.25 * torch.arange(10, dtype=torch.float64) if offset == "kv" else offset
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    want = torch.softmax(slope * scores + bias, dim=-1) @ v.double()
    got = flashattn.flex_attention(q, k, v, score_mod=score_mod)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


def test_in_place_score_mod_evaluated_per_diagonal():
    """A score_mod that changes the score in place by a value that reads q_idx and kv_idx only
    through kv_idx - q_idx (a relative bias, ALiBi) is still evaluated once per diagonal, each
    diagonal's score a copy of its own: as its out-of-place form, against the float64 reference
    and torch's FlexAttention."""
    table, slopes = torch.randn(40, dtype=torch.float64), torch.rand(HQ, dtype=torch.float64) * 0.3

    def rel_in_place(s, b, h, q, kv):
        s.add_(table[kv - q + 20])
        return s

    def alibi_in_place(s, b, h, q, kv):
        s.sub_((q - kv).abs() * slopes[h])
        return s

    out_of_place = {rel_in_place: lambda s, b, h, q, kv: s + table[kv - q + 20],
                    alibi_in_place: lambda s, b, h, q, kv: s - (q - kv).abs() * slopes[h]}
    _, q, k, v, dout = inputs(seed_for("in-place-diagonal"), HQ, 7, 10, torch.float32)
    for mod, plain in out_of_place.items():
        assert _flex._trace(mod, 1, mod.__name__)[4]  # taken as relative: the per-diagonal path
        a, c, _ = _flex._score_coefficients(mod, (B, HQ, 7, 10))
        assert a is None and c.shape == (1, HQ if mod is alibi_in_place else 1, 1, 7 + 10 - 1)
        got = run(ours, q, k, v, dout, score_mod=mod)
        ref = run(dense_flex, q.double(), k.double(), v.double(), dout.double(), score_mod=plain)
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            within_torch(name, g, r, None, name != "out", mod.__name__)
        torch.testing.assert_close(got[0].double(), torch_flex(q.double(), k.double(), v.double(), score_mod=plain),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("score_mod", [
    lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.full_like(s, NEG_INF)),
    lambda s, b, h, q, kv: torch.where(q >= kv, s, s.new_full((), NEG_INF)),
    lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.empty_like(s).fill_(NEG_INF)),
    lambda s, b, h, q, kv: s * torch.ones_like(s) + torch.zeros_like(s) + (q - kv) * 0.1,
    lambda s, b, h, q, kv: s + s.new_zeros(()) + torch.full_like(q, 2) * 0.25 + s.new_ones(()),
], ids=["full_like", "new_full", "empty_like-fill_", "ones_like-zeros_like", "new_zeros-full_like-index"])
def test_factories_read_no_values(score_mod):
    """empty_like, zeros_like, ones_like, full_like and new_* read only their tensor argument's
    shape and dtype: a score_mod using them on the score is affine (torch.where(..., s,
    full_like(s, -inf)) the common masking idiom), and one using them on an index reads no index."""
    _, q, k, v, _ = inputs(seed_for("factories"), HQ, 7, 10, torch.float64)
    got = flashattn.flex_attention(q.float(), k.float(), v.float(), score_mod=score_mod)
    torch.testing.assert_close(got.double(), torch_flex(q, k, v, score_mod=score_mod), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.double(), dense_flex(q, k, v, score_mod=score_mod), atol=1e-5, rtol=0)


def test_factories_on_indices_read_no_index():
    """A mask_mod (or score_mod) that builds a tensor like b or h reads neither: its block mask is
    stored once and stands for every batch element and head."""
    fill = lambda b, h, q, kv: (q >= kv) | (torch.zeros_like(b) == 1) | (torch.full_like(h, 3) < 0)  # noqa: E731
    bm = flashattn.create_block_mask(fill, None, None, 9, 9, BLOCK_SIZE=4)
    assert not bm._reads_index(0) and not bm._reads_index(1)
    assert flashattn.create_block_mask(fill, 2, 3, 9, 9, BLOCK_SIZE=4)._states.shape[:2] == (1, 1)
    q, k, v = (torch.randn(2, 3, 9, 8) for _ in range(3))
    causal = flashattn.create_block_mask(lambda b, h, i, j: i >= j, None, None, 9, 9, BLOCK_SIZE=4)
    assert torch.equal(flashattn.flex_attention(q, k, v, block_mask=bm),
                       flashattn.flex_attention(q, k, v, block_mask=causal))
    a, c, _ = _flex._score_coefficients(lambda s, b, h, i, j: s + torch.ones_like(b) + h.new_zeros(()), (2, 3, 9, 9))
    assert a is None and c.shape == (1, 1, 1, 1)


@pytest.mark.parametrize("minimum", [torch.float64, torch.float32, torch.bfloat16, "score"])
def test_score_mod_finfo_min_weighs_nothing(minimum):
    """torch.finfo(dtype).min as a mask value in a score_mod (Hugging Face's idiom; the mods see
    float64 scores, so finfo(score.dtype).min is float64's): a value below minus the largest the
    kernels add (2.35e38) at every score evaluated is taken as that, as the SDPA path clamps
    attn_mask — the key gets weight 0 beside others, and a row where every key gets it weighs
    them alike (torch's out) — with the gradients of that function. Against float64 softmax with
    -2.35e38 in its place, and torch's flex_attention (float32, where the value fits)."""
    _, q, k, v, dout = inputs(seed_for("finfo-min", str(minimum)), HQ, 7, 10, torch.float32)

    def make(low):
        def where_min(s, b, h, i, j):  # a = 0 where it gives low: evaluated at two scores
            return torch.where((i >= j) & (i >= 2), s, low(s))

        def additive_min(s, b, h, i, j):  # an additive mask (a = 1): evaluated at score 0 only
            return s + torch.where((i >= j) & (i >= 2), s.new_zeros(()), low(s))
        return where_min, additive_min

    def softmax_ref(q, k, v, score_mod):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        idx = (None, torch.arange(HQ).view(HQ, 1, 1), torch.arange(7).view(7, 1), torch.arange(10))
        return torch.softmax(score_mod(s, *idx), dim=-1) @ v

    mods = make(lambda s: torch.finfo(s.dtype if minimum == "score" else minimum).min)
    clamped = make(lambda s: -_flex._C_LIMIT)
    where_inf = make(lambda s: NEG_INF)[0]
    lse_inf = flashattn.flex_attention(q, k, v, score_mod=where_inf, return_lse=True)[1]
    for mod, same in zip(mods, clamped):
        got = run(ours, q, k, v, dout, score_mod=mod)
        ref = run(softmax_ref, q.double(), k.double(), v.double(), dout.double(), score_mod=same)
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            within_torch(name, g, r, None, name != "out", mod.__name__)
        torch.testing.assert_close(got[0][:, :, :2], v.mean(dim=2, keepdim=True).expand(-1, -1, 2, -1))
        lse = flashattn.flex_attention(q, k, v, score_mod=mod, return_lse=True)[1]
        assert torch.equal(lse[:, :, 2:], lse_inf[:, :, 2:]) and bool((lse[:, :, :2] < -2e38).all())
        if minimum != torch.float64:  # torch's float32 scores overflow float64's
            torch.testing.assert_close(got[0], torch_flex(q, k, v, score_mod=mod), atol=1e-5, rtol=0)
    # Large positive values, and a value below the limit at one score only, are still refused.
    with pytest.raises(ValueError, match="score_mod <lambda>: returned"):
        flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + torch.where(j == 3, 3e38, 0.0))
    with pytest.raises(ValueError, match="score_mod <lambda>: returned"):
        flashattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.where(j == 3, s * 1e300 - 1e300, s))


def test_return_lse_matches_torch():
    fa = pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")
    gen, q, k, v, _ = inputs(seed_for("lse"), HQ, 29, 45, torch.float32)
    score_mod, mask_mod, _ = make_case("alibi_causal", 29, 45, gen)
    bm = flashattn.create_block_mask(mask_mod, None, None, 29, 45, BLOCK_SIZE=BLOCK)
    out, lse = flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    tbm = fa.create_block_mask(mask_mod, None, None, 29, 45, device="cpu", BLOCK_SIZE=BLOCK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_out, want_lse = fa.flex_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                               block_mask=tbm, return_lse=True)
    assert lse.shape == (B, HQ, 29) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)


def test_lse_is_differentiable():
    """A loss on lse as well as on out (a z-loss): dq, dk, dv equal float64 autograd's through
    logsumexp, with a score_mod and a mask that leaves one row without keys (its lse −∞ takes
    no gradient); lse.sum() reaches the op as a stride-0 gradient."""
    gen, q, k, v, _ = inputs(seed_for("lse grad"), HQ, 29, 45, torch.float32)
    score_mod, mask_mod, _ = make_case("alibi_causal", 29, 45, gen)
    hide_row = lambda b, h, qi, ki: mask_mod(b, h, qi, ki) & (qi != 3)  # noqa: E731
    bm = flashattn.create_block_mask(hide_row, None, None, 29, 45, BLOCK_SIZE=BLOCK)
    weights = torch.randn(B, HQ, 29, generator=gen, dtype=torch.float64)

    def reference(q, k, v):
        group = HQ // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
        idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(HQ).view(1, HQ, 1, 1),
               torch.arange(29).view(1, 1, 29, 1), torch.arange(45).view(1, 1, 1, 45))
        s = score_mod(s, *idx).masked_fill(~hide_row(*idx), NEG_INF)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)))
        return p @ vv, lse

    def grads(fn, dtype, loss):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        loss(out.double(), lse.double()).backward()
        return [torch.zeros(x.shape, dtype=torch.float64) if x.grad is None else x.grad.double() for x in leaves]

    ours_fn = lambda q, k, v: flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,  # noqa: E731
                                                       return_lse=True)
    finite = lambda lse: torch.where(torch.isinf(lse), 0.0, lse)  # noqa: E731
    for loss in (lambda o, lse: (o * o).sum() * 0.1 + (finite(lse) * weights).sum() + (finite(lse) ** 2).sum() * 0.01,
                 lambda o, lse: finite(lse).sum()):
        want = grads(reference, torch.float64, loss)
        got = grads(ours_fn, torch.float32, loss)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=name)
    assert got[0][:, :, 3].abs().max() == 0.0  # the row without keys


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_score_mod_adding_a_huge_constant_to_whole_rows(dtype):
    """A score_mod that adds -1e9 to every score of some rows (padding rows written as a score
    bias) with a gradient flowing into them: their lse rounds to the row maximum in float32 and
    the backward recomputes their offsets from their own scores, the score_mod applied through
    the kernels' hook. Gradients within 3x the naive same-precision error of float64 (the naive
    one's scores rounded near -1e9 are far off on those rows)."""
    dt = DTYPES[dtype]
    seed = seed_for("flex_huge_rows", dtype)
    gen, q, k, v, dout = inputs(seed, 2, 37, 53, dt)
    pad = torch.zeros(37)
    pad[3:9] = -1e9
    pad[20] = -1e9

    def padded(score, b, h, q_idx, kv):
        return score + pad[q_idx]

    kw = dict(score_mod=padded, enable_gqa=True)
    got = run(ours, q, k, v, dout, **kw)
    naive = run(dense_flex, q, k, v, dout, **kw)
    ref = run(dense_flex, q.double(), k.double(), v.double(), dout.double(), **kw)
    for name, g, r, n in zip(("dq", "dk", "dv"), got[1:], ref[1:], naive[1:]):
        err, naive_err = ((x.double() - r).abs().max().item() for x in (g, n))
        assert err <= 3 * naive_err + 1e-4, f"{name}: max error {err:.3e}, naive {naive_err:.3e} (seed={seed})"


def test_default_block_size_and_scale():
    """BLOCK_SIZE 128 (one block over short lengths: partial) and an explicit scale."""
    gen, q, k, v, dout = inputs(seed_for("defaults"), HQ, 150, 131, torch.float32)
    _, mask_mod, _ = make_case("sliding_window", 150, 131, gen)
    bm = flashattn.create_block_mask(mask_mod, None, None, 150, 131)
    assert bm.BLOCK_SIZE == (128, 128) and bm.to_states().shape == (1, 1, 2, 2)
    got = run(lambda q, k, v: flashattn.flex_attention(q, k, v, block_mask=bm, scale=0.3), q, k, v, dout)
    ref = run(lambda q, k, v: dense_flex(q, k, v, mask_mod=mask_mod, scale=0.3), q.double(), k.double(), v.double(),
              dout.double())
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        within_torch(name, g, r, None, name != "out", "defaults")


def test_opcheck():
    gen, q, k, v, _ = inputs(seed_for("opcheck"), 2, 19, 23, torch.float32)
    score_mod, mask_mod, _ = make_case("softcap_rel_document", 19, 23, gen)
    bm = flashattn.create_block_mask(mask_mod, B, None, 19, 23, BLOCK_SIZE=8)
    a, c, cap = _flex._score_coefficients(score_mod, (B, HQ, 19, 23))
    assert cap > 0.0 and c is not None
    t = lambda x: x.transpose(1, 2).requires_grad_(True)  # noqa: E731
    mods = (bm._states, bm._partial_index, bm._partial_blocks, 8, a, c, cap)
    for args in ((None, None, None, 0, a, c, cap), mods, (*mods[:4], None, None, 0.0)):
        torch.library.opcheck(torch.ops.flashattn.flex_fwd, (t(q), t(k), t(v), 0.4, *args, 1))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = torch.ops.flashattn.flex_fwd(qt, kt, vt, None, *mods, 1)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(torch.ops.flashattn.flex_bwd, (dout, qt, kt, vt, out, lse, None, *mods, 1))


def test_ops_check_what_the_hook_reads():
    """The ops refuse coefficients that do not broadcast to the problem, block states that are
    no ScoreBlock and partial slots outside the partial blocks, before the native call."""
    q, k, v = (torch.randn(1, 9, 2, 8) for _ in range(3))
    bm = flashattn.create_block_mask(lambda b, h, i, j: i >= j, None, None, 9, 9, BLOCK_SIZE=4)
    mods = (bm._states, bm._partial_index, bm._partial_blocks, 4)
    with pytest.raises(ValueError, match="score_c: expected float32 broadcastable"):
        torch.ops.flashattn.flex_fwd(q, k, v, None, *mods, None, torch.zeros(1, 2, 10, 9), 0.0, 1)
    with pytest.raises(ValueError, match=r"or of shape \(B or 1, Hq or 1, 1, Sq \+ Sk - 1\).*\(1, 1, 1, 18\)"):
        torch.ops.flashattn.flex_fwd(q, k, v, None, *mods, None, torch.zeros(1, 1, 1, 18), 0.0, 1)  # 17 diagonals
    with pytest.raises(ValueError, match="score_a: expected float32"):
        torch.ops.flashattn.flex_fwd(q, k, v, None, *mods, torch.zeros(1, 1, 1, 1, dtype=torch.float64), None, 0.0, 1)
    with pytest.raises(ValueError, match=r"block_mask: partial index 1 of the partial block at \(0, 0, 1, 1\) is "
                                         "outside its 1 partial blocks"):
        torch.ops.flashattn.flex_fwd(q, k, v, None, bm._states, bm._partial_index, bm._partial_blocks[:1], 4, None,
                                     None, 0.0, 1)
    # Every slot is read, negative ones too (a slot of -7 read bytes before the table, -1e8 crashed).
    for slot in (-7, -1, -100_000_000):
        index = bm._partial_index.clone()
        index[index >= 0] = slot
        with pytest.raises(ValueError, match=f"partial index {slot} of the partial block at"):
            torch.ops.flashattn.flex_fwd(q, k, v, None, bm._states, index, bm._partial_blocks, 4, None, None, 0.0, 1)
        with pytest.raises(ValueError, match=f"partial index {slot}"):
            flashattn.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     block_mask=flashattn.BlockMask(bm._states, index, bm._partial_blocks, bm.shape, 4,
                                                                    bm.mask_mod))
    with pytest.raises(TypeError, match="expected int32 elements"):  # a float32 index's bits are no slots
        torch.ops.flashattn.flex_fwd(q, k, v, None, bm._states, bm._partial_index.float(), bm._partial_blocks, 4,
                                     None, None, 0.0, 1)
    states = bm._states.clone()
    states[0, 0, 2, 0] = 9
    with pytest.raises(ValueError, match=r"block_mask: block state 9 at \(0, 0, 2, 0\) is not 0 \(empty\)"):
        torch.ops.flashattn.flex_fwd(q, k, v, None, states, bm._partial_index, bm._partial_blocks, 4, None, None, 0.0,
                                     1)
    with pytest.raises(ValueError, match="score_hook.block_mask: shape"):
        torch.ops.flashattn.flex_fwd(q, k, v, None, bm._states[:, :, :2], bm._partial_index[:, :, :2],
                                     bm._partial_blocks, 4, None, None, 0.0, 1)


def test_compile_matches_eager():
    """torch.compile graph-breaks around flex_attention (its mods are evaluated eagerly) and
    gives eager's results and gradients."""
    gen, q, k, v, dout = inputs(seed_for("compile"), 2, 21, 34, torch.float32)
    score_mod, mask_mod, _ = make_case("alibi_causal", 21, 34, gen)
    bm = flashattn.create_block_mask(mask_mod, None, None, 21, 34, BLOCK_SIZE=8)

    def f(q, k, v):
        return flashattn.flex_attention(q * 1.5, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True) * 2.0

    eager = run(f, q, k, v, dout)
    torch._dynamo.reset()
    compiled = run(torch.compile(f, backend="aot_eager"), q, k, v, dout)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=0, rtol=0)
