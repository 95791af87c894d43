#!/usr/bin/env python3
"""The device check of the CUDA backend (scripts/gpu-check runs it on a machine with a GPU).

1. correctness: forward and backward on odd shapes against a float64 reference computed by
   torch from the same 16-bit inputs; upstream's rule: error <= 2x (outputs) / 3x
   (gradients) that of a naive implementation in the same precision (torch's math path in
   the 16-bit dtype), plus a small absolute slack; outputs are poisoned (NaN) before each
   call; deterministic backward bit-identical on two runs.
2. speed: forward and backward against torch SDPA's flash and cuDNN backends on
   FlashAttention's benchmark shapes (B*S = 16k tokens, Hq*D = 2048, S in 1k..16k, D in
   {64, 128}, causal and not), CUDA events, warm-up, median.
Writes correctness.csv and timing.csv under $OUT, prints the TFLOP/s table and
'N passed, N failed' last. With --quick: the small correctness cases and the edges only
(short enough for compute-sanitizer).
"""
import ctypes
import csv
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LIB = ctypes.CDLL(sys.argv[1])
QUICK = "--quick" in sys.argv[2:]
STRESS = int(sys.argv[sys.argv.index("--stress") + 1]) if "--stress" in sys.argv[2:] else 0
OUT = os.environ.get("OUT", ".")
P = ctypes.c_void_p
I64 = ctypes.c_int64
LIB.flashattn_cuda_forward.argtypes = [P, P, P, P, P, ctypes.c_int] + [I64] * 6 + [ctypes.c_int]
LIB.flashattn_cuda_forward.restype = ctypes.c_char_p
LIB.flashattn_cuda_backward.argtypes = [P] * 9 + [ctypes.c_int] + [I64] * 6 + [ctypes.c_int, ctypes.c_int]
LIB.flashattn_cuda_backward.restype = ctypes.c_char_p

passed = failed = 0
failed_kinds = set()


def check(ok, what, kind):
    """kind: "forward" or "backward", so that timing runs for the passes that are right."""
    global passed, failed
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    passed, failed = passed + bool(ok), failed + (not ok)
    if not ok:
        failed_kinds.add(kind)


def ours_forward(q, k, v, causal):
    b, sq, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), device=q.device, dtype=torch.float32)
    err = LIB.flashattn_cuda_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                     int(q.dtype == torch.bfloat16), b, sq, k.shape[1], hq, k.shape[2], d, int(causal))
    if err:
        raise RuntimeError(err.decode())
    return out, lse


def ours_backward(dout, q, k, v, out, lse, causal, deterministic=False):
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    err = LIB.flashattn_cuda_backward(dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                      lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                      int(q.dtype == torch.bfloat16), q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                      k.shape[2], q.shape[3], int(causal), int(deterministic))
    if err:
        raise RuntimeError(err.decode())
    return dq, dk, dv


def math_attention(q, k, v, causal):
    """(B, S, H, D) in, (B, S, H, D) out, in q's dtype, bottom-right causal, GQA by repetition."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    s = (qt @ kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s.float(), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vt).transpose(1, 2), lse


def check_case(dtype, b, sq, sk, hq, hkv, d, causal, deterministic=False, rows=None):
    """Forward (and backward, D <= 128) of one case against the float64 reference, by
    upstream's rule; with deterministic, the deterministic backward run twice, bit-identical."""
    name = f"{str(dtype)[6:]} B={b} Sq={sq} Sk={sk} Hq={hq} Hkv={hkv} D={d} causal={causal}"
    torch.manual_seed(sq * 7 + sk)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want, want_lse = math_attention(q64, k64, v64, causal)
    g64 = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    naive, _ = math_attention(ql, kl, vl, causal)
    gl = torch.autograd.grad(naive, (ql, kl, vl), dout)
    try:
        out, lse = ours_forward(q, k, v, causal)
    except RuntimeError as e:
        return check(False, f"forward {name}: {e}", "forward")
    err = (out.double() - want).abs().max().item()
    tol = 2 * (naive.double() - want).abs().max().item() + 1e-5
    check(err <= tol, f"forward {name}: error {err:.2e} <= {tol:.2e}", "forward")
    finite = torch.isfinite(want_lse)
    lse_ok = torch.equal(finite, torch.isfinite(lse)) and torch.allclose(lse[finite], want_lse[finite].float(), atol=1e-3)
    check(lse_ok, f"forward {name}: lse", "forward")
    if rows is not None:
        rows.append(["forward", name, err, tol])
    if d > 128:
        return
    try:
        grads = ours_backward(dout, q, k, v, out, lse, causal)
    except RuntimeError as e:
        return check(False, f"backward {name}: {e}", "backward")
    for label, got, w, nv in zip(("dq", "dk", "dv"), grads, g64, gl):
        err = (got.double() - w).abs().max().item()
        tol = 3 * (nv.double() - w).abs().max().item() + 1e-4
        check(err <= tol, f"backward {name}: {label} error {err:.2e} <= {tol:.2e}", "backward")
        if rows is not None:
            rows.append([f"backward {label}", name, err, tol])
    if deterministic:
        a = ours_backward(dout, q, k, v, out, lse, causal, deterministic=True)
        b2 = ours_backward(dout, q, k, v, out, lse, causal, deterministic=True)
        check(all(torch.equal(x, y) for x, y in zip(a, b2)), f"deterministic backward {name}: bit-identical",
              "backward")


