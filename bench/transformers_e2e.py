#!/usr/bin/env python3
"""A Llama-style transformers model end to end: flashattn (attn_implementation "fa_cpu") beside SDPA.

Times prefill (the whole prompt in one forward, last token's logits only, as generate() does)
and decode (one token at a time on a KV cache of --decode-context tokens) with both attention
backends in one process, alternating them run by run, and reports the best and the median
time of the runs after a warm-up (on a shared machine the best is the one least disturbed),
tokens/s and the attention share of the step: the time spent inside the model's attention
function (the registered one, timed around each call) over the step's time. The speed-up over
SDPA is given twice: best run over best run, and the median (and range) of the rounds' own
ratios — each round runs both backends back to back, so a drift of the machine's speed
between rounds (10–25% within minutes on the VMs of docs/performance.md) cancels.

The model is randomly initialised from a Llama config (grouped-query heads, rotary positions);
its size is set by the options (default: 4 layers, hidden 512, 8 heads of dim 64, 2 kv heads,
MLP 1408, vocabulary 32000).

With --batch B --left-pad P the prompts are B rows, every row but the first left-padded by P
tokens (attention_mask 0 there), as batched generate() pads them: the masks take the
integration's variable-length route (prefill) and its in-place cache route (decode).

    python3 bench/transformers_e2e.py [--threads 2] [--seqlens 1024,4096,8192] [--decode-tokens 32]
"""

import argparse
import copy
import os
import statistics
import sys
import time


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2,
                   help="threads of torch and of flashattn (OMP_NUM_THREADS); 0 leaves both as they are")
    p.add_argument("--seqlens", type=csv(int), default=[1024, 4096, 8192], help="prefill lengths")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per timed decode run")
    p.add_argument("--decode-context", type=csv(int), default=[1024, 4096], help="KV cache lengths for decode")
    p.add_argument("--dtypes", type=csv(str), default=["bf16", "f32"])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per backend after a warm-up, median")
    p.add_argument("--batch", type=int, default=1, help="prompts per forward")
    p.add_argument("--left-pad", type=int, default=0,
                   help="tokens of left padding in every prompt but the first (needs --batch 2 or more)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args(argv)
    if not set(a.dtypes) <= {"f32", "bf16"}:
        p.error(f"--dtypes: {a.dtypes} not all in ['bf16', 'f32']")
    if a.repeats < 1 or a.decode_tokens < 1:
        p.error("--repeats and --decode-tokens must be at least 1")
    if a.batch < 1 or a.left_pad < 0 or (a.left_pad and (a.batch < 2 or a.left_pad >= min(a.seqlens + a.decode_context))):
        p.error(f"--batch {a.batch} --left-pad {a.left_pad}: left padding needs a batch of 2 or more and fewer "
                "tokens than every prompt")
    return a


class Timed:
    """An attention function that adds the time of its calls to .seconds."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def measure(args, timers):
    """The rows of main's table: each case timed with each backend (timers: name -> Timed,
    registered under that name), rounds alternating."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seqlens + [c + args.decode_tokens for c in args.decode_context]) + 1)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    backends = list(timers)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    state = base.state_dict()
    rows = []
    for dname in args.dtypes:
        models = {}
        for name in backends:
            # A config of its own: from_config writes the implementation into the config it is given.
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name,
                                                                  dtype=torch.float32)
            model.load_state_dict(state)
            models[name] = model.to(dtypes[dname]).eval()
        gen = torch.Generator().manual_seed(1)

        def padding(length, extra=0):
            mask = torch.ones(args.batch, length + extra, dtype=torch.long)
            mask[1:, :args.left_pad] = 0
            return mask if args.left_pad else None

        def prefill(name, ids):
            return models[name](ids, attention_mask=padding(ids.shape[1]), use_cache=True, logits_to_keep=1)

        def timed(name, fn):
            timers[name].seconds = 0.0
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0, timers[name].seconds

        cases = [("prefill", s) for s in args.seqlens] + [("decode", c) for c in args.decode_context]
        for kind, length in cases:
            ids = torch.randint(0, args.vocab, (args.batch, length), generator=gen)
            step = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
            grown = padding(length, args.decode_tokens)
            runs = {name: [] for name in backends}
            with torch.no_grad():
                # Decode runs start from one prefilled cache per backend, cut back to the context
                # after each run.
                caches = {name: prefill(name, ids).cache for name in backends} if kind == "decode" else {}

                def decode(name):
                    for i in range(args.decode_tokens):
                        mask = None if grown is None else grown[:, :length + i + 1]
                        models[name](step, attention_mask=mask, cache=caches[name], use_cache=True)
                    caches[name].crop(-args.decode_tokens)

                # Run 0 of each backend is a warm-up at the same shapes (oneDNN compiles kernels per
                # shape on first use), not counted.
                for rep in range(args.repeats + 1):
                    for name in (backends if rep % 2 == 0 else backends[::-1]):
                        fn = (lambda: prefill(name, ids)) if kind == "prefill" else (lambda: decode(name))
                        runs[name].append(timed(name, fn))
            for name in backends:
                kept = runs[name][1:]
                best = min(kept)
                tokens = args.batch * (length if kind == "prefill" else args.decode_tokens)
                # SDPA's time over this backend's in the same round: the two ran back to back, so a
                # drift of the machine's speed between rounds cancels (best-of-n does not pair them).
                paired = [s / t for (s, _), (t, _) in zip(runs["sdpa"][1:], kept)]
                rows.append((dname, kind, length, name, best[0], statistics.median(t for t, _ in kept),
                             tokens / best[0], best[1] / best[0], statistics.median(paired), min(paired), max(paired)))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.threads > 0:  # before the OpenMP runtimes start
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    try:
        import torch
        import transformers
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as e:
        print(f"transformers_e2e: {e.name} is not importable here, nothing to measure (it is optional)")
        return True

    from flashattn.integrations import transformers as fa_hf

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    fa_hf.register()
    timers = {fa_hf.ATTN_IMPLEMENTATION: Timed(fa_hf.attention_forward), "sdpa": Timed(sdpa_attention_forward)}
    for name, timer in timers.items():  # SDPA's own function, timed, until the runs end
        transformers.AttentionInterface.register(name, timer)
    try:
        rows = measure(args, timers)
    finally:  # the registrations as they were: a caller (the tests) goes on in this process
        fa_hf.register()
        transformers.AttentionInterface.register("sdpa", sdpa_attention_forward)

    print(f"threads={args.threads or 'default'} layers={args.layers} hidden={args.hidden} heads={args.heads} "
          f"kv_heads={args.kv_heads} head_dim={args.hidden // args.heads} repeats={args.repeats} "
          f"decode_tokens={args.decode_tokens} batch={args.batch} left_pad={args.left_pad}")
    print("| dtype | phase | tokens (prefill) / context (decode) | attention | best run (s) | median (s) "
          "| tokens/s (best) | attention share (best) | speed-up vs SDPA (best) "
          "| speed-up vs SDPA (rounds paired: median, range) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sdpa = {(d, k, n): t for d, k, n, name, t, *_ in rows if name == "sdpa"}
    for d, k, n, name, t, med, tps, share, paired, low, high in rows:
        print(f"| {d} | {k} | {n} | {name} | {t:.3f} | {med:.3f} | {tps:.1f} | {100 * share:.0f}% "
              f"| {sdpa[(d, k, n)] / t:.2f}x | {paired:.2f}x ({low:.2f}–{high:.2f}) |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
