#!/usr/bin/env bash
# End-to-end check of the CLI: --version, run (table and JSON), attend on .npy files, bad input.
set -euo pipefail
cli=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}"  # npyio.py

# --version: the project's version as CMakeLists.txt's project() states it, and success.
version=$(sed -n 's/^project(flashattn VERSION \([0-9.]*\).*/\1/p' "$(dirname "$0")/../CMakeLists.txt")
[ -n "$version" ] || { echo "no project version in CMakeLists.txt"; exit 1; }
[ "$("$cli" --version)" = "flashattn $version" ] || { echo "--version: expected flashattn $version"; exit 1; }

"$cli" run --seqlen 200 --heads 2 --dim 64 --dtype f32 --repeats 1 > "$work/run.txt"
grep -q "flashattn" "$work/run.txt"
grep -q "standard" "$work/run.txt"

"$cli" run --seqlen-q 100 --seqlen-k 150 --heads 4 --heads-kv 2 --dim 40 --dim-v 24 --no-causal \
  --dtype bf16 --threads 2 --repeats 1 --json > "$work/run.json"
python3 - "$work/run.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert [c["impl"] for c in j["cases"]] == ["flashattn", "standard"], j
for c in j["cases"]:
    assert c["seqlen_q"] == 100 and c["seqlen_k"] == 150 and c["dim_v"] == 24 and not c["causal"]
    assert c["max_error"] < 1e-2, c  # bf16 outputs: a few bf16 ulps of values around 1
assert j["threads"] == 2
PY

# Bad input: a clear error naming the argument, non-zero exit.
if "$cli" run --seqlen 10 --heads 6 --heads-kv 4 --repeats 1 2> "$work/err.txt"; then
  echo "expected failure for heads 6 / heads-kv 4"; exit 1
fi
grep -q "not a multiple" "$work/err.txt"

# File mode: .npy inputs written without numpy (header + raw little-endian float32).
python3 - "$work" <<'PY'
import random, sys
from npyio import save
random.seed(3)
for name, shape in [("q", (1, 9, 2, 8)), ("k", (1, 13, 1, 8)), ("v", (1, 13, 1, 8))]:
    n = 1
    for s in shape: n *= s
    save(f"{sys.argv[1]}/{name}.npy", shape, [random.gauss(0, 1) for _ in range(n)])
PY
"$cli" attend --q "$work/q.npy" --k "$work/k.npy" --v "$work/v.npy" --causal --threads 2 \
  --out "$work/o.npy" --lse "$work/lse.npy"
python3 - "$work" <<'PY'
import math, sys
from npyio import load
_, q = load(f"{sys.argv[1]}/q.npy"); _, k = load(f"{sys.argv[1]}/k.npy"); _, v = load(f"{sys.argv[1]}/v.npy")
hdr, o = load(f"{sys.argv[1]}/o.npy"); _, lse = load(f"{sys.argv[1]}/lse.npy")
assert "(1, 9, 2, 8)" in hdr, hdr
# Independent check in Python: causal, bottom-right aligned, GQA with 2 q heads on 1 kv head.
for h in range(2):
    for i in range(9):
        n = i + 13 - 9 + 1
        s = [sum(q[(i * 2 + h) * 8 + d] * k[j * 8 + d] for d in range(8)) / math.sqrt(8) for j in range(n)]
        m = max(s); w = [math.exp(x - m) for x in s]; t = sum(w)
        assert abs(lse[h * 9 + i] - (m + math.log(t))) < 1e-4
        for d in range(8):
            ref = sum(w[j] * v[j * 8 + d] for j in range(n)) / t
            assert abs(o[(i * 2 + h) * 8 + d] - ref) < 1e-5, (h, i, d)
PY
echo "cli smoke: ok"

# Gradients in file mode (deterministic), checked against a finite difference of the
# forward written by the same CLI: d/dv[j] of Σ dout∘out equals Σ_i P_ij dout_i.
python3 - "$work" <<'PY'
import sys
from npyio import save
save(f"{sys.argv[1]}/do.npy", (1, 9, 2, 8), [((i * 37) % 11 - 5) / 5.0 for i in range(144)])
PY
"$cli" attend --q "$work/q.npy" --k "$work/k.npy" --v "$work/v.npy" --causal --deterministic \
  --out "$work/o.npy" --dout "$work/do.npy" --dq "$work/dq.npy" --dk "$work/dk.npy" --dv "$work/dv.npy"
