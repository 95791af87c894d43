"""Dropout seeds from torch's and NumPy's generators (reproducible runs, checkpointing) and
the thread count (num_threads=, set_num_threads, torch.set_num_threads whichever library
is imported first). Skipped without torch."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from conftest import seed_for  # noqa: E402

from torch.utils.checkpoint import checkpoint  # noqa: E402


def make(seed, requires_grad=False, shape=(2, 23, 4, 16), kv_heads=2):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, d = shape
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s + 6, kv_heads, d, generator=gen)
    v = torch.randn(b, s + 6, kv_heads, d, generator=gen)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


# --------------------------------------------------------------------------- dropout RNG


def test_manual_seed_reproduces_dropout():
    q, k, v = make(seed_for("manual_seed"))
    torch.manual_seed(123)
    a = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    b = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(123)
    a2 = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    b2 = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    assert torch.equal(a, a2) and torch.equal(b, b2), "torch.manual_seed does not reproduce the dropout masks"
    assert not torch.equal(a, b), "consecutive calls drew the same dropout mask"


def test_generator_advanced_only_with_dropout():
    q, k, v = make(seed_for("generator_state"))
    state = torch.get_rng_state()
    flashattn.flash_attn_func(q, k, v)
    assert torch.equal(state, torch.get_rng_state()), "a call without dropout moved torch's generator"
    flashattn.flash_attn_func(q, k, v, dropout_p=0.1)
    assert not torch.equal(state, torch.get_rng_state()), "a call with dropout did not advance torch's generator"
    state = torch.get_rng_state()
    flashattn.flash_attn_func(q, k, v, dropout_p=0.1, seed=5)
    assert torch.equal(state, torch.get_rng_state()), "an explicit seed moved torch's generator"


def test_offset_changes_the_mask():
    """The generator's draw is (seed, offset); both enter the mask."""
    q, k, v = make(seed_for("offset"))
    opts = lambda rng: (0.3, None, False, -1, -1, 0.0, None, True, rng, "auto", "auto", 0)  # noqa: E731
    a, _ = torch.ops.flashattn.fwd(q, k, v, *opts(torch.tensor([11, 0])))
    b, _ = torch.ops.flashattn.fwd(q, k, v, *opts(torch.tensor([11, 1])))
    c, _ = torch.ops.flashattn.fwd(q, k, v, *opts(torch.tensor([11, 0])))
    assert torch.equal(a, c) and not torch.equal(a, b)


class _DropoutAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q, k, v):
        out = flashattn.flash_attn_func(self.proj(q), k, v, dropout_p=0.25, causal=True, deterministic=True)
        return out * 2.0


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_recomputes_the_same_mask(use_reentrant):
    """torch.utils.checkpoint restores torch's CPU generator before recomputing the forward:
    the recomputed mask is the forward's, so the gradients equal those without checkpointing
    (bitwise: deterministic backward)."""
    seed = seed_for("checkpoint", use_reentrant)
    torch.manual_seed(seed)
    layer = _DropoutAttention()
    q, k, v = make(seed + 1, requires_grad=True)
    dout = torch.randn(2, 23, 4, 16, generator=torch.Generator().manual_seed(seed + 2))

    def grads(checkpointed):
        for t in (q, k, v):
            t.grad = None
        layer.zero_grad()
        torch.manual_seed(seed + 3)
        torch.randn(3)  # a draw between manual_seed and the call, as a model would make
        if checkpointed:
            out = checkpoint(layer, q, k, v, use_reentrant=use_reentrant)
        else:
            out = layer(q, k, v)
        out.backward(dout)
        return out.detach(), [t.grad.clone() for t in (q, k, v)] + [p.grad.clone() for p in layer.parameters()]

    out_plain, plain = grads(False)
    out_ckpt, ckpt = grads(True)
    assert torch.equal(out_plain, out_ckpt), f"checkpointed forward differs (seed={seed})"
    for i, (a, b) in enumerate(zip(plain, ckpt)):
        assert torch.equal(a, b), f"gradient {i} differs under checkpoint (seed={seed})"
    # And the mask really matters here: without dropout the gradients differ.
    torch.manual_seed(seed + 3)
    out_nodrop = flashattn.flash_attn_func(layer.proj(q), k, v, causal=True) * 2.0
    assert not torch.equal(out_nodrop.detach(), out_plain)


