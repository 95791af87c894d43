"""Bad input: shapes and values raise ValueError, dtypes raise TypeError, each message
naming the argument; what is not implemented raises NotImplementedError naming it."""

import numpy as np
import pytest

import flashattn
from conftest import BF16, make_qkv


def qkv(batch=2, sq=8, sk=8, hq=4, hkv=2, d=8, dv=None, dtype=np.float32):
    return make_qkv(3, batch, sq, sk, hq, hkv, d, dv, dtype)


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("case, pattern", [
    ("k_head_dim", r"k: head_dim 16 does not match q head_dim 8"),
    ("k_batch", r"\bk\b.*batch"),
    ("v_batch", r"\bv\b.*batch"),
    ("v_seqlen", r"\bv\b.*seqlen"),
    ("v_heads", r"\bv\b.*heads"),
    ("heads_not_multiple", r"heads"),
    ("q_rank", r"\bq\b.*rank"),
    ("k_rank3", r"\bk\b.*rank"),
    ("k_rank5", r"\bk\b.*rank"),
    ("head_dim_too_big", r"head_dim"),
])
def test_flash_attn_func_shape_errors(case, pattern):
    q, k, v = qkv()
    if case == "k_head_dim":
        k = np.zeros((2, 8, 2, 16), np.float32)
    elif case == "k_batch":
        k, v = k[:1], v[:1]
    elif case == "v_batch":
        v = v[:1]
    elif case == "v_seqlen":
        v = v[:, :5]
    elif case == "v_heads":
        v = v[:, :, :1]
    elif case == "heads_not_multiple":
        q = np.zeros((2, 8, 3, 8), np.float32)
    elif case == "q_rank":
        q = q[0]
    elif case == "k_rank3":
        k = k[0]
    elif case == "k_rank5":
        k = k[..., None]
    elif case == "head_dim_too_big":
        q, k, v = qkv(sq=2, sk=2, hq=1, hkv=1, d=600)
    with pytest.raises(ValueError, match=pattern):
        flashattn.flash_attn_func(q, k, v)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(dropout_p=1.0), "dropout_p"),
    (dict(dropout_p=-0.1), "dropout_p"),
    (dict(softcap=-1.0), "softcap"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(3, -5)), "window_size"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(alibi_slopes=np.zeros(3, np.float32)), "alibi_slopes"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), "alibi_slopes"),
    (dict(alibi_slopes=np.zeros((2, 4, 1), np.float32)), "alibi_slopes"),
], ids=["dropout_1", "dropout_neg", "softcap_neg", "window_left", "window_right", "scale_nan",
        "alibi_len", "alibi_batch", "alibi_rank"])
def test_flash_attn_func_value_errors(kwargs, pattern):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=pattern):
        flashattn.flash_attn_func(q, k, v, **kwargs)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.bool_],
                         ids=["float64", "int32", "int64", "bool"])
def test_unsupported_dtype(dtype):
    q, k, v = (x.astype(dtype) for x in qkv())
    with pytest.raises(TypeError, match=r"\bq\b"):
        flashattn.flash_attn_func(q, k, v)


@pytest.mark.parametrize("which, other", [("k", np.float16), ("v", BF16), ("k", np.float64), ("v", np.float32)],
                         ids=["k_fp16", "v_bf16", "k_fp64", "v_fp32"])