python3 - "$work" <<'PY'
import math, sys
from npyio import load
w = sys.argv[1]
q, k, v, do, dv = (load(f"{w}/{n}.npy")[1] for n in ("q", "k", "v", "do", "dv"))
assert len(load(f"{w}/dq.npy")[1]) == 144 and len(load(f"{w}/dk.npy")[1]) == 104
# dV[j] = Σ_{h,i} P_hij dO_hi (both q heads share the kv head)
for j in range(13):
    for d in range(8):
        ref = 0.0
        for h in range(2):
            for i in range(9):
                n = i + 13 - 9 + 1
                if j >= n: continue
                s = [sum(q[(i * 2 + h) * 8 + c] * k[jj * 8 + c] for c in range(8)) / math.sqrt(8) for jj in range(n)]
                m = max(s); t = sum(math.exp(x - m) for x in s)
                ref += math.exp(s[j] - m) / t * do[(i * 2 + h) * 8 + d]
        assert abs(dv[j * 8 + d] - ref) < 1e-5, (j, d, dv[j * 8 + d], ref)
PY
"$cli" run --seqlen 150 --heads 2 --dim 32 --dtype f32 --backward --repeats 1 --json > "$work/bwd.json"
python3 - "$work/bwd.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
bwd = [c for c in j["cases"] if c["op"] == "bwd"]
assert [(c["impl"], c["deterministic"]) for c in bwd] == [("flashattn", False), ("flashattn", True), ("standard", False)], bwd
PY
# Kernels chosen by name: the float32 tiled kernels on bf16 inputs, reported per pass.
"$cli" run --seqlen 150 --heads 2 --dim 32 --dtype bf16 --backward --repeats 1 --json \
  --kernel tiled --backward-kernel tiled > "$work/kernels.json"
python3 - "$work/kernels.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
ours = [(c["op"], c["kernel"]) for c in j["cases"] if c["impl"] == "flashattn"]
assert ours == [("fwd", "tiled"), ("bwd", "tiled"), ("bwd", "tiled")], ours
PY
if "$cli" run --seqlen 16 --heads 2 --dim 8 --backward-kernel fast --repeats 1 2> "$work/err.txt"; then
  echo "--backward-kernel fast was accepted" >&2
  exit 1
fi
grep -q "backward-kernel" "$work/err.txt"
# --pack-gqa: the plan stacks the 4 q heads of a kv head in one Q tile, or does not.
"$cli" run --seqlen-q 9 --seqlen-k 300 --heads 8 --heads-kv 2 --dim 32 --dtype f32 --repeats 1 --pack-gqa on \
  > "$work/packed.txt"
grep -q "forward plan: .*heads_per_item=4" "$work/packed.txt"
"$cli" run --seqlen-q 9 --seqlen-k 300 --heads 8 --heads-kv 2 --dim 32 --dtype f32 --repeats 1 --pack-gqa off \
  > "$work/unpacked.txt"
grep -q "forward plan: .*heads_per_item=1" "$work/unpacked.txt"
if "$cli" run --seqlen 16 --heads 2 --dim 8 --pack-gqa yes --repeats 1 2> "$work/err.txt"; then
  echo "--pack-gqa yes was accepted" >&2
  exit 1
fi
grep -q "pack-gqa" "$work/err.txt"
echo "cli smoke (gradients, kernels): ok"