def correctness():
    rows = []
    cases = [(1, 1, 1, 1, 1, 64), (2, 113, 203, 4, 2, 64), (1, 257, 129, 6, 1, 128), (1, 200, 50, 2, 2, 96),
             (2, 128, 128, 4, 4, 128), (1, 300, 700, 2, 1, 256), (1, 1000, 1000, 8, 2, 128)]
    if QUICK:
        cases = [(1, 1, 1, 1, 1, 64), (1, 70, 90, 2, 1, 64), (1, 65, 33, 2, 2, 128)]
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16):
        for b, sq, sk, hq, hkv, d in cases:
            for causal in (False, True):
                check_case(dtype, b, sq, sk, hq, hkv, d, causal,
                           deterministic=causal and (sq == 1000 or (QUICK and sq == 70)), rows=rows)
    with open(os.path.join(OUT, "correctness.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["pass", "case", "max_abs_error", "tolerance"]] + rows)


def stress(count):
    """count random small cases (seeded): batch 1-3, lengths 1-600 each, GQA groups of 1-4,
    head_dim a multiple of 8 up to 128, causal or not, both dtypes, every fifth also
    deterministic; each one allocates its own tensors, so the kernels meet shifted addresses."""
    gen = torch.Generator().manual_seed(2026)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for i in range(count):
        hkv = pick(1, 3)
        d = 8 * pick(1, 16)
        check_case((torch.bfloat16, torch.float16)[i % 2], pick(1, 3), pick(1, 600), pick(1, 600), hkv * pick(1, 4),
                   hkv, d, bool(pick(0, 1)), deterministic=i % 5 == 0)


def edges():
    """No keys: out 0, lse -inf, and the backward writes dq = 0; no queries: the backward
    writes dk = dv = 0 and launches no zero-size grid (the CPU warp emulation checks the same
    passes, tests/test_cuda_emulation.cpp)."""
    for dtype in (torch.bfloat16, torch.float16):
        for sq, sk in ((37, 0), (0, 53)):
            name = f"{str(dtype)[6:]} Sq={sq} Sk={sk}"
            q = torch.randn(2, sq, 4, 64, device="cuda", dtype=dtype)
            k = torch.randn(2, sk, 2, 64, device="cuda", dtype=dtype)
            v = torch.randn(2, sk, 2, 64, device="cuda", dtype=dtype)
            dout = torch.randn(2, sq, 4, 64, device="cuda", dtype=dtype)
            try:
                out, lse = ours_forward(q, k, v, False)
                dq, dk, dv = ours_backward(dout, q, k, v, out, lse, False)
            except RuntimeError as e:
                check(False, f"edge {name}: {e}", "forward")
                continue
            check(torch.all(out == 0).item() and torch.all(lse == float("-inf")).item(), f"edge {name}: out 0, lse -inf",
                  "forward")
            check(all(torch.all(g == 0).item() for g in (dq, dk, dv)), f"edge {name}: gradients written, zero", "backward")


def median_ms(fn, warmup=3, repeats=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timing():
    rows = []
    # FlashAttention's benchmark shapes, then small calls (one sequence of 128 or 512 tokens),
    # where what a call costs besides its kernels shows.
    shapes = [(d, s, 16384 // s, 2048 // d) for d in (64, 128) for s in (1024, 4096, 8192, 16384)]
    shapes += [(64, 128, 1, 16), (64, 512, 1, 16), (128, 512, 1, 16)]
    for d, s, b, h in shapes:
        for causal in (False, True):
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            out, lse = ours_forward(q, k, v, causal)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
            gap = (out.float() - ref.transpose(1, 2).float()).abs().max().item()
            bound = 0.02 * ref.float().abs().max().item() + 1e-3
            check(gap <= bound, f"agreement with torch flash D={d} S={s} B={b} causal={causal}: {gap:.2e} <= {bound:.2e}",
                  "forward")
            nan = float("nan")
            results = {"ours": (median_ms(lambda: ours_forward(q, k, v, causal)),
                                nan if "backward" in failed_kinds else
                                median_ms(lambda: ours_backward(dout, q, k, v, out, lse, causal)))}
            for label, backend in (("torch flash", SDPBackend.FLASH_ATTENTION), ("torch cudnn", SDPBackend.CUDNN_ATTENTION)):
                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                try:
                    with sdpa_kernel([backend]):
                        fwd = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        g = dout.transpose(1, 2)
                        bwd = median_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
                    results[label] = (fwd, bwd)
                except RuntimeError as e:
                    print(f"  {label} unavailable for D={d} S={s}: {str(e).splitlines()[0]}")
            for label, (fwd, bwd) in results.items():
                rows.append([label, d, s, causal, fwd, bwd, flops / fwd / 1e9, 2.5 * flops / bwd / 1e9])
    with open(os.path.join(OUT, "timing.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["kernel", "head_dim", "seqlen", "causal", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops"]] + rows)
    print("\nbf16, forward / backward: TFLOP/s and milliseconds (B*S = 16k, Hq*D = 2048; then B = 1, Hq = 16)")
    print(f"{'kernel':<12} {'D':>4} {'S':>6} {'causal':>6} {'fwd':>7} {'bwd':>7} {'fwd ms':>8} {'bwd ms':>8}")
    for r in rows:
        print(f"{r[0]:<12} {r[1]:>4} {r[2]:>6} {str(r[3]):>6} {r[6]:>7.1f} {r[7]:>7.1f} {r[4]:>8.3f} {r[5]:>8.3f}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    try:
        if STRESS:
            stress(STRESS)
        else:
            correctness()
            edges()
        if QUICK or STRESS:
            pass
        elif "forward" not in failed_kinds:
            timing()
        else:
            print("forward correctness failed: timing skipped")
    except Exception as e:  # a CUDA error is sticky: nothing after it can run
        check(False, f"stopped by {type(e).__name__}: {e}", "forward")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
