#!/usr/bin/env bash
# The kernels' software prefetches are in the machine code. GCC drops a call to a function
# whose only effect is a prefetch (its IPA sees no side effect) unless it was inlined first:
# that halved decode_fp16 once, and left the tiled forward's attn_mask prefetch out, without
# any test noticing (docs/performance.md, twenty-first and twenty-second sessions). Checked:
# the narrow decode kernels' prefetcht1 per code format (int8_dot's scores included), and in
# the tiled forward, on every SIMD target, the five row prefetches (K, V, Q, output,
# attn_mask) of each kernel.
# Arguments: the flashattn_cpu objects.
set -euo pipefail
case "$(uname -m)" in x86_64 | i?86) ;; *) echo "not x86: the prefetch is __builtin_prefetch there"; exit 0 ;; esac
command -v objdump > /dev/null || { echo "objdump missing (binutils)" >&2; exit 1; }
checked=0
for object in "$@"; do
  case "$object" in
    *fp16_decode.cpp.o | *bf16_decode.cpp.o | *int8_dot.cpp.o)
      code=$(objdump -d --no-show-raw-insn "$object")
      if [[ "$object" == *fp16_decode.cpp.o ]] && ! grep -q "vfmadd231ph" <<< "$code"; then
        echo "$(basename "$object"): built without AVX512-FP16 (its stubs), nothing to check"
        checked=$((checked + 1))
        continue
      fi
      count=$(grep -c "prefetcht1" <<< "$code" || true)
      echo "$(basename "$object"): $count prefetcht1"
      # Score loops: fp16_decode's e4m3, u8 and s8; bf16_decode's e4m3; int8_dot's u8 and s8.
      formats=3
      case "$object" in *bf16_decode.cpp.o) formats=1 ;; *int8_dot.cpp.o) formats=2 ;; esac
      if [ "$count" -lt "$formats" ]; then
        echo "$(basename "$object"): expected a prefetcht1 per code format's score loop" >&2
        exit 1
      fi
      checked=$((checked + 1)) ;;
    *tiled_forward.cpp.o)
      # Prefetch instructions per SIMD target (N_<target> namespaces); AVX3 has both kernels.
      counts=$(objdump -dC --no-show-raw-insn "$object" |
        awk '/^[0-9a-f]+ </ { t = $0; sub(/.*flashattn::cpu::N_/, "", t); sub(/::.*/, "", t) }
             /prefetch/ { n[t]++ } END { for (t in n) print t, n[t] }')
      echo "$(basename "$object"):" $counts
      while read -r target count; do
        want=5
        case "$target" in AVX3*) want=10 ;; esac
        if [ "$count" -lt "$want" ]; then
          echo "$(basename "$object"): $target has $count prefetches, expected $want (K, V, Q, output, attn_mask rows)" >&2
          exit 1
        fi
      done <<< "$counts"
      checked=$((checked + 1)) ;;
  esac
done
[ "$checked" -eq 4 ] || { echo "found $checked of the four checked objects in: $*" >&2; exit 1; }