# Variants and a packed variable-length batch in file mode: two sequences (3 and 6 queries,
# 5 and 8 keys) with a window, softcap and ALiBi, checked against a Python reference.
python3 - "$work" <<'PY'
import random, sys
from npyio import save
random.seed(5)
w = sys.argv[1]
save(f"{w}/vq.npy", (9, 2, 4), [random.gauss(0, 1) for _ in range(72)])
save(f"{w}/vk.npy", (13, 1, 4), [random.gauss(0, 1) for _ in range(52)])
save(f"{w}/vv.npy", (13, 1, 4), [random.gauss(0, 1) for _ in range(52)])
save(f"{w}/cuq.npy", (3,), [0, 3, 9], "<i4")
save(f"{w}/cuk.npy", (3,), [0, 5, 13], "<i4")
save(f"{w}/slopes.npy", (2,), [0.5, 0.25])
PY
"$cli" attend --q "$work/vq.npy" --k "$work/vk.npy" --v "$work/vv.npy" --cu-seqlens-q "$work/cuq.npy" \
  --cu-seqlens-k "$work/cuk.npy" --causal --window-size 3 0 --softcap 2 --alibi-slopes "$work/slopes.npy" \
  --out "$work/vo.npy" --lse "$work/vlse.npy"
python3 - "$work" <<'PY'
import math, sys
from npyio import load
w = sys.argv[1]
q, k, v = (load(f"{w}/{n}.npy")[1] for n in ("vq", "vk", "vv"))
_, o = load(f"{w}/vo.npy")
_, lse = load(f"{w}/vlse.npy")
cq, ck, slopes = [0, 3, 9], [0, 5, 13], [0.5, 0.25]
for b in range(2):
    sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
    for h in range(2):
        for i in range(sq):
            diag = i + sk - sq
            keys = [j for j in range(sk) if diag - 3 <= j <= diag]
            s = []
            for j in keys:
                x = sum(q[((cq[b] + i) * 2 + h) * 4 + c] * k[(ck[b] + j) * 4 + c] for c in range(4)) / 2.0
                s.append(2 * math.tanh(x / 2) - slopes[h] * abs(diag - j))
            m = max(s); t = sum(math.exp(x - m) for x in s)
            assert abs(lse[h * 9 + cq[b] + i] - (m + math.log(t))) < 1e-5
            for c in range(4):
                ref = sum(math.exp(s[n] - m) / t * v[(ck[b] + j) * 4 + c] for n, j in enumerate(keys))
                assert abs(o[((cq[b] + i) * 2 + h) * 4 + c] - ref) < 1e-5, (b, h, i, c)
PY

# Bad files and sizes met before a library call: exit 2 with a message naming the option,
# never a crash (these were a segfault, out-of-bounds reads, an abort and a hang), and no
# output written.
fails_with() {  # fails_with FRAGMENT COMMAND...
  local fragment=$1 rc=0
  shift
  "$@" > /dev/null 2> "$work/err.txt" || rc=$?
  [ "$rc" = 2 ] || { echo "expected exit 2 from: $* (got $rc)"; cat "$work/err.txt"; exit 1; }
  grep -qF -- "$fragment" "$work/err.txt" || { echo "expected '$fragment' from: $*"; cat "$work/err.txt"; exit 1; }
}
python3 - "$work" <<'PY'
import sys
from npyio import save
w = sys.argv[1]
save(f"{w}/cu_empty.npy", (0,), [], "<i4")
save(f"{w}/cuk4.npy", (4,), [0, 5, 13, 13], "<i4")
save(f"{w}/cu_f32.npy", (3,), [0, 3, 9])
save(f"{w}/cu_down.npy", (3,), [0, 9, 3], "<i4")
PY
attend_varlen=("$cli" attend --q "$work/vq.npy" --k "$work/vk.npy" --v "$work/vv.npy" --out "$work/never.npy")
fails_with "--cu-seqlens-q: expected int32 offsets of rank 1" \
  "${attend_varlen[@]}" --cu-seqlens-q "$work/cu_empty.npy" --cu-seqlens-k "$work/cuk.npy"
fails_with "--cu-seqlens-k: expected int32 offsets" \
  "${attend_varlen[@]}" --cu-seqlens-q "$work/cuq.npy" --cu-seqlens-k "$work/cu_f32.npy"
fails_with "--cu-seqlens-q: 3 offsets but --cu-seqlens-k has 4" \
  "${attend_varlen[@]}" --cu-seqlens-q "$work/cuq.npy" --cu-seqlens-k "$work/cuk4.npy"
fails_with "--cu-seqlens-q: decreasing at 2 (9, then 3)" \
  "${attend_varlen[@]}" --cu-seqlens-q "$work/cu_down.npy" --cu-seqlens-k "$work/cuk.npy"
