"""The torch.library custom ops (flashattn::fwd, bwd, varlen_fwd, varlen_bwd, fwd_kvcache):
torch.library.opcheck on random inputs, meta tensors, torch.compile(fullgraph=True) and
torch.export of a small model. Skipped without torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from conftest import seed_for  # noqa: E402

OPS = torch.ops.flashattn


def rand(gen, shape, dtype, requires_grad=False):
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_(requires_grad)


def options(causal=False, dropout_p=0.0, rng=None, alibi=None, window=(-1, -1), softcap=0.0):
    """The forward ops' options in schema order (fwd and varlen_fwd)."""
    return (dropout_p, None, causal, window[0], window[1], softcap, alibi, True, rng, "auto", "auto", 0)


def backward_options(causal=False, dropout_p=0.0, rng=None):
    return (dropout_p, None, causal, -1, -1, 0.0, None, True, rng, "auto", 0)


CASES = [
    dict(dtype=torch.float32, hq=4, hkv=4, causal=False),
    dict(dtype=torch.float32, hq=4, hkv=2, causal=True),
    dict(dtype=torch.bfloat16, hq=6, hkv=2, causal=True),
    dict(dtype=torch.float32, hq=2, hkv=1, causal=False, dropout=0.25),
]
CASE_IDS = ["f32", "f32-gqa-causal", "bf16-gqa-causal", "f32-mqa-dropout"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_opcheck_fwd_bwd(case):
    seed = seed_for("opcheck", str(case))
    gen = torch.Generator().manual_seed(seed)
    dt = case["dtype"]
    q = rand(gen, (2, 13, case["hq"], 16), dt, True)
    k = rand(gen, (2, 21, case["hkv"], 16), dt, True)
    v = rand(gen, (2, 21, case["hkv"], 24), dt, True)
    p = case.get("dropout", 0.0)
    rng = torch.tensor([seed, 7], dtype=torch.int64) if p else None
    alibi = None if p else torch.rand(case["hq"], generator=gen) * 0.3
    fwd_args = (q, k, v) + options(case["causal"], p, rng, alibi)
    torch.library.opcheck(OPS.fwd, fwd_args)
    out, lse = OPS.fwd(*fwd_args)
    dout = rand(gen, tuple(out.shape), dt)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse) + backward_options(case["causal"], p, rng)
    torch.library.opcheck(OPS.bwd, bwd_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_opcheck_sinks(dtype):
    """fwd, bwd, varlen_fwd, varlen_bwd with sinks: schema, fake kernels (dsinks (Hq) float32),
    autograd registration (a gradient for sinks)."""
    gen = torch.Generator().manual_seed(seed_for("opcheck_sinks", str(dtype)))
    q = rand(gen, (2, 13, 4, 16), dtype, True)
    k = rand(gen, (2, 21, 2, 16), dtype, True)
    v = rand(gen, (2, 21, 2, 16), dtype, True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    fwd_args = (q, k, v) + options(causal=True)
    torch.library.opcheck(OPS.fwd, fwd_args, {"sinks": sinks})
    out, lse = OPS.fwd(*fwd_args, sinks=sinks)
    bwd_args = (rand(gen, tuple(out.shape), dtype), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    torch.library.opcheck(OPS.bwd, bwd_args + backward_options(causal=True), {"sinks": sinks.detach()})
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 21], dtype=torch.int32)
    varlen_args = (q[0], k[0], v[0], cu, cu_k, 8, 12) + options(causal=True)
    torch.library.opcheck(OPS.varlen_fwd, varlen_args, {"sinks": sinks})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_opcheck_varlen(dtype):
    seed = seed_for("opcheck_varlen", str(dtype))
    gen = torch.Generator().manual_seed(seed)
    lq, lk = [5, 0, 11], [7, 3, 9]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    q = rand(gen, (sum(lq), 4, 16), dtype, True)
    k = rand(gen, (sum(lk), 2, 16), dtype, True)
    v = rand(gen, (sum(lk), 2, 16), dtype, True)
    fwd_args = (q, k, v, cu_q, cu_k, max(lq), max(lk)) + options(causal=True)
    torch.library.opcheck(OPS.varlen_fwd, fwd_args)
    out, lse = OPS.varlen_fwd(*fwd_args)
    dout = rand(gen, tuple(out.shape), dtype)
    bwd_args = ((dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, max(lq), max(lk))
                + backward_options(causal=True))
    torch.library.opcheck(OPS.varlen_bwd, bwd_args)


def _kvcache_args(gen, dtype, cache_seqlens):
    q = rand(gen, (2, 1, 4, 16), dtype)
    k_cache, v_cache = rand(gen, (2, 12, 2, 16), dtype), rand(gen, (2, 12, 2, 16), dtype)
    k_new, v_new = rand(gen, (2, 1, 2, 16), dtype), rand(gen, (2, 1, 2, 16), dtype)
    return (q, k_cache, v_cache, k_new, v_new, None, None, cache_seqlens, None, None, None, None, True, -1, -1, 0.0,
            True, None, 0, None, None, "auto", 0)


def test_opcheck_int8_kvcache():
    """An int8 cache with per-token scales: the op writes the codes, the scales and (u8) the
    zero points of the appended slot, all declared mutated."""
    gen = torch.Generator().manual_seed(seed_for("opcheck_int8_kvcache"))
    seqlens = torch.tensor([3, 8], dtype=torch.int32)
    args = list(_kvcache_args(gen, torch.float32, seqlens))
    args[1], args[2] = torch.zeros((2, 12, 2, 16), dtype=torch.uint8), torch.zeros((2, 12, 2, 16), dtype=torch.int8)
    args[19], args[20] = torch.ones((2, 12, 2)), torch.ones((2, 12, 2))  # k_scale, v_scale
    kwargs = dict(k_zero_point=torch.zeros((2, 12, 2)), k_quant="u8/per_token", v_quant="s8/per_token")
    torch.library.opcheck(OPS.fwd_kvcache, tuple(args), kwargs)
    OPS.fwd_kvcache(*args, **kwargs)
    for b in range(2):
        slot = int(seqlens[b])
        k_new, scale, zero = args[3][b, 0], args[19][b, slot], kwargs["k_zero_point"][b, slot]
        want = (k_new.amax(-1) - k_new.amin(-1)) / 255
        torch.testing.assert_close(scale, want, msg=f"k_scale of the appended slot (batch {b})")
        got = (args[1][b, slot].float() - zero[:, None]) * scale[:, None]
        assert (got - k_new).abs().le(0.5 * scale[:, None] * (1 + 1e-5)).all(), f"k_new within half a step (batch {b})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_opcheck_kvcache(dtype):
    """The cache is declared mutated (opcheck checks that the schema says so), and the
    appended token lands in it."""
    gen = torch.Generator().manual_seed(seed_for("opcheck_kvcache", str(dtype)))
    seqlens = torch.tensor([3, 8], dtype=torch.int32)
    args = _kvcache_args(gen, dtype, seqlens)
    torch.library.opcheck(OPS.fwd_kvcache, args)
    schema = OPS.fwd_kvcache.default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == {"k_cache", "v_cache", "k_scale", "v_scale", "k_zero_point", "v_zero_point"}, mutated
    q, k_cache, v_cache, k_new, v_new = args[:5]
    OPS.fwd_kvcache(*args)
    for b in range(2):
        assert torch.equal(k_cache[b, int(seqlens[b])], k_new[b, 0]), f"k_new not appended (batch {b})"
        assert torch.equal(v_cache[b, int(seqlens[b])], v_new[b, 0]), f"v_new not appended (batch {b})"


def test_meta_shapes():
    """Meta tensors go through the fake kernels: shapes and dtypes without data."""
    q = torch.empty(3, 17, 8, 32, device="meta", dtype=torch.bfloat16)
    k = torch.empty(3, 29, 2, 32, device="meta", dtype=torch.bfloat16)
    v = torch.empty(3, 29, 2, 48, device="meta", dtype=torch.bfloat16)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert out.device.type == "meta" and out.shape == (3, 17, 8, 48) and out.dtype == torch.bfloat16
    out, lse = OPS.fwd(q, k, v, *options())
    assert lse.shape == (3, 8, 17) and lse.dtype == torch.float32
    dq, dk, dv, dsinks = OPS.bwd(out, q, k, v, out, lse, *backward_options())
    assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, v.shape, (0,))
    sinks = torch.empty(8, device="meta")
    out, lse = OPS.fwd(q, k, v, *options(), sinks=sinks)
    dsinks = OPS.bwd(out, q, k, v, out, lse, *backward_options(), sinks=sinks)[3]
    assert dsinks.shape == (8,) and dsinks.dtype == torch.float32
    qv, kv = torch.empty(40, 8, 32, device="meta"), torch.empty(50, 2, 32, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out = flashattn.flash_attn_varlen_func(qv, kv, kv, cu, cu, 20, 20)
    assert out.device.type == "meta" and out.shape == (40, 8, 32)
    qc, cache = torch.empty(3, 1, 8, 32, device="meta"), torch.empty(3, 64, 2, 32, device="meta")
    out, lse = flashattn.flash_attn_with_kvcache(qc, cache, cache, cache_seqlens=5, return_softmax_lse=True)
    assert out.shape == (3, 1, 8, 32) and lse.shape == (3, 8, 1)


def test_a_meta_tensor_among_cpu_ones_is_refused_by_name():
    """The dispatcher sends a call that mixes a meta tensor with CPU ones to the fake kernel:
    it names the argument (before, it returned uninitialised CPU memory)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (rand(gen, (1, 6, 2, 8), torch.float32) for _ in range(3))
    meta = k.to("meta")
    calls = {
        "flash_attn_func k": (lambda: flashattn.flash_attn_func(q, meta, v), "k: device meta, but q is on cpu"),
        "flash_attn_varlen_func v": (lambda: flashattn.flash_attn_varlen_func(
            q[0], k[0], meta[0], *(torch.tensor([0, 6], dtype=torch.int32),) * 2, 6, 6), "v: device meta"),
        "sdpa key": (lambda: flashattn.scaled_dot_product_attention(q.transpose(1, 2), meta.transpose(1, 2),
                                                                     v.transpose(1, 2)), "key: device meta"),
        "sdpa attn_mask": (lambda: flashattn.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=torch.zeros(6, 6, device="meta")),
            "attn_mask: device meta, but query is on cpu"),
        "flex_attention value": (lambda: flashattn.flex_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                  meta.transpose(1, 2)), "value"),
    }
    for what, (call, match) in calls.items():
        with pytest.raises(ValueError, match=match):
            call()
            pytest.fail(f"{what}: no error")


class _Block(torch.nn.Module):
    """Projections around flash_attn_func, as a model would use it."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        kv = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim)
        out = flashattn.flash_attn_kvpacked_func(q, kv, causal=True, deterministic=True)
        return self.o(out.reshape(b, s, -1))


def _model_and_input(seed):
    torch.manual_seed(seed)
    model = _Block()
    x = torch.randn(2, 19, 32, requires_grad=True)
    return model, x


def test_compile_fullgraph_matches_eager():
    """One graph (no break: fullgraph=True raises on any), the eager output and gradients
    (the backward op runs in the compiled backward)."""
    seed = seed_for("compile")
    model, x = _model_and_input(seed)
    eager = model(x)
    eager.sum().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    torch.testing.assert_close(got, eager, rtol=0, atol=0, msg=lambda m: f"compiled != eager (seed={seed})\n{m}")
    got.sum().backward()
    for i, (a, b) in enumerate(zip([x.grad] + [p.grad for p in model.parameters()], eager_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"gradient {i} (seed={seed})\n{m}")


def test_compile_inductor_no_graph_break():
    """The default backend (inductor) with a graph break counter: one graph, no breaks."""
    seed = seed_for("inductor")
    model, x = _model_and_input(seed)
    x = x.detach()
    with torch.no_grad():
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
        got = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5, msg=lambda m: f"(seed={seed})\n{m}")


def test_inductor_backward_of_strided_views():
    """Training under inductor (the default backend) with q, k, v as the strided views models
    pass — (B, H, S, D) transposed to (B, S, H, D), a packed batch's columns — through flash_attn_func
    (flashattn::bwd) and flash_attn_varlen_func (varlen_bwd), sinks with them: inductor checks the
    gradients' real strides against the fake kernels' (contiguous, as the native backward writes
    them), and the gradients equal eager's. Without the compile caches, so that an earlier
    process's graphs cannot stand in for this one's."""
    seed = seed_for("inductor_strided_backward")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 6, 16, generator=gen)
    w = torch.randn(16, 16, generator=gen)
    sinks = torch.randn(4, generator=gen)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def dense(x, w, sinks):
        q, k = (x @ w).transpose(1, 2), x.transpose(1, 2)
        return flashattn.flash_attn_func(q, k, k, causal=True, learnable_sink=sinks).square().sum()

    def packed(x, w, sinks):
        q, k = (x @ w).transpose(1, 2).reshape(12, 4, 16), x.transpose(1, 2).reshape(12, 4, 16)
        return flashattn.flash_attn_varlen_func(q, k, k, cu, cu, 7, 7, learnable_sink=sinks).square().sum()

    for fn in (dense, packed):
        grads = []
        for run in (fn, torch.compile(fn)):
            leaves = [t.clone().requires_grad_(True) for t in (x, w, sinks)]
            with torch._inductor.config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                run(*leaves).backward()
            grads.append([t.grad for t in leaves])
        for eager, compiled in zip(*grads):
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{fn.__name__} (seed={seed})\n{m}")


