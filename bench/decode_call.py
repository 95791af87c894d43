#!/usr/bin/env python3
"""One decode step's attention call, layer by layer: where its fixed cost goes.

Times, per call, the transformers integration's attention function (``attention_forward``
with the mask plan of a decode step), its direct route alone (``_direct_forward``, which
``flash_attn_func`` takes too for such calls), the
native call alone (``_C.forward`` on DLPack capsules, options built once), the public
functions a caller without the integration uses (``flash_attn_func`` on (B, S, H, D) views,
``flash_attn_with_kvcache`` over a cache of --keys filled tokens and as many empty ones) and
torch's ``scaled_dot_product_attention`` on the same tensors (GQA), for one query
token of 8 q heads over 2 kv heads (D 64, the model of bench/transformers_e2e.py) and
caches of --keys tokens. Each figure is the best of 5 rounds of the mean per call over a
round of --seconds / 5; the difference between columns is what each layer adds, and the
native column at 16 keys is about the native call's fixed cost. --cpu-time reads the
calling thread's CPU time instead of the wall clock (1 thread only: other threads' work is
not counted), which a machine shared with other jobs disturbs less.

    python3 bench/decode_call.py [--keys 16,1024,4096] [--dtypes f32,bf16] [--threads 1,2]
"""

import argparse
import sys
import time


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def per_call(fn, seconds, clock):
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        calls, t0 = 0, clock()
        while True:
            for _ in range(50):
                fn()
            calls += 50
            elapsed = clock() - t0
            if elapsed > seconds / 5:
                break
        best = min(best, elapsed / calls)
    return best * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=csv(int), default=[16, 1024, 4096], help="cached tokens")
    p.add_argument("--dtypes", type=csv(str), default=["f32", "bf16"])
    p.add_argument("--threads", type=csv(int), default=[1, 2])
    p.add_argument("--seconds", type=float, default=1.0, help="timing per case and layer")
    p.add_argument("--cpu-time", action="store_true", help="the calling thread's CPU time (1 thread only)")
    a = p.parse_args(argv)
    if not set(a.dtypes) <= {"f32", "bf16"}:
        p.error(f"--dtypes: {a.dtypes} not all in ['bf16', 'f32']")
    if a.cpu_time and a.threads != [1]:
        p.error(f"--cpu-time counts the calling thread only: needs --threads 1, got {a.threads}")

    try:
        import torch
        import torch.nn.functional as F
        from torch.utils.dlpack import to_dlpack
    except ImportError:
        print("decode_call: PyTorch is not importable here, nothing to measure (it is optional)")
        return True

    import flashattn
    from flashattn import _C
    from flashattn import _interface as _impl
    from flashattn.integrations import transformers as fa_hf

    clock = time.thread_time if a.cpu_time else time.perf_counter
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    module = torch.nn.Module()
    module.is_causal = True
    torch.manual_seed(0)
    rows = []
    threads_before = torch.get_num_threads()
    try:
        print(f"{'dtype':5} {'threads':>7} {'keys':>6} {'attention_forward µs':>21} {'_direct_forward µs':>20} "
              f"{'_C.forward µs':>14} {'flash_attn_func µs':>19} {'with_kvcache µs':>16} {'torch SDPA µs':>14}")
        for dname in a.dtypes:
            for threads in a.threads:
                torch.set_num_threads(threads)
                for n in a.keys:
                    q = torch.randn(1, 8, 1, 64, dtype=dtypes[dname])  # (B, H, S, D) as the model passes them
                    k, v = (torch.randn(1, 2, n, 64, dtype=dtypes[dname]) for _ in range(2))
                    plan = fa_hf._Plan(1, 1, n, True, (-1, 0))
                    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    layer = lambda: fa_hf.attention_forward(module, q, k, v, plan, scaling=0.125)
                    direct = lambda: _impl._direct_forward(qt, kt, vt, 0.125, True, (-1, 0), 0.0)
                    direct()
                    options, names = _impl._DIRECT_OPTIONS[(0.125, True, (-1, 0), 0.0, "auto", threads, q.dtype,
                                                            q.dtype, q.dtype)]
                    out, lse = torch.empty(1, 1, 8, 64, dtype=q.dtype), torch.empty(1, 8, 1)
                    native = lambda: _C.forward(to_dlpack(qt), to_dlpack(kt), to_dlpack(vt), to_dlpack(out),
                                                to_dlpack(lse), names, options)
                    public = lambda: flashattn.flash_attn_func(qt, kt, vt, softmax_scale=0.125, causal=True)
                    cache_k, cache_v = (torch.cat([t, torch.zeros_like(t)], 1) for t in (kt, vt))
                    filled = torch.tensor([n], dtype=torch.int32)
                    kvcache = lambda: flashattn.flash_attn_with_kvcache(qt, cache_k, cache_v, cache_seqlens=filled,
                                                                        softmax_scale=0.125, causal=True)
                    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
                    fns = (layer, direct, native, public, kvcache, sdpa)
                    times = [per_call(fn, a.seconds, clock) for fn in fns]
                    rows.append((dname, threads, n, *times))
                    print(f"{dname:5} {threads:7} {n:6} {times[0]:21.1f} {times[1]:20.1f} {times[2]:14.1f} "
                          f"{times[3]:19.1f} {times[4]:16.1f} {times[5]:14.1f}", flush=True)
    finally:  # the caller's (a test process's) thread count back
        torch.set_num_threads(threads_before)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
