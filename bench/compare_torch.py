#!/usr/bin/env python3
"""flashattn beside PyTorch's CPU torch.nn.functional.scaled_dot_product_attention.

Times both on the same shapes, dtypes and thread count (issue 7's base case by default:
B=1, Hq=16, S=4096, D=128, 2 threads, f32/bf16, causal or not, forward and backward) and
prints, per case, each one's GFLOP/s (4·B·H·S²·D, halved when causal, 2.5× for backward —
the convention of `flashattn bench`), their ratio (of the medians), the median and range of
each repeat's own ratio (the two ran back to back in it: drift between repeats cancels) and the
largest difference between their outputs or gradients relative to torch's largest value (a
check that both computed the same thing). The same again under torch.compile (`--compile BACKEND`, inductor by default;
flashattn with fullgraph=True, so a graph break is an error): both compiled GFLOP/s, their
ratio, and flashattn's compiled over eager GFLOP/s. `--masks bool,float` adds the SDPA
drop-in: flashattn.scaled_dot_product_attention against torch's SDPA with the same (S, S)
attn_mask (bool: the causal triangle when causal, else 10% of the keys hidden at random;
float: a random bias, −inf where the bool mask hides). PyTorch is optional: without it the
script says so and exits 0.

    python3 bench/compare_torch.py [--threads 2] [--seqlens 4096] [--dims 128] [--compile none] ...
"""

import argparse
import os
import statistics
import sys
import time

# Below five timed runs a median says little (issue 7: median of at least 5).
MIN_REPEATS = 5
# Largest accepted max|flashattn - torch| / max|torch| over an output or gradient: float32
# rounding of sums over S terms, and 8 bf16 ulps (2^-8 relative each) of the largest value —
# both round their results to bf16 after accumulating in different orders.
TOLERANCE = {"f32": 1e-4, "bf16": 8 * 2.0**-8}


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="threads of both libraries")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlens", type=csv(int), default=[4096])
    p.add_argument("--dims", type=csv(int), default=[128])
    p.add_argument("--dtypes", type=csv(str), default=["f32", "bf16"])
    p.add_argument("--causal", type=csv(str), default=["no", "yes"])
    p.add_argument("--ops", type=csv(str), default=["fwd", "bwd"])
    p.add_argument("--masks", type=csv(str), default=["none"],
                   help="none (flash_attn_func), bool, float (the SDPA drop-in with that attn_mask)")
    p.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"timed runs, median (>= {MIN_REPEATS})")
    p.add_argument("--compile", choices=["inductor", "aot_eager", "none"], default="inductor",
                   help="torch.compile backend of the compiled columns (none: eager only)")
    a = p.parse_args(argv)
    if a.repeats < MIN_REPEATS:
        p.error(f"--repeats: {a.repeats} is below {MIN_REPEATS}")
    for name, values, allowed in [("--dtypes", a.dtypes, {"f32", "bf16"}), ("--causal", a.causal, {"no", "yes"}),
                                  ("--ops", a.ops, {"fwd", "bwd"}), ("--masks", a.masks, {"none", "bool", "float"})]:
        if not set(values) <= allowed:
            p.error(f"{name}: {values} not all in {sorted(allowed)}")
    return a


def timed_turns(fns, repeats):
    """Each named function's times, the functions taking turns within every repeat: on a
    machine whose speed drifts (a VM, a neighbour's job), timing one library's repeats and then
    the other's can put minutes of drift between them (docs/performance.md, twenty-first
    session); times[name][i] and times[other][i] ran back to back."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratios(theirs, ours):
    """Median, smallest and largest of theirs[i] / ours[i]: times that ran back to back, so a
    drift of the machine's speed between the pairs cancels in each ratio."""
    ratios = [t / o for t, o in zip(theirs, ours)]
    return statistics.median(ratios), min(ratios), max(ratios)


def paired_column(paired):
    """paired_ratios as a 20-character column: median (range)."""
    median, low, high = paired
    return f"{f'{median:.2f}x ({low:.2f}–{high:.2f})':>20}"


def relative_diff(ours, theirs):
    """max|ours - theirs| / max|theirs|, in float32."""
    theirs = theirs.float()
    return ((ours.float() - theirs).abs().max() / theirs.abs().max()).item()


def attn_mask(torch, gen, kind, causal, s, dtype):
    """The (S, S) attn_mask of --masks (None for "none")."""
    if kind == "none":
        return None
    keep = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.rand(s, s, generator=gen) > 0.1
    if kind == "bool":
        return keep
    return torch.randn(s, s, generator=gen).masked_fill(~keep, float("-inf")).to(dtype)