def test_export():
    seed = seed_for("export")
    model, x = _model_and_input(seed)
    x = x.detach()
    exported = torch.export.export(model, (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "flashattn.fwd.default" in targets, targets
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), model(x), rtol=0, atol=0)


def test_compile_dropout_draws_from_torch_generator():
    """Under torch.compile the (seed, offset) draw is part of the graph (no break), so
    torch.manual_seed reproduces a compiled run; aot_eager keeps eager's generator draws
    (inductor generates its own random numbers, reproducible but not eager's)."""
    q, k, v = (torch.randn(1, 16, 2, 16, generator=torch.Generator().manual_seed(seed_for("cdrop", i)))
               for i in range(3))

    def f(q, k, v):
        return flashattn.flash_attn_func(q, k, v, dropout_p=0.2)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    a, b = compiled(q, k, v), compiled(q, k, v)
    torch.manual_seed(3)
    e = f(q, k, v)
    assert torch.equal(a, e) and not torch.equal(a, b)


def test_compile_return_attn_probs_without_dropout():
    """return_attn_probs=True is upstream's way to get softmax_lse (ring attention takes it):
    without dropout S_dmask is the empty tensor, built inside the graph — it made a native
    Options object that dynamo cannot trace. Dense and varlen, equal to eager."""
    q, k, v = (torch.randn(1, 12, 2, 16, generator=torch.Generator().manual_seed(seed_for("probs", i)))
               for i in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def dense(q, k, v):
        return flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)

    def varlen(q, k, v):
        return flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 7, return_attn_probs=True)

    for f in (dense, varlen):
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
        want = f(q, k, v)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert got[2].shape == (0,)