def test_mixed_dtypes(which, other):
    base = np.float16 if other == np.float32 else np.float32
    args = dict(zip("qkv", qkv(dtype=base)))
    args[which] = args[which].astype(other)
    with pytest.raises(TypeError, match=rf"\b{which}\b"):
        flashattn.flash_attn_func(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("slopes_dtype", [np.float64, np.int32, np.float16], ids=["float64", "int32", "float16"])
def test_alibi_slopes_dtype(slopes_dtype):
    """ALiBi slopes are float32, as upstream requires."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match="alibi_slopes"):
        flashattn.flash_attn_func(q, k, v, alibi_slopes=np.ones(4, slopes_dtype))


# --------------------------------------------------------------------------- packed


def test_qkvpacked_shape_errors():
    good = np.zeros((2, 8, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match="qkv"):
        flashattn.flash_attn_qkvpacked_func(good[:, :, :2])       # 2 instead of 3
    with pytest.raises(ValueError, match="qkv"):
        flashattn.flash_attn_qkvpacked_func(good[0])              # rank 4
    with pytest.raises(TypeError, match="qkv"):
        flashattn.flash_attn_qkvpacked_func(good.astype(np.float64))


def test_kvpacked_shape_errors():
    q = np.zeros((2, 8, 4, 8), np.float32)
    kv = np.zeros((2, 8, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"\bkv\b"):
        flashattn.flash_attn_kvpacked_func(q, kv[:, :, :1])       # 1 instead of 2
    with pytest.raises(ValueError, match=r"\bkv\b"):
        flashattn.flash_attn_kvpacked_func(q, kv[0])              # rank 4
    with pytest.raises(ValueError):
        flashattn.flash_attn_kvpacked_func(q, np.zeros((2, 8, 2, 2, 16), np.float32))  # head_dim
    with pytest.raises(TypeError, match=r"\bkv\b"):
        flashattn.flash_attn_kvpacked_func(q, kv.astype(np.float16))


# --------------------------------------------------------------------------- varlen


def varlen_args():
    q = np.zeros((10, 4, 8), np.float32)
    k = np.zeros((12, 2, 8), np.float32)
    v = np.zeros((12, 2, 8), np.float32)
    cu_q = np.array([0, 4, 10], np.int32)
    cu_k = np.array([0, 7, 12], np.int32)
    return [q, k, v, cu_q, cu_k, 6, 7]


@pytest.mark.parametrize("case, pattern", [
    ("cu_q_not_zero", "cu_seqlens_q"),
    ("cu_q_decreasing", "cu_seqlens_q"),
    ("cu_q_last", "cu_seqlens_q"),
    ("cu_k_last", "cu_seqlens_k"),
    ("cu_count_mismatch", "cu_seqlens"),
    ("cu_rank", "cu_seqlens_q"),
    ("max_seqlen_q_small", "max_seqlen_q"),
    ("max_seqlen_k_small", "max_seqlen_k"),
    ("q_rank", r"\bq\b"),
    ("v_total", r"\bv\b"),
    ("k_head_dim", r"\bk\b.*head_dim"),
])
def test_varlen_value_errors(case, pattern):
    args = varlen_args()
    if case == "cu_q_not_zero":
        args[3] = np.array([1, 4, 10], np.int32)
    elif case == "cu_q_decreasing":
        args[3] = np.array([0, 6, 5, 10], np.int32)
        args[4] = np.array([0, 3, 7, 12], np.int32)
    elif case == "cu_q_last":
        args[3] = np.array([0, 4, 9], np.int32)
    elif case == "cu_k_last":
        args[4] = np.array([0, 7, 13], np.int32)
    elif case == "cu_count_mismatch":
        args[4] = np.array([0, 3, 7, 12], np.int32)
    elif case == "cu_rank":
        args[3] = args[3][None]
    elif case == "max_seqlen_q_small":
        args[5] = 5
    elif case == "max_seqlen_k_small":
        args[6] = 6
    elif case == "q_rank":
        args[0] = args[0][None]
    elif case == "v_total":
        args[2] = args[2][:11]
    elif case == "k_head_dim":
        args[1] = np.zeros((12, 2, 16), np.float32)
    with pytest.raises(ValueError, match=pattern):
        flashattn.flash_attn_varlen_func(*args)


@pytest.mark.parametrize("which", [3, 4], ids=["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_cu_seqlens_dtype(which):
    args = varlen_args()
    name = "cu_seqlens_q" if which == 3 else "cu_seqlens_k"
    args[which] = args[which].astype(np.float32)
    with pytest.raises(TypeError, match=name):
        flashattn.flash_attn_varlen_func(*args)


def test_varlen_input_dtype():
    args = varlen_args()
    args[0] = args[0].astype(np.float64)
    with pytest.raises(TypeError, match=r"\bq\b"):
        flashattn.flash_attn_varlen_func(*args)


def test_varlen_packed_errors():
    with pytest.raises(ValueError, match="qkv"):
        flashattn.flash_attn_varlen_qkvpacked_func(np.zeros((10, 2, 4, 8), np.float32),
                                                   np.array([0, 10], np.int32), 10)
    with pytest.raises(ValueError, match=r"\bkv\b"):
        flashattn.flash_attn_varlen_kvpacked_func(np.zeros((10, 4, 8), np.float32),
                                                  np.zeros((12, 3, 2, 8), np.float32),
                                                  np.array([0, 10], np.int32), np.array([0, 12], np.int32),
                                                  10, 12)


# --------------------------------------------------------------------------- backward


def backward_args():
    q, k, v = qkv()
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    return dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, softmax_lse=lse)


@pytest.mark.parametrize("name, bad, exc, pattern", [
    ("dout", lambda a: a["dout"][:, :4], ValueError, "dout"),
    ("out", lambda a: a["out"][:, :, :2], ValueError, r"\bout\b"),
    ("softmax_lse", lambda a: a["softmax_lse"][:, :, :4], ValueError, "lse"),
    ("softmax_lse", lambda a: a["softmax_lse"][0], ValueError, "lse"),
    ("k", lambda a: np.zeros((2, 8, 2, 16), np.float32), ValueError, r"\bk\b"),
    ("dout", lambda a: a["dout"].astype(np.float16), TypeError, "dout"),
    ("out", lambda a: a["out"].astype(np.float64), TypeError, r"\bout\b"),
    ("softmax_lse", lambda a: a["softmax_lse"].astype(np.float64), TypeError, "lse"),
    ("q", lambda a: a["q"].astype(np.int32), TypeError, r"\bq\b"),
], ids=["dout_shape", "out_shape", "lse_shape", "lse_rank", "k_head_dim", "dout_dtype", "out_dtype",
        "lse_dtype", "q_dtype"])
def test_backward_errors(name, bad, exc, pattern):
    args = backward_args()
    args[name] = bad(args)
    with pytest.raises(exc, match=pattern):
        flashattn.flash_attn_backward(args["dout"], args["q"], args["k"], args["v"], args["out"],
                                      args["softmax_lse"])


def test_backward_value_errors():
    args = backward_args()
    positional = [args[n] for n in ("dout", "q", "k", "v", "out", "softmax_lse")]
    with pytest.raises(ValueError, match="dropout_p"):
        flashattn.flash_attn_backward(*positional, dropout_p=1.5, seed=0)
    with pytest.raises(ValueError, match="window_size"):
        flashattn.flash_attn_backward(*positional, window_size=(-7, -1))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashattn.flash_attn_backward(*positional, alibi_slopes=np.zeros(5, np.float32))


def test_varlen_backward_errors():
    q, k, v, cu_q, cu_k, mq, mk = varlen_args()
    out = np.zeros((10, 4, 8), np.float32)
    lse = np.zeros((4, 10), np.float32)
    dout = np.ones_like(out)
    with pytest.raises(ValueError, match="lse"):
        flashattn.flash_attn_varlen_backward(dout, q, k, v, out, lse[:, :5], cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flashattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, np.array([0, 7, 11], np.int32), mq, mk)
    with pytest.raises(TypeError, match="dout"):
        flashattn.flash_attn_varlen_backward(dout.astype(BF16), q, k, v, out, lse, cu_q, cu_k, mq, mk)


def test_the_native_checks_reach_python():
    """Python passes each argument on with its own dtype: the library's checks report it."""
    args = backward_args()
    with pytest.raises(TypeError, match=r"lse: dtype f16 but expected f32 \(lse is always float32\)"):
        flashattn.flash_attn_backward(args["dout"], args["q"], args["k"], args["v"], args["out"],
                                      args["softmax_lse"].astype(np.float16))
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"alibi_slopes: dtype bf16 but expected f32 \(slopes are float32\)"):
        flashattn.flash_attn_func(q, k, v, alibi_slopes=np.zeros(4, np.float32).astype(BF16))
    q = np.zeros((1, 1, 4, 8), np.float32)
    cache = np.zeros((1, 16, 2, 8), np.float32)
    with pytest.raises(ValueError, match="k, v: the new keys and values come together"):
        flashattn.flash_attn_with_kvcache(q, cache, cache.copy(), k=np.zeros((1, 2, 2, 8), np.float32), cache_seqlens=4)