def compare(torch, flashattn, a, op, dtype, causal, s, d, mask_kind="none"):
    """GFLOP/s of each variant — "flashattn" and "torch" eager, with "... compiled" under
    --compile — and the largest relative difference of any variant's result from eager torch's.
    With a mask, "flashattn" is the SDPA drop-in in SDPA's layout, both given the same mask."""
    tdtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(7)
    shape = (a.batch, s, a.heads, d)  # flashattn's layout; SDPA's is (batch, heads, seqlen, dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(tdtype) for _ in range(4))
    tq, tk, tv, tdout = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = 4.0 * a.batch * a.heads * s * s * d * (0.5 if causal else 1.0)
    mask = attn_mask(torch, gen, mask_kind, causal, s, tdtype)
    drop_in = mask is not None

    def ours(q, k, v):
        if drop_in:
            return flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return flashattn.flash_attn_func(q, k, v, causal=causal)

    def theirs(q, k, v):
        return sdpa(q, k, v, attn_mask=mask) if drop_in else sdpa(q, k, v, is_causal=causal)

    # (function, its inputs, its dout, whether its layout is SDPA's)
    ours_inputs, ours_dout = ((tq, tk, tv), tdout) if drop_in else ((q, k, v), dout)
    variants = {"flashattn": (ours, ours_inputs, ours_dout, drop_in), "torch": (theirs, (tq, tk, tv), tdout, True)}
    if a.compile != "none":
        torch._dynamo.reset()  # a fresh cache per case: no recompilation limit across cases
        variants["flashattn compiled"] = (torch.compile(ours, backend=a.compile, fullgraph=True), ours_inputs,
                                          ours_dout, drop_in)
        variants["torch compiled"] = (torch.compile(theirs, backend=a.compile), (tq, tk, tv), tdout, True)

    results, steps = {}, {}
    if op == "fwd":
        with torch.no_grad():
            for name, (fn, inputs, _, _) in variants.items():
                results[name] = [fn(*inputs)]
                steps[name] = lambda fn=fn, inputs=inputs: fn(*inputs)
            times = timed_turns(steps, a.repeats)
    else:
        # Backward: through autograd, timing only the gradient of an already computed output.
        flops *= 2.5
        for name, (fn, inputs, grad_out, _) in variants.items():
            leaves = [x.detach().requires_grad_(True) for x in inputs]
            out = fn(*leaves)

            def step(name=name, out=out, leaves=leaves, grad_out=grad_out):
                results[name] = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

            steps[name] = step
        times = timed_turns(steps, a.repeats)
    reference = results["torch"]
    diff = 0.0
    for name, (_, _, _, sdpa_layout) in variants.items():
        for got, ref in zip(results[name], reference):
            diff = max(diff, relative_diff(got if sdpa_layout else got.transpose(1, 2), ref))
    gflops = {name: flops / statistics.median(t) * 1e-9 for name, t in times.items()}
    return gflops, paired_ratios(times["torch"], times["flashattn"]), diff


def main(argv):
    a = parse_args(argv)
    # Both libraries size their OpenMP teams from this; torch is told again explicitly.
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    try:
        import torch
    except ImportError:
        print("compare_torch: PyTorch is not importable here, nothing to compare (it is optional)")
        return 0
    try:
        import flashattn
    except ImportError:
        print("compare_torch: the flashattn Python package is not importable (pip install . first)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    compiled = a.compile != "none"
    print(f"torch {torch.__version__}, flashattn simd {flashattn.simd_target()}, {a.threads} threads, "
          f"B={a.batch}, H={a.heads}, median of {a.repeats} (the variants taking turns), GFLOP/s"
          + (f"; compiled: torch.compile(backend={a.compile!r})" if compiled else ""))
    print(f"{'op':4} {'dtype':5} {'mask':6} {'attn_mask':9} {'D':>4} {'S':>6} {'flashattn':>10} {'torch':>10} {'ratio':>7}"
          f" {'paired (range)':>20}"
          + (f" {'fa comp.':>10} {'torch comp.':>11} {'ratio':>7} {'fa comp./eager':>14}" if compiled else "")
          + f" {'rel. diff':>10}")
    failed = False
    for dtype in a.dtypes:
        for d in a.dims:
            for s in a.seqlens:
                for causal in a.causal:
                    for op, mask in ((op, mask) for mask in a.masks for op in a.ops):
                        g, paired, diff = compare(torch, flashattn, a, op, dtype, causal == "yes", s, d, mask)
                        line = (f"{op:4} {dtype:5} {'causal' if causal == 'yes' else 'full':6} {mask:9} {d:4} {s:6} "
                                f"{g['flashattn']:10.1f} {g['torch']:10.1f} {g['flashattn'] / g['torch']:6.2f}x "
                                f"{paired_column(paired)}")
                        if compiled:
                            fc, tc = g["flashattn compiled"], g["torch compiled"]
                            line += f" {fc:10.1f} {tc:11.1f} {fc / tc:6.2f}x {fc / g['flashattn']:13.2f}x"
                        print(f"{line} {diff:10.2e}", flush=True)
                        failed |= not diff <= TOLERANCE[dtype]
    if failed:
        print("compare_torch: flashattn and torch disagree beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