fails_with "--cu-seqlens-q: expected int32 offsets" "$cli" run --heads 2 --dim 8 --repeats 1 \
  --cu-seqlens-q "$work/cu_empty.npy" --cu-seqlens-k "$work/cuk.npy"
[ ! -e "$work/never.npy" ] || { echo "a refused attend wrote its output"; exit 1; }
attend=("$cli" attend --q "$work/q.npy" --k "$work/k.npy" --v "$work/v.npy")
fails_with "--out: the file of --q" "${attend[@]}" --out "$work/q.npy"
fails_with "--dq and --dv: the same file" "${attend[@]}" --out "$work/o2.npy" --dout "$work/q.npy" \
  --dq "$work/g.npy" --dk "$work/gk.npy" --dv "$work/g.npy"
fails_with "dout: shape (1, 13, 1, 8)" "${attend[@]}" --out "$work/o2.npy" --dout "$work/k.npy" \
  --dq "$work/gq.npy" --dk "$work/gk.npy" --dv "$work/gv.npy"
[ ! -e "$work/o2.npy" ] || { echo "attend wrote --out before its backward failed"; exit 1; }
# Integer values for attention (they were converted value by value, silently), and a dtype
# holding a NUL (it cut the message short): named, the bytes shown as '?'.
python3 - "$work" <<'PY'
import sys
from npyio import save
w = sys.argv[1]
save(f"{w}/k_i32.npy", (1, 13, 1, 8), list(range(104)), "<i4")
with open(f"{w}/nul.npy", "wb") as f:
    header = "{'descr': '<f4\0', 'fortran_order': False, 'shape': (2, ), }"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(8))
# A header-only file of 2^40 empty sequences: its backward ran for hours over batch x heads.
with open(f"{w}/empty_rows.npy", "wb") as f:
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 0, 2, 8), }"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
PY
fails_with "--k: $work/k_i32.npy holds i32 values; attention takes a floating dtype" \
  "$cli" attend --q "$work/q.npy" --k "$work/k_i32.npy" --v "$work/v.npy" --out "$work/o2.npy"
fails_with "--dout: $work/k_i32.npy holds i32" "${attend[@]}" --out "$work/o2.npy" --dout "$work/k_i32.npy" \
  --dq "$work/gq.npy" --dk "$work/gk.npy" --dv "$work/gv.npy"
fails_with "unsupported dtype '<f4?' (supported:" "${attend[@]}" --out "$work/o2.npy" --dout "$work/nul.npy" \
  --dq "$work/gq.npy" --dk "$work/gk.npy" --dv "$work/gv.npy"
[ ! -e "$work/o2.npy" ] || { echo "a refused attend wrote --out"; exit 1; }
e="$work/empty_rows.npy"
timeout 60 "$cli" attend --q "$e" --k "$e" --v "$e" --dout "$e" --out "$work/eo.npy" --dq "$work/edq.npy" \
  --dk "$work/edk.npy" --dv "$work/edv.npy" --threads 1 > /dev/null
fails_with "the problem the options describe is too large to allocate" "$cli" run --heads 2 --dim 8 --repeats 1 \
  --threads 1 --seqlen-k 9223372036854775807
fails_with "overflow the cost model's 64-bit counts" "$cli" explain --seqlen 2147483648 --heads 2 --dim 8
# Bytes overflowed while FLOPs fit (a small head dim): negative byte counts were printed.
fails_with "standard attention's traffic" "$cli" explain --batch 16384 --heads 1 --seqlen 4194304 --dim 1 \
  --dtype f32 --tile 4096 4096
# Rows the model walks one by one (--seqlen-k 1 kept the tile pairs few): ran for minutes.
fails_with "walks every query row, at most 2^28" "$cli" explain --seqlen-q 1073741824 --seqlen-k 1 --heads 1
# The CPU's tiles are its plan's, not --tile's BC: the walk's guard counted the wrong pairs.
# (The plan's tiles depend on the CPU: 6 x 256 on AVX2, 8 x 128 on AVX-512.)
fails_with "(Q tile, K/V tile) pairs to walk (tiles of " "$cli" explain --arch cpu --threads 1 --heads 1 \
  --tile 1 1000000000 --seqlen 2097152
