"""Shared helpers for the flashattn Python tests.

Run from the repository root:  python3 -m pytest python/tests -q

The package is imported as installed (pip install) or, when that fails, from the
source tree: <repo>/python and <repo>/build/python are tried (whichever exist).
The tests fail (they are not skipped) when the package cannot be imported.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

import numpy as np
import pytest

import ml_dtypes

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

if HERE not in sys.path:  # `import reference` from any test module
    sys.path.insert(0, HERE)


def _make_importable():
    try:
        importlib.import_module("flashattn")
        return
    except ImportError:
        pass
    for sub in ("build/python", "python"):
        path = os.path.join(REPO, sub)
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
    sys.modules.pop("flashattn", None)
    importlib.invalidate_caches()


_make_importable()

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def dtype_param(dtypes=None):
    """pytest.mark.parametrize over dtypes with readable ids."""
    dtypes = DTYPES if dtypes is None else [np.dtype(d) for d in dtypes]
    ids = [DTYPE_IDS[DTYPES.index(d)] for d in dtypes]
    return pytest.mark.parametrize("dtype", dtypes, ids=ids)


def seed_for(*parts):
    """A stable seed derived from the test parameters (printed in every failure)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def randn(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def make_qkv(seed, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v=None,
             dtype=np.float32):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    rng = np.random.default_rng(seed)
    q = randn(rng, (batch, seqlen_q, heads_q, head_dim), dtype)
    k = randn(rng, (batch, seqlen_k, heads_kv, head_dim), dtype)
    v = randn(rng, (batch, seqlen_k, heads_kv, head_dim_v), dtype)
    return q, k, v


def make_dout(seed, shape, dtype):
    return randn(np.random.default_rng(seed + 1), shape, dtype)


def alibi(seed, batch, heads, per_batch=False, scale=0.3):
    """Upstream's slopes: rand * 0.3, float32, (Hq) or (B, Hq)."""
    rng = np.random.default_rng(seed + 2)
    shape = (batch, heads) if per_batch else (heads,)
    return (rng.random(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


class Snapshot:
    """Copies of the arrays given, to assert later that nothing was written."""

    def __init__(self, **arrays):
        self.arrays = {n: a for n, a in arrays.items() if a is not None}
        self.copies = {n: np.array(a, copy=True) for n, a in self.arrays.items()}

    def check(self, context=""):
        for name, a in self.arrays.items():
            same = np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                  self.copies[name].view(np.uint8))
            assert same, f"input {name} was modified {context}"


def torch_inputs(seed, b, hq, hkv, sq, sk, d, dtype):
    """A torch generator seeded with `seed`, and q (b, hq, sq, d), k, v (b, hkv, sk, d), dout
    (b, hq, sq, d) drawn from it, standard normal, in `dtype` ((B, H, S, D): SDPA's layout)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=gen).to(dtype)
    dout = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    return gen, q, k, v, dout


def run_grads(fn, q, k, v, dout, grad_of=(), **kw):
    """Torch tensors: fn(q, k, v, **kw) and the gradients of q, k, v and of the keyword
    arguments named in grad_of, for dout."""
    import torch

    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    kw.update({name: kw[name].detach().requires_grad_(True) for name in grad_of})
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v, *(kw[name] for name in grad_of)), dout))


def within_torch(name, got, ref, naive, grad, context):
    """The tolerance rule on torch tensors against a float64 reference: float32 error <= 1e-5
    (outputs) / 1e-4 (gradients); lower precisions <= 2x / 3x the naive same-precision
    implementation's error, plus those."""
    err = (got.double() - ref).abs().max().item()
    if got.dtype.itemsize == 4:
        tol = 1e-4 if grad else 1e-5
    else:
        tol = (3 if grad else 2) * (naive.double() - ref).abs().max().item() + (1e-4 if grad else 1e-5)
    assert err <= tol, f"{name}: max error {err:.3e} > {tol:.3e} ({context})"