def test_eager_inference_skips_the_dispatcher_only_where_nothing_watches():
    """Plain eager inference calls the implementation directly (same result as the op);
    an autograd graph, a dispatch mode (profilers, FlopCounterMode) or a traced graph gets
    the op itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(seed_for("direct"))
    q, k, v = rand(gen, (2, 9, 4, 16), torch.float32), rand(gen, (2, 11, 2, 16), torch.float32), \
        rand(gen, (2, 11, 2, 16), torch.float32)
    plain = flashattn.flash_attn_func(q, k, v, causal=True)
    with Seen() as seen:
        watched = flashattn.flash_attn_func(q, k, v, causal=True)
    assert "flashattn.fwd.default" in seen.ops, seen.ops
    assert torch.equal(plain, watched)
    qg = q.clone().requires_grad_(True)
    out = flashattn.flash_attn_func(qg, k, v, causal=True)
    assert out.grad_fn is not None and torch.equal(out.detach(), plain)

    cache_k, cache_v = rand(gen, (2, 12, 2, 16), torch.float32), rand(gen, (2, 12, 2, 16), torch.float32)
    qc, kn = rand(gen, (2, 1, 4, 16), torch.float32), rand(gen, (2, 1, 2, 16), torch.float32)
    versions = cache_k._version, cache_v._version
    with torch.no_grad():
        flashattn.flash_attn_with_kvcache(qc, cache_k, cache_v, k=kn, v=kn, cache_seqlens=3)
    assert cache_k._version > versions[0] and cache_v._version > versions[1], "cache writes not versioned"
    with Seen() as seen:
        flashattn.flash_attn_with_kvcache(qc, cache_k, cache_v, k=kn, v=kn, cache_seqlens=4)
    assert "flashattn.fwd_kvcache.default" in seen.ops, seen.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_direct_route_of_flash_attn_func_equals_the_op(dtype):
    """An inference call with only the arguments _direct_forward takes (scale, causal, window,
    softcap, kernel, threads) runs there — its options cached — and gives the op's bits;
    what it cannot take (a strided last dimension, a rejected shape) goes the general way,
    with the same error."""
    from flashattn import _interface

    gen = torch.Generator().manual_seed(seed_for("direct route"))
    q, k, v = rand(gen, (2, 7, 6, 24), dtype), rand(gen, (2, 13, 2, 24), dtype), rand(gen, (2, 13, 2, 40), dtype)
    for kwargs in (dict(), dict(causal=True), dict(window_size=[3, 1], softcap=5.0), dict(softmax_scale=0.3),
                   dict(causal=True, num_threads=1, kernel="tiled")):
        _interface._DIRECT_OPTIONS.clear()
        got = flashattn.flash_attn_func(q, k, v, **kwargs)
        assert len(_interface._DIRECT_OPTIONS) == 1, f"{kwargs}: not the direct route"
        window = tuple(kwargs.get("window_size", (-1, -1)))
        want, _ = OPS.fwd(q, k, v, 0.0, kwargs.get("softmax_scale"), kwargs.get("causal", False), window[0], window[1],
                          kwargs.get("softcap", 0.0), None, False, None, kwargs.get("kernel", "auto"), "auto",
                          kwargs.get("num_threads", 0))
        assert torch.equal(got, want), kwargs
    _interface._DIRECT_OPTIONS.clear()
    strided = torch.randn(2, 7, 6, 48, generator=gen).to(dtype)[..., ::2]
    assert torch.equal(flashattn.flash_attn_func(strided, k, v), flashattn.flash_attn_func(strided.contiguous(), k, v))
    with pytest.raises(ValueError) as direct:
        flashattn.flash_attn_func(q, k[..., :20], v)
    with pytest.raises(ValueError) as general:
        flashattn.flash_attn_func(q, k[..., :20], v, pack_gqa=False)
    assert str(direct.value) == str(general.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_route_of_flash_attn_with_kvcache_equals_the_op(dtype):
    """An inference KV-cache call on a cache of values — appends, paged or contiguous, left
    padding, lse or not — runs on _direct_kvcache (its options cached) and gives the op's bits
    and cache contents, bumping the caches' versions; a call it cannot take (rotary) goes the
    general way; a rejected one raises the general route's error."""
    from flashattn import _interface

    gen = torch.Generator().manual_seed(seed_for("direct kvcache"))
    q, k_new, v_new = rand(gen, (2, 3, 4, 16), dtype), rand(gen, (2, 3, 2, 16), dtype), rand(gen, (2, 3, 2, 24), dtype)
    for paged in (False, True):
        for append in (False, True):
            shape_k, shape_v = ((6, 8, 2, 16), (6, 8, 2, 24)) if paged else ((2, 24, 2, 16), (2, 24, 2, 24))
            k_cache, v_cache = rand(gen, shape_k, dtype), rand(gen, shape_v, dtype)
            table = torch.tensor([[5, 0, 2], [1, 4, 3]], dtype=torch.int32) if paged else None
            seqlens = torch.tensor([7, 13], dtype=torch.int32)
            leftpad = None if paged else torch.tensor([0, 2], dtype=torch.int32)
            kv = dict(k=k_new, v=v_new) if append else {}
            caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
            _interface._DIRECT_OPTIONS.clear()
            version = caches[0][0]._version
            out, lse = flashattn.flash_attn_with_kvcache(
                q, *caches[0], **kv, cache_seqlens=seqlens, cache_leftpad=leftpad, block_table=table, causal=True,
                window_size=(5, 0), softcap=3.0, return_softmax_lse=True)
            assert len(_interface._DIRECT_OPTIONS) == 1, "not the direct route"
            assert caches[0][0]._version > version
            want_out, want_lse = OPS.fwd_kvcache(
                q, *caches[1], k_new if append else None, v_new if append else None, None, None, seqlens, None,
                leftpad, table, None, True, 5, 0, 3.0, True, None, 0, None, None, "auto", 0)
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (paged, append)
            assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
            alone = flashattn.flash_attn_with_kvcache(q, *caches[0], cache_seqlens=seqlens + (3 if append else 0),
                                                      cache_leftpad=leftpad, block_table=table, causal=True,
                                                      window_size=(5, 0), softcap=3.0)
            assert torch.equal(alone, out), "the appended cache read again"
    _interface._DIRECT_OPTIONS.clear()
    cos = sin = torch.ones(32, 8)
    flashattn.flash_attn_with_kvcache(q, *caches[0], cache_seqlens=seqlens, block_table=table, rotary_cos=cos,
                                      rotary_sin=sin)
    assert not _interface._DIRECT_OPTIONS, "rotary taken by the direct route"
    with pytest.raises(ValueError) as direct:
        flashattn.flash_attn_with_kvcache(q[..., :8], *caches[0], cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError) as general:
        flashattn.flash_attn_with_kvcache(q[..., :8], *caches[0], cache_seqlens=seqlens, block_table=table,
                                          pack_gqa=False)
    assert str(direct.value) == str(general.value)
    # Tables with a strided last dimension (views into wider ones) go the general way, which
    # copies them (the direct route refused them with a stride error).
    wide_seqlens = torch.stack([seqlens, torch.zeros_like(seqlens)], dim=1)[:, 0]
    wide_table = torch.stack([table, torch.full_like(table, 99)], dim=2).flatten(1)[:, ::2]
    assert wide_seqlens.stride(-1) == 2 and wide_table.stride(-1) == 2 and torch.equal(wide_table, table)
    strided = flashattn.flash_attn_with_kvcache(q, *caches[0], cache_seqlens=wide_seqlens, block_table=wide_table)
    plain = flashattn.flash_attn_with_kvcache(q, *caches[0], cache_seqlens=seqlens, block_table=table)
    assert torch.equal(strided, plain)