if grep -qF "tiles of 1 x 1000000000" "$work/err.txt"; then
  echo "explain --arch cpu walked --tile's tiles, not its plan's"; cat "$work/err.txt"; exit 1
fi
fails_with "--sram-elements: a fast-memory size of at least 1 element, got 1e-300" "$cli" explain --sram-elements 1e-300
fails_with "--sram-elements: a fast-memory size of at least 1 element, got inf" "$cli" explain --sram-elements inf
# A tile past its sequence is one tile of it (near INT64_MAX the walks overflowed to 0 tiles).
"$cli" explain --tile 9223372036854775807 9223372036854775807 --seqlen 300 --heads 1 --dim 32 --json > "$work/huge_tile.json"
python3 - "$work/huge_tile.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
t = j["tiles"]
assert t["forward"]["computed"] == 1 and t["backward"]["computed"] == 1, t
PY
# More threads than cores: the model's cores and L2s are the machine's.
"$cli" explain --arch cpu --threads 64 --seqlen 512 --heads 2 --dim 32 > "$work/threads64.txt"
grep -q "this CPU: $(nproc) cores" "$work/threads64.txt" || { echo "explain invented cores"; cat "$work/threads64.txt"; exit 1; }
if "$cli" run --seqlen 16 --heads 2 --dim 8 --repeats 1 --threads 32768 > /dev/null 2> "$work/err.txt"; then
  echo "expected --threads 32768 refused"; exit 1
fi
grep -q "not in range 0 to 4096" "$work/err.txt"
if "$cli" run --seqlen 16 --heads 2 --dim 8 --repeats 1 --dropout-p 0.1 --seed -1 > /dev/null 2> "$work/err.txt"; then
  echo "expected --seed -1 refused (it ran as 2^64 - 1)"; exit 1
fi
grep -q "expected an integer from 0 to 2^64 - 1" "$work/err.txt"
ln "$work/q.npy" "$work/q_link.npy"
fails_with "--out: the file of --q" "${attend[@]}" --out "$work/q_link.npy"
echo "cli smoke (variants, varlen): ok"
"$cli" run --cu-seqlens-q "$work/cuq.npy" --cu-seqlens-k "$work/cuk.npy" --heads 2 --heads-kv 1 --dim 4 \
  --dtype f32 --window-size 3 0 --repeats 1 --backward --json > "$work/varlen.json"
python3 - "$work/varlen.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["varlen"]
assert j["batch"] == 2 and j["total_q"] == 9 and j["total_k"] == 13, j
assert j["max_error"] < 1e-5 and j["bwd_seconds"] > 0, j
PY
echo "cli smoke (run varlen): ok"

# One decoding step over contiguous and paged KV caches.
for pages in 0 7; do
  "$cli" run --decode --cache-seqlen 300 --heads 4 --heads-kv 2 --dim 32 --page-size $pages --repeats 1 --json \
    > "$work/decode.json"
  python3 - "$work/decode.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["cases"][0]
assert c["op"] == "decode" and c["cached"] == 300 and c["max_error"] < 2e-2 and c["gbps"] > 0, c
PY
done
# FP8 and int8 caches by kernel name: decode always; decode_fp16 (decode_bf16) where the CPU
# has AVX512-FP16 (AVX512-BF16), else rejected with the reason; the plan's kernel is reported.
for cache in e4m3 u8 s8; do
  for kernel in decode decode_fp16 decode_bf16; do
    if "$cli" run --decode --cache-seqlen 300 --heads 4 --heads-kv 2 --dim 32 --cache-dtype $cache --kernel $kernel \
        --repeats 1 --json > "$work/decode.json" 2> "$work/err.txt"; then
      python3 - "$work/decode.json" "$kernel" "$cache" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["cases"][0]
assert c["kernel"] == sys.argv[2] and c["cache_dtype"] == sys.argv[3] and c["max_error"] < 2e-2, c
PY
    else
      case $kernel in
        decode_fp16) grep -q "AVX512-FP16 (this one: no)" "$work/err.txt" ;;
        decode_bf16) grep -q "AVX512-BF16 (this one: no)" "$work/err.txt" ;;
        *) cat "$work/err.txt" >&2; exit 1 ;;
      esac
    fi
  done
