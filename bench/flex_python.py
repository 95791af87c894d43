"""What flashattn.flex_attention's Python mods cost (docs/python.md, "FlexAttention").

Times, best of 3 in one process, against flash_attn_func with the same variant built in:
create_block_mask of a causal mask, flex_attention with it (mask only; with a relative-position
bias; with ALiBi; with soft-capping), the same with the score_mod's coefficients evaluated beforehand (the hook's
own cost), and the evaluation alone.

    PYTHONPATH=python:build/python python3 bench/flex_python.py [--seqlen 2048] [--heads 8]
"""

import argparse
import sys
import time

try:
    import torch
except ImportError:  # optional: main says so
    torch = None

import flashattn
from flashattn import _flex


def best(f, repeats=3):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    if torch is None:
        print("flex_python: PyTorch is not importable here, nothing to measure (it is optional)")
        return 0
    s, h, d = args.seqlen, args.heads, args.head_dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    slopes = torch.rand(h) * 0.3

    def causal(b, hd, i, j):
        return i >= j

    def rel_bias(score, b, hd, i, j):
        return score + (i - j).float() * 0.01

    def alibi(score, b, hd, i, j):
        return score - slopes[hd] * (i - j).abs()

    def softcap(score, b, hd, i, j):
        return 30.0 * torch.tanh(score / 30.0)

    bm = flashattn.create_block_mask(causal, None, None, s, s)
    base = best(lambda: flashattn.flash_attn_func(qt, kt, vt, causal=True))
    rows = [("flash_attn_func(causal=True)", base),
            ("flash_attn_func(causal=True, alibi_slopes)",
             best(lambda: flashattn.flash_attn_func(qt, kt, vt, causal=True, alibi_slopes=slopes))),
            ("flash_attn_func(causal=True, softcap=30)",
             best(lambda: flashattn.flash_attn_func(qt, kt, vt, causal=True, softcap=30.0))),
            ("create_block_mask(causal)", best(lambda: flashattn.create_block_mask(causal, None, None, s, s))),
            ("flex_attention(block_mask)", best(lambda: flashattn.flex_attention(q, k, v, block_mask=bm)))]
    for name, mod in (("rel_bias", rel_bias), ("alibi", alibi), ("softcap", softcap)):
        a, c, cap = _flex._score_coefficients(mod, (1, h, s, s))
        mods = (bm._states, bm._partial_index, bm._partial_blocks, bm.BLOCK_SIZE[0], a, c, cap)
        rows += [(f"flex_attention(block_mask, {name})",
                  best(lambda: flashattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm))),
                 (f"  its op, coefficients evaluated", best(lambda: _flex._flex_fwd(qt, kt, vt, None, *mods, 0))),
                 (f"  the evaluation of {name}", best(lambda: _flex._score_coefficients(mod, (1, h, s, s))))]
    print(f"B=1 H={h} S={s} D={d} float32, {torch.get_num_threads()} threads, SIMD target {flashattn.simd_target()}")
    for name, t in rows:
        print(f"{name:48s} {1e3 * t:9.1f} ms {t / base:6.2f}x")


if __name__ == "__main__":
    sys.exit(main())