def test_compile_kvcache_step_writes_the_cache():
    """A decode step compiled whole: the functionalized op's cache writes land in the
    caller's cache tensors, as eager's do."""
    gen = torch.Generator().manual_seed(seed_for("compile_kvcache"))

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, causal=True)

    q, k, v = rand(gen, (2, 1, 4, 16), torch.float32), rand(gen, (2, 1, 2, 16), torch.float32), \
        rand(gen, (2, 1, 2, 16), torch.float32)
    k_cache, v_cache = rand(gen, (2, 12, 2, 16), torch.float32), rand(gen, (2, 12, 2, 16), torch.float32)
    seqlens = torch.tensor([3, 8], dtype=torch.int32)
    k2, v2 = k_cache.clone(), v_cache.clone()
    eager = step(q, k_cache, v_cache, k, v, seqlens)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k2, v2, k, v, seqlens)
    assert torch.equal(compiled, eager)
    assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache), "compiled step did not append to the cache"


def test_compile_kvcache_with_an_int_or_0d_cache_seqlens():
    """cache_seqlens as a Python int (a traced int once dynamo makes it dynamic) or a 0-d
    int32 tensor compiles whole, step after step, as eager."""
    gen = torch.Generator().manual_seed(seed_for("compile_kvcache_int"))

    def step(q, k_cache, v_cache, k, v, n):
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=n, causal=True)

    k_cache, v_cache = torch.zeros(2, 12, 2, 16), torch.zeros(2, 12, 2, 16)
    k2, v2 = k_cache.clone(), v_cache.clone()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (3, 4, torch.tensor(5, dtype=torch.int32)):
        q, k, v = rand(gen, (2, 1, 4, 16), torch.float32), rand(gen, (2, 1, 2, 16), torch.float32), \
            rand(gen, (2, 1, 2, 16), torch.float32)
        assert torch.equal(compiled(q, k2, v2, k, v, n), step(q, k_cache, v_cache, k, v, n)), n
        assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache), n


def test_cu_seqlens_beside_torch_inputs_numpy_taken_anything_else_named():
    """cu_seqlens as a NumPy array beside torch inputs is taken as a tensor (as the paged path's
    tables); a list is a TypeError naming it (before: torch's dispatcher RuntimeError)."""
    gen = torch.Generator().manual_seed(7)
    q = rand(gen, (5, 2, 8), torch.float32)
    cu = np.array([0, 2, 5], np.int32)
    want = flashattn.flash_attn_varlen_func(q, q, q, torch.from_numpy(cu), torch.from_numpy(cu), 3, 3, causal=True)
    assert torch.equal(flashattn.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True), want)
    with pytest.raises(TypeError, match="cu_seqlens_k: expected an int32 torch.Tensor beside torch inputs, got list"):
        flashattn.flash_attn_varlen_func(q, q, q, torch.from_numpy(cu), [0, 2, 5], 3, 3)
    with pytest.raises(TypeError, match="cu_seqlens_q: .* got list"):
        flashattn.flash_attn_varlen_qkvpacked_func(rand(gen, (5, 3, 2, 8), torch.float32, True), [0, 2, 5], 3)