done
if "$cli" run --decode --cache-seqlen 300 --heads 4 --heads-kv 2 --dim 32 --kernel decode_fp16 --repeats 1 \
    2> "$work/err.txt"; then
  echo "--kernel decode_fp16 was accepted for a bf16 cache" >&2
  exit 1
fi
grep -q "a quantized KV cache, FP8 (e4m3) or int8 codes" "$work/err.txt"
echo "cli smoke (decode): ok"

# Options a mode does not read, counts and sizes out of range, empty problems: a clear error
# naming the option (exit 2 from flashattn, CLI11's own code from a validator), never a crash,
# a hang or a silently ignored option; empty problems print n/a, never nan.
refused() {  # refused FRAGMENT COMMAND...: a non-zero exit that is not a signal, naming FRAGMENT
  local fragment=$1 rc=0
  shift
  "$@" > /dev/null 2> "$work/err.txt" || rc=$?
  [ "$rc" != 0 ] && [ "$rc" -lt 124 ] || { echo "expected a refusal from: $* (got $rc)"; cat "$work/err.txt"; exit 1; }
  grep -qF -- "$fragment" "$work/err.txt" || { echo "expected '$fragment' from: $*"; cat "$work/err.txt"; exit 1; }
}
refused "--repeats: must be a positive integer, got 0" "$cli" explain --seqlen 64 --heads 1 --dim 32 --measure --repeats 0
refused "--repeats: must be a positive integer, got 0" "$cli" run --seqlen 64 --heads 1 --dim 32 --repeats 0
if "$cli" --help | grep -q "^  ring"; then
  refused "--repeats: must be a positive integer, got 0" "$cli" ring --seqlen 64 --heads 2 --dim 32 --repeats 0
fi
refused "--sgemm-size: must be a positive integer, got 0" "$cli" bench --sgemm-size 0
fails_with "tour: --max-seqlen must be at most 2^24" timeout 60 "$cli" tour --max-seqlen 9223372036854775807
for value in 9223372036854775807 -5; do
  refused "--cache-seqlen: Value $value not in range 0 to 16777215" "$cli" run --decode --cache-seqlen "$value"
done
for value in 9223372036854775807 -4; do
  refused "--page-size: Value $value not in range 0 to 16777215" "$cli" run --decode --cache-seqlen 30 --page-size "$value"
done
decode=("$cli" run --decode --cache-seqlen 30 --heads 4 --heads-kv 2 --dim 32 --repeats 1)
for option in "--dim-v 16" "--softcap 2" "--dropout-p 0.1" "--window-size 4 0" "--seqlen-q 4" "--seqlen-k 9" \
    "--backward" "--softmax-scale 0.5" "--num-splits 2" "--pack-gqa on" "--samples 3"; do
  # shellcheck disable=SC2086  # the option and its values as words
  fails_with "--decode does not take ${option%% *}" "${decode[@]}" $option
done
fails_with "--decode does not take --causal/--no-causal" "${decode[@]}" --no-causal
fails_with "--decode does not take --alibi-slopes" "${decode[@]}" --alibi-slopes "$work/slopes.npy"
fails_with "--decode does not take --cu-seqlens-q" "${decode[@]}" --cu-seqlens-q "$work/cuq.npy" \
  --cu-seqlens-k "$work/cuk.npy"
for option in "--cache-seqlen 30" "--page-size 16" "--cache-dtype e4m3"; do
  # shellcheck disable=SC2086
  fails_with "run without --decode does not take ${option%% *}" "$cli" run --seqlen 16 --heads 2 --dim 8 --repeats 1 $option