def test_numpy_seed_reproduces_dropout():
    q, k, v = (t.numpy() for t in make(seed_for("numpy_seed")))
    np.random.seed(77)
    a = flashattn.flash_attn_func(q, k, v, dropout_p=0.3)
    b = flashattn.flash_attn_func(q, k, v, dropout_p=0.3)
    np.random.seed(77)
    a2 = flashattn.flash_attn_func(q, k, v, dropout_p=0.3)
    assert np.array_equal(a, a2) and not np.array_equal(a, b)
    # An explicit seed is the same mask for NumPy arrays and tensors.
    t = flashattn.flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)), dropout_p=0.3, seed=2**63 + 5)
    n = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, seed=2**63 + 5)
    assert np.array_equal(t.numpy(), n)
    # Seeds are taken modulo 2^64.
    assert np.array_equal(flashattn.flash_attn_func(q, k, v, dropout_p=0.3, seed=-1),
                          flashattn.flash_attn_func(q, k, v, dropout_p=0.3, seed=2**64 - 1))


# --------------------------------------------------------------------------- threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    flashattn._interface._num_threads = 0


def test_threads_follow_torch_and_arguments(restore_threads):
    q, k, v = make(seed_for("threads"))
    torch.set_num_threads(1)
    flashattn.flash_attn_func(q, k, v)
    assert flashattn.last_num_threads() == 1
    torch.set_num_threads(2)
    flashattn.flash_attn_func(q, k, v)
    assert flashattn.last_num_threads() == 2
    flashattn.flash_attn_func(q, k, v, num_threads=3)
    assert flashattn.last_num_threads() == 3
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    dq = torch.autograd.grad(flashattn.flash_attn_func(q.requires_grad_(True), k, v, num_threads=1).sum(), q)[0]
    assert flashattn.last_num_threads() == 1, "the backward did not keep the forward's num_threads"
    assert dq.shape == q.shape and out.shape == q.shape
    flashattn.set_num_threads(3)  # over torch's count, under the argument
    assert flashattn.get_num_threads() == 3
    flashattn.flash_attn_func(q, k, v)
    assert flashattn.last_num_threads() == 3
    flashattn.flash_attn_func(q.detach().numpy(), k.numpy(), v.numpy())
    assert flashattn.last_num_threads() == 3
    flashattn.flash_attn_func(q, k, v, num_threads=2)
    assert flashattn.last_num_threads() == 2
    # A team and a workspace per thread: past MAX_THREADS (2**40 overflowed the native int)
    # refused by name, as is a number that is not an integer.
    for bad, error in ((-1, ValueError), (flashattn._C.MAX_THREADS + 1, ValueError), (2**40, ValueError),
                       (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="num_threads"):
            flashattn.flash_attn_func(q, k, v, num_threads=bad)
        with pytest.raises(error, match="num_threads"):
            flashattn.set_num_threads(bad)


def test_kvcache_num_threads(restore_threads):
    q = torch.randn(2, 1, 4, 16)
    cache = torch.randn(2, 32, 2, 16)
    torch.set_num_threads(1)
    flashattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=20)
    assert flashattn.last_num_threads() == 1
    flashattn.flash_attn_with_kvcache(q.numpy(), cache.numpy(), cache.numpy(), cache_seqlens=20, num_threads=2)
    assert flashattn.last_num_threads() == 2


_ORDER_SCRIPT = """
import sys
for name in sys.argv[1].split(","):
    __import__(name)
import torch, flashattn
torch.set_num_threads(1)
q = torch.randn(1, 64, 4, 32)
flashattn.flash_attn_func(q, q, q)
print(flashattn.last_num_threads())
"""


@pytest.mark.parametrize("first", ["torch,flashattn", "flashattn,torch"])
def test_torch_threads_whichever_import_first(first):
    """torch.set_num_threads(1) gives flashattn 1 thread, whichever library the process
    loads first (and so whichever OpenMP runtime it resolves first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT, first], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1", f"import order {first}: {res.stdout!r} {res.stderr[-2000:]}"
