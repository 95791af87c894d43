#!/usr/bin/env python3
"""flashattn beside OpenVINO's CPU ScaledDotProductAttention, forward, in one process.

Times both on the same inputs, shapes and thread count (issue 25's quick shapes by default:
B=1, Hq=16, S=4096, D=64/128/256, 2 threads, f32/bf16, causal or not), the two taking turns
round by round so that drift in the machine's speed lands on both, and prints per case each
one's GFLOP/s (the visible pairs' FLOPs, as `flashattn bench` counts them: 4·D per pair per
(batch, head)), their ratio (of the medians), the median and range of the rounds' own
ratios (each round's two bursts ran back to back: drift between rounds cancels in them) and
the largest difference between the outputs relative to OpenVINO's largest value. OpenVINO runs a one-op model (opset13 scaled_dot_product_attention,
(B, H, S, D) layout, compiled for CPU with INFERENCE_NUM_THREADS and the latency hint); bf16
cases give it the same bf16 values in float32 with the bf16 inference precision hint, and the
precision its CPU plugin chose is printed (float32 on CPUs without bf16 arithmetic). OpenVINO
is optional (`pip install openvino`): without it the script says so and exits 0.

Each library's turn is one untimed call, then --burst timed calls. The two run separate
thread pools (libgomp's, OpenVINO's TBB): after a call, one library's idle workers still spin
on a core for milliseconds, and its workers that went to sleep take milliseconds to wake on a
VM's halted vCPUs, so a call timed right after the other library's measures the other's idle
threads and its own wake-up (on a 2-core VM, S = 128 calls of 3 ms took 8-10 ms that way). The
untimed call takes those costs; the timed ones run the way a model's layers call attention,
back to back.

    python3 bench/compare_openvino.py [--threads 2] [--seqlens 4096] [--dims 64,128,256] ...
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # compare_torch beside it, however run
from compare_torch import MIN_REPEATS, TOLERANCE, csv, paired_column, paired_ratios  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="threads of both libraries")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlens", type=csv(int), default=[4096])
    p.add_argument("--dims", type=csv(int), default=[64, 128, 256])
    p.add_argument("--dtypes", type=csv(str), default=["f32", "bf16"])
    p.add_argument("--causal", type=csv(str), default=["no", "yes"])
    p.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"rounds, median (>= {MIN_REPEATS})")
    p.add_argument("--burst", type=int, default=3, help="timed calls of each library per round, after one untimed")
    a = p.parse_args(argv)
    if a.repeats < MIN_REPEATS:
        p.error(f"--repeats: {a.repeats} is below {MIN_REPEATS}")
    if a.burst < 1:
        p.error(f"--burst: {a.burst} is below 1")
    for name, values, allowed in [("--dtypes", a.dtypes, {"f32", "bf16"}), ("--causal", a.causal, {"no", "yes"})]:
        if not set(values) <= allowed:
            p.error(f"{name}: {values} not all in {sorted(allowed)}")
    return a


def visible_pairs(s, causal):
    """(query, key) pairs of one (batch, head) a square S × S problem computes."""
    return s * (s + 1) // 2 if causal else s * s


def openvino_sdpa(ov, a, dtype, causal, shape):
    """A compiled one-op model of OpenVINO's SDPA on float32 inputs of `shape` (B, H, S, D),
    and the inference precision its CPU plugin chose."""
    import openvino.opset13 as ops

    params = [ops.parameter(shape, ov.Type.f32, name=n) for n in ("q", "k", "v")]
    node = ops.scaled_dot_product_attention(*params, causal=causal)
    model = ov.Model([node], params, "sdpa")
    config = {"INFERENCE_NUM_THREADS": a.threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1,
              "INFERENCE_PRECISION_HINT": "bf16" if dtype == "bf16" else "f32"}
    compiled = ov.Core().compile_model(model, "CPU", config)
    return compiled, compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def compare(ov, np, ml_dtypes, flashattn, a, dtype, causal, s, d):
    """GFLOP/s of flashattn and OpenVINO (medians of alternating runs), the rounds' own ratios
    (OpenVINO's median time over flashattn's in each round: the two ran back to back, so a drift
    of the machine's speed between rounds cancels), OpenVINO's precision, and
    max|flashattn - openvino| / max|openvino|."""
    rng = np.random.default_rng(7)
    shape = (a.batch, s, a.heads, d)  # flashattn's layout; OpenVINO's is (batch, heads, seqlen, dim)
    store = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(store) for _ in range(3))
    ov_inputs = [np.ascontiguousarray(x.astype(np.float32).transpose(0, 2, 1, 3)) for x in (q, k, v)]
    compiled, precision = openvino_sdpa(ov, a, dtype, causal, list(ov_inputs[0].shape))
    request = compiled.create_infer_request()
    for i, x in enumerate(ov_inputs):
        request.set_input_tensor(i, ov.Tensor(x, shared_memory=True))

    def ours():
        return flashattn.flash_attn_func(q, k, v, causal=causal, num_threads=a.threads)

    times = {"flashattn": [], "openvino": []}
    rounds = {"flashattn": [], "openvino": []}  # each round's median
    for r in range(a.repeats + 1):  # the first round warms both up
        burst = {}
        for name, fn in (("flashattn", ours), ("openvino", request.infer)):
            fn()  # the switch from the other library: its idle workers, this one's wake-up
            burst[name] = []
            for _ in range(a.burst):
                t0 = time.perf_counter()
                fn()
                burst[name].append(time.perf_counter() - t0)
        if r > 0:
            for name, t in burst.items():
                times[name] += t
                rounds[name].append(statistics.median(t))
    theirs = request.get_output_tensor(0).data.transpose(0, 2, 1, 3).astype(np.float32)
    diff = float(np.abs(ours().astype(np.float32) - theirs).max() / np.abs(theirs).max())
    flops = 4.0 * d * a.batch * a.heads * visible_pairs(s, causal)
    gflops = {name: flops / sorted(t)[len(t) // 2] * 1e-9 for name, t in times.items()}
    return gflops, paired_ratios(rounds["openvino"], rounds["flashattn"]), precision, diff


def main(argv):
    a = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # flashattn's OpenMP team
    try:
        import openvino as ov
    except ImportError:
        print("compare_openvino: skipped, OpenVINO is not importable here (it is optional: pip install openvino)")
        return 0
    try:
        import ml_dtypes
        import numpy as np

        import flashattn
    except ImportError as e:
        print(f"compare_openvino: {e.name} is not importable (flashattn: pip install . first)", file=sys.stderr)
        return 2
    print(f"openvino {ov.get_version()}, flashattn simd {flashattn.simd_target()}, {a.threads} threads, "
          f"B={a.batch}, H={a.heads}, median of {a.repeats} rounds × {a.burst} calls, taking turns, forward GFLOP/s "
          "of the visible pairs")
    print(f"{'dtype':5} {'mask':6} {'D':>4} {'S':>6} {'flashattn':>10} {'openvino':>10} {'ratio':>7} "
          f"{'paired (range)':>20} {'ov precision':>12} {'rel. diff':>10}")
    failed = False
    for dtype in a.dtypes:
        for d in a.dims:
            for s in a.seqlens:
                for causal in a.causal:
                    g, paired, precision, diff = compare(ov, np, ml_dtypes, flashattn, a, dtype, causal == "yes", s, d)
                    print(f"{dtype:5} {'causal' if causal == 'yes' else 'full':6} {d:4} {s:6} {g['flashattn']:10.1f} "
                          f"{g['openvino']:10.1f} {g['flashattn'] / g['openvino']:6.2f}x {paired_column(paired)} "
                          f"{precision:>12} {diff:10.2e}", flush=True)
                    failed |= not diff <= TOLERANCE[dtype]
    if failed:
        print("compare_openvino: flashattn and OpenVINO disagree beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