done
"${decode[@]}" > "$work/decode.txt"
grep -q "of K and V (7.8 KiB)" "$work/decode.txt" || { echo "decode: cache size not in KiB"; cat "$work/decode.txt"; exit 1; }
run_varlen=("$cli" run --cu-seqlens-q "$work/cuq.npy" --cu-seqlens-k "$work/cuk.npy" --heads 2 --dim 4 --repeats 1)
for option in "--batch 2" "--seqlen 9" "--seqlen-q 9" "--samples 3"; do
  # shellcheck disable=SC2086
  fails_with "--cu-seqlens-q/--cu-seqlens-k does not take ${option%% *}" "${run_varlen[@]}" $option
done
refused "--kernel" "$cli" numerics --seqlen 64 --heads 2 --dim 32 --kernel tiled
fails_with "--ops: --quick times its fixed subset" "$cli" bench --quick --ops fwd
fails_with "--ops: --sweep times fwd and bwd only, got decode" "$cli" bench --sweep --ops fwd,decode
fails_with "--kernel decode_fp16: applies to the decode cases, and --ops has no decode" \
  "$cli" bench --ops fwd --kernel decode_fp16 --seqlen 64 --heads 2 --dim 32
fails_with "--kernel decode_bf16: --sweep and --quick time no decode case" "$cli" bench --sweep --kernel decode_bf16
if ! grep -q avx512_fp16 /proc/cpuinfo; then  # refused before the baselines (sgemm 2048^3, peaks) run
  fails_with "--kernel decode_fp16: needs a CPU with AVX512-FP16 (this one: no)" \
    timeout 5 "$cli" bench --ops fwd,decode --kernel decode_fp16 --seqlen 64 --heads 2 --dim 32
fi
grep -qF "GFLOP/s counts the FLOPs of the visible (query, key) pairs only, 2*(D+Dv)" "$work/run.txt" \
  || { echo "run: footnote does not describe the GFLOP/s column"; exit 1; }
"$cli" run --seqlen 0 --heads 2 --dim 32 --repeats 1 > "$work/empty_run.txt" 2> /dev/null
"$cli" explain --seqlen 0 --heads 2 --dim 32 > "$work/empty_explain.txt"
"$cli" numerics --seqlen 0 --heads 2 --dim 32 --repeats 1 > "$work/empty_numerics.txt" 2> /dev/null
for out in empty_run empty_explain empty_numerics; do
  if grep -qi "nan" "$work/$out.txt"; then echo "$out: prints nan"; grep -i nan "$work/$out.txt"; exit 1; fi
done
grep -q "neither takes extra memory" "$work/empty_run.txt"
grep -q "tiled 0 ms: n/a" "$work/empty_explain.txt"
fails_with "--measure: no query row to run" "$cli" explain --seqlen 0 --heads 2 --dim 32 --measure
fails_with "--dv: folder $work/absent of $work/absent/dv.npy is not an existing folder" "${attend[@]}" \
  --out "$work/o3.npy" --lse "$work/lse3.npy" --dout "$work/do.npy" --dq "$work/dq3.npy" --dk "$work/dk3.npy" \
  --dv "$work/absent/dv.npy"
[ ! -e "$work/o3.npy" ] && [ ! -e "$work/lse3.npy" ] || { echo "attend wrote --out before checking --dv's folder"; exit 1; }
fails_with "--out: $work is a folder, not a file" "${attend[@]}" --out "$work"
echo "cli smoke (refusals, empty problems): ok"

# The serving batch, small: one forward_varlen_paged call against one call per sequence, and
# sequences sharing a prefix, shared against unshared, and small chunks, pack_gqa against not.
"$cli" bench --ops serve_smoke --json --repeats 5 --sgemm-size 64 > "$work/serve.json" 2> "$work/err.txt"
python3 - "$work/serve.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
(c,) = [c for c in j["cases"] if c["op"] == "serve"]
assert c["case"] == "smoke" and c["speedup_vs_per_sequence"] > 0 and c["decode_gbps"] > 0 and j["copy_gbps"] > 0, c
assert j["read_gbps"] > 0, j["read_gbps"]
assert c["shared_sequences"] == 4 and c["shared_prefix"] == 320 and c["shared_prefix_speedup"] > 0, c
assert (c["chunk_sequences"], c["chunk_rows"], c["chunk_cached"]) == (3, 5, 200), c
assert c["pack_gqa_speedup"] > 0 and c["chunk_gbps"] > 0, c
PY
echo "cli smoke (serve): ok"