# --------------------------------------------------------------------------- not implemented


def test_kvcache_errors():
    q = np.zeros((1, 1, 4, 8), np.float32)
    k_cache = np.zeros((1, 16, 2, 8), np.float32)
    v_cache = np.zeros((1, 16, 2, 8), np.float32)
    with pytest.raises(ValueError, match="cache_leftpad"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, cache_leftpad=np.full(1, 5, np.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=np.zeros((1, 2, 2, 8), np.float32),
                                          v=np.zeros((1, 2, 2, 8), np.float32), cache_seqlens=15)
    with pytest.raises(ValueError, match="block_table"):
        flashattn.flash_attn_with_kvcache(q, np.zeros((4, 4, 2, 8), np.float32), np.zeros((4, 4, 2, 8), np.float32),
                                          cache_seqlens=3, block_table=np.array([[9]], np.int32))
    with pytest.raises(ValueError, match="k_cache: last dimension must be contiguous"):
        flashattn.flash_attn_with_kvcache(q, np.zeros((1, 16, 2, 16), np.float32)[..., ::2], v_cache)
    # An empty cache (NumPy gives it zero strides) is named for what it lacks, not its strides.
    with pytest.raises(ValueError, match="heads_kv: must be >= 1, got 0"):
        flashattn.flash_attn_with_kvcache(q, np.zeros((1, 16, 0, 8), np.float32), np.zeros((1, 16, 0, 8), np.float32),
                                          cache_seqlens=4)
    with pytest.raises(ValueError, match=r"q: expected rank 4 \(batch, seqlen, heads, head_dim\), got shape"):
        flashattn.flash_attn_with_kvcache(q[0], k_cache, v_cache, cache_seqlens=4)
    # cache_seqlens as a list is taken as the array it spells.
    np.testing.assert_array_equal(flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=[4]),
                                  flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4))
    # q's head_dim must be the cache's (it was read as the first head_dim values of each key).
    with pytest.raises(ValueError, match="k_cache: head_dim 8 does not match q's 4"):
        flashattn.flash_attn_with_kvcache(q[..., :4], k_cache, v_cache, cache_seqlens=4)


