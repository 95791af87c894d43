#!/usr/bin/env bash
# The narrow decode kernels' L2 prefetches are in the machine code: GCC 12 emitted none for
# __builtin_prefetch (nor, reached through an inline function, for _mm_prefetch) in these
# baseline-ISA files, which halved decode_fp16 once without any test noticing
# (docs/performance.md, twenty-first session). Arguments: the flashattn_cpu objects.
set -euo pipefail
case "$(uname -m)" in x86_64 | i?86) ;; *) echo "not x86: the prefetch is __builtin_prefetch there"; exit 0 ;; esac
command -v objdump > /dev/null || { echo "objdump missing (binutils)" >&2; exit 1; }
checked=0
for object in "$@"; do
  case "$object" in
    *fp16_decode.cpp.o | *bf16_decode.cpp.o)
      code=$(objdump -d --no-show-raw-insn "$object")
      if [[ "$object" == *fp16_decode.cpp.o ]] && ! grep -q "vfmadd231ph" <<< "$code"; then
        echo "$(basename "$object"): built without AVX512-FP16 (its stubs), nothing to check"
        checked=$((checked + 1))
        continue
      fi
      count=$(grep -c "prefetcht1" <<< "$code" || true)
      echo "$(basename "$object"): $count prefetcht1"
      if [ "$count" -lt 3 ]; then
        echo "$(basename "$object"): expected a prefetcht1 per code format's score loop" >&2
        exit 1
      fi
      checked=$((checked + 1)) ;;
  esac
done
[ "$checked" -eq 2 ] || { echo "found $checked of the two narrow decode objects in: $*" >&2; exit 1; }