# The mask forms, small: the document mask as mask_mod, varlen and a dense boolean mask give
# varlen's output; every form a fraction of its peak on the visible pairs; the ratios reported.
"$cli" bench --ops masks_smoke --json --repeats 5 --sgemm-size 64 --threads 2 > "$work/masks.json" 2> "$work/err.txt"
python3 - "$work/masks.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
cases = {c["form"]: c for c in j["cases"] if c["op"] == "masks"}
assert sorted(cases) == sorted(["unmasked", "causal", "varlen", "mask_mod", "dense_bool", "score_mod"]), cases
tokens, length, heads = 4 * 40, 40, 2
pairs = {"unmasked": tokens * tokens * heads, "causal": tokens * (tokens + 1) // 2 * heads,
         "score_mod": tokens * (tokens + 1) // 2 * heads}
for form, c in cases.items():
    assert c["case"] == "smoke" and c["seconds"] > 0 and c["kernel"], c
    assert c["visible_pairs"] == pairs.get(form, 4 * length * (length + 1) // 2 * heads), c
    assert abs(c["gflops"] - 4 * c["dim"] * c["visible_pairs"] / c["seconds"] * 1e-9) <= 1e-6 * c["gflops"], c
    assert 0 < c["fraction_of_peak"] < 1, c
for form in ("mask_mod", "dense_bool"):
    assert cases[form]["max_diff_vs_varlen"] < 1e-5, cases[form]
(r,) = j["mask_ratios"]
for key, a, b in [("mask_mod_vs_varlen", "mask_mod", "varlen"), ("dense_bool_vs_unmasked", "dense_bool", "unmasked"),
                  ("dense_bool_vs_varlen", "dense_bool", "varlen"), ("score_mod_vs_causal", "score_mod", "causal")]:
    assert abs(r[key] - cases[a]["gflops"] / cases[b]["gflops"]) <= 1e-9 * r[key], (key, r)
assert r["create_block_mask_seconds"] > 0 and r["block_size"] == 16, r
PY
echo "cli smoke (masks): ok"

# The peaks beside the cases: the FMA loop measured, each bf16 peak measured or null with a
# reason naming the CPU feature it lacks, and every timed case a fraction of the peak it names.
"$cli" bench --ops fwd --seqlen 64 --heads 2 --dim 32 --threads 2 --json --repeats 5 --sgemm-size 64 \
  > "$work/peaks.json" 2> "$work/err.txt"
python3 - "$work/peaks.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
flags = set(open("/proc/cpuinfo").read().split())
assert j["fma_peak_gflops"] > 0 and "Highway" in j["fma_peak_isa"], j
for key, feature, flag in [("bf16", "AVX512-BF16", "avx512_bf16"), ("amx_bf16", "AMX-BF16", "amx_bf16")]:
    gflops = j[key + "_peak_gflops"]
    if gflops is None:
        assert feature in j[key + "_peak_reason"], j
        assert flag not in flags or key == "amx_bf16", (key, "measured nowhere although the CPU has", flag)
    else:
        assert gflops > 0 and j[key + "_peak_isa"] and flag in flags, j
peaks = {"fma": j["fma_peak_gflops"], "bf16_dot": j["bf16_peak_gflops"], "amx_bf16": j["amx_bf16_peak_gflops"]}
timed = [c for c in j["cases"] if c["op"] in ("fwd", "bwd")]
assert timed, j["cases"]
for c in timed:
    assert c["bounded_by"] in peaks and (c["bounded_by"] == "fma") == (c.get("kernel") != "tiled_bf16"), c
    assert c["peak_gflops"] == peaks[c["bounded_by"]], c
    assert abs(c["fraction_of_peak"] - c["gflops"] / c["peak_gflops"]) <= 1e-9 * c["fraction_of_peak"], c
    assert c["fraction_of_peak"] < 1, c  # visible pairs' FLOPs: below the machine's peak
    # A block-sparse case of one 128-token block that the random mask dropped has no visible pair.
    assert (c["fraction_of_peak"] > 0) == (c.get("block_kept_fraction") != 0.0), c
PY
echo "cli smoke (bench peaks): ok"