def test_errors_do_not_modify_inputs():
    q, k, v = qkv()
    copies = [x.copy() for x in (q, k, v)]
    with pytest.raises(ValueError):
        flashattn.flash_attn_func(q, k, v[:, :, :1])
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, b)


def test_kernels_by_name():
    """kernel= / backward_kernel= reach the planner: a kernel the inputs allow gives the planner's
    result; one they rule out, or an unknown name, raises ValueError naming it."""
    q, k, v = make_qkv(3, 1, 40, 40, 2, 2, 16)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    named = flashattn.flash_attn_func(q, k, v, causal=True, kernel="tiled", backward_kernel="tiled")
    np.testing.assert_array_equal(named, out)
    with pytest.raises(ValueError, match="kernel tiled_bf16: needs bf16 q, k and v"):
        flashattn.flash_attn_func(q, k, v, kernel="tiled_bf16")
    with pytest.raises(ValueError, match="unknown forward kernel 'fast'"):
        flashattn.flash_attn_kvpacked_func(q, np.stack([k, v], axis=2), kernel="fast")
    dout = np.ones_like(out)
    grads = flashattn.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    named_grads = flashattn.flash_attn_backward(dout, q, k, v, out, lse, causal=True, backward_kernel="tiled")
    for g, h in zip(grads, named_grads):
        np.testing.assert_array_equal(g, h)
    with pytest.raises(ValueError, match="backward_kernel tiled_bf16: needs bf16"):
        flashattn.flash_attn_backward(dout, q, k, v, out, lse, causal=True, backward_kernel="tiled_bf16")
    with pytest.raises(ValueError, match="unknown backward kernel 'fast'"):
        flashattn.flash_attn_backward(dout, q, k, v, out, lse, backward_kernel="fast")


def test_backward_kernel_reaches_autograd():
    """With PyTorch, the forward's backward_kernel is the one its autograd backward plans."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in make_qkv(4, 1, 24, 24, 2, 2, 16))
    out = flashattn.flash_attn_func(q, k, v, backward_kernel="tiled_bf16")  # the forward runs
    with pytest.raises(ValueError, match="backward_kernel tiled_bf16"):
        out.sum().backward()


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(window_size=3), TypeError, r"window_size: expected \(left, right\) integers, got 3"),
    (dict(window_size=None), TypeError, r"window_size: expected \(left, right\) integers, got None"),
    (dict(window_size=("a", 1)), TypeError, r"window_size: expected \(left, right\) integers"),
    (dict(window_size=(2**70, 0)), ValueError, r"window_size: .* out of the int64 range"),
    (dict(window_size=(1.7, 0)), TypeError, r"window_size: expected \(left, right\) integers, got \(1.7, 0\)"),  # was 1
    (dict(window_size=(2, True)), TypeError, r"window_size: expected \(left, right\) integers, got \(2, True\)"),
    (dict(softmax_scale="x"), TypeError, r"softmax_scale: expected a number or None, got 'x'"),
], ids=["window_int", "window_none", "window_str", "window_huge", "window_fraction", "window_bool", "scale_str"])
def test_scalar_arguments_are_named(kwargs, exc, pattern):
    q, k, v = qkv()
    with pytest.raises(exc, match=pattern):
        flashattn.flash_attn_func(q, k, v, **kwargs)


def test_varlen_and_kvcache_scalars_are_named():
    q, k, v = qkv(batch=1)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="max_seqlen_q: expected an integer, got None"):
        flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, None, 8)
    with pytest.raises(TypeError, match="max_seqlen_k: expected an integer, got 'a'"):
        flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, "a")
    k_cache, v_cache = np.zeros((1, 16, 2, 8), np.float32), np.zeros((1, 16, 2, 8), np.float32)
    with pytest.raises(ValueError, match="cache_seqlens: 4294967300 is out of the int32 range"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2**32 + 4)
    with pytest.raises(TypeError, match="cache_seqlens: expected integers, got 2.5"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2.5)
    with pytest.raises(TypeError, match="cache_seqlens: expected integers, got True"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=True)
    with pytest.raises(TypeError, match=r"window_size: expected \(left, right\) integers, got \(1.5, 0\)"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=8, window_size=(1.5, 0))
    # The torch route truncated these with int(): num_splits 2.7, max_seqlen_q 1.5.
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k_cache, v_cache))
    with pytest.raises(ValueError, match=r"num_splits: expected an integer in \[0, 2147483647\], got 2.7"):
        flashattn.flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=8, num_splits=2.7)
    with pytest.raises(TypeError, match=r"window_size: expected \(left, right\) integers, got \(-1, 0.5\)"):
        flashattn.flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=8, window_size=(-1, 0.5))
    # 2**31 splits overflowed the native int (nanobind's error named no argument); a cache or q
    # that is not an array was an AttributeError.
    for x in (tq, q):
        with pytest.raises(ValueError, match=r"num_splits: expected an integer in \[0, 2147483647\], got 2147483648"):
            flashattn.flash_attn_with_kvcache(x, tk if x is tq else k_cache, tv if x is tq else v_cache,
                                              cache_seqlens=8, num_splits=2**31)
    for args, name in (((q, None, v_cache), "k_cache"), ((q, k_cache, [1.0]), "v_cache"), (([1.0], k_cache, v_cache), "q")):
        with pytest.raises(TypeError, match=f"{name}: expected a numpy.ndarray or a torch.Tensor"):
            flashattn.flash_attn_with_kvcache(*args, cache_seqlens=8)
    # A NumPy integer is an integer, as a Python int is.
    k_cache[0, :8], v_cache[0, :8] = k[0], v[0]
    np.testing.assert_array_equal(flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.int32(8)),
                                  flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=8))
    with pytest.raises(ValueError, match=r"x: head_dim must be at least 1"):
        flashattn.hadamard_rotate(np.zeros((1, 2, 2, 0), np.float32))


def test_read_only_arrays_are_inputs_not_outputs():
    """Read-only NumPy arrays (np.broadcast_to views, read-only memmaps) are read like any
    other; where the call writes (a caller's out, a KV cache) they are refused by name, with
    nothing written."""
    q, k, v = qkv()
    want = flashattn.flash_attn_func(q, k, v, causal=True)
    frozen = [x.copy() for x in (q, k, v)]
    for x in frozen:
        x.flags.writeable = False
    np.testing.assert_array_equal(flashattn.flash_attn_func(*frozen, causal=True), want)
    k_shared = np.broadcast_to(k[:1], k.shape)  # read-only, stride 0 over the batch
    np.testing.assert_array_equal(flashattn.flash_attn_func(q, k_shared, v[:1].repeat(2, 0)),
                                  flashattn.flash_attn_func(q, np.ascontiguousarray(k_shared), v[:1].repeat(2, 0)))
    cu = np.array([0, 8], np.int32)
    cu.flags.writeable = False
    np.testing.assert_array_equal(flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8),
                                  flashattn.flash_attn_func(q[:1], k[:1], v[:1])[0])
    partial = np.zeros((2, 1, 8, 4, 8), np.float32)
    lse = np.zeros((2, 1, 8, 4), np.float32)
    out = np.full((1, 8, 4, 8), 7.0, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: a read-only array, but it is written in place"):
        flashattn.flash_attn_combine(partial, lse, out=out)
    assert (out == 7.0).all()
    k_cache = np.zeros((2, 16, 2, 8), np.float32)
    k_cache.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache: a read-only array, but flash_attn_with_kvcache takes a writable"):
        flashattn.flash_attn_with_kvcache(q, k_cache, np.zeros_like(k_cache), k=k, v=v, cache_seqlens=0)
    assert not k_cache.any()
