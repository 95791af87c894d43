#!/usr/bin/env bash
# `flashattn bench --sweep` and `--quick` on tiny shapes: one JSON case per grid point with
# the schema's fields, the plot as well-formed SVG with one line per configuration and
# sgemm's, the quick subset's targets, and the flag combinations that are refused.
set -euo pipefail
cli=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tiny=(--heads 2 --threads 2 --repeats 5 --sgemm-size 128)

"$cli" bench --sweep --seqlens 64,96 --dims 16 --dtypes f32,bf16 --causal no,yes "${tiny[@]}" --json \
  --plot "$work/sweep.svg" > "$work/sweep.json"
python3 - "$work/sweep.json" "$work/sweep.svg" <<'PY'
import itertools, json, sys
import xml.etree.ElementTree as ET
j = json.load(open(sys.argv[1]))
assert j["mode"] == "sweep" and j["threads"] == 2 and j["sgemm_gflops"] > 0, j
assert "not timed" in j["standard_attention"]
assert j["grid"] == {"seqlens": [64, 96], "dims": [16], "dtypes": ["f32", "bf16"], "causal": ["no", "yes"],
                     "ops": ["fwd", "bwd"]}, j["grid"]
fields = {"impl", "op", "dtype", "batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "dim", "dim_v", "causal",
          "seconds", "gflops", "peak_bytes", "threads"}
points = []
for c in j["cases"]:
    assert fields <= set(c), c
    assert c["impl"] == "flashattn" and c["heads"] == 2 and c["seqlen_q"] == c["seqlen_k"] and c["threads"] == 2, c
    assert c["seconds"] > 0 and c["gflops"] > 0, c
    points.append((c["dtype"], c["dim"], c["seqlen_q"], c["causal"], c["op"]))
grid = set(itertools.product(["f32", "bf16"], [16], [64, 96], [False, True], ["fwd", "bwd"]))
assert len(points) == len(grid) and set(points) == grid, sorted(points)

svg = ET.parse(sys.argv[2]).getroot()
ns = "{http://www.w3.org/2000/svg}"
lines = svg.findall(f"{ns}polyline")
names = [t.text for t in svg.findall(f"{ns}text")]
assert len(lines) == 2 * 2 * 2 + 1, len(lines)  # (op, dtype, causal) at D=16, and sgemm
assert "sgemm (OpenBLAS)" in names and "fwd bf16 causal D=16" in names, names
for line in lines:  # two seqlens per configuration; sgemm spans them
    assert len(line.get("points").split()) == 2, line.get("points")
PY
echo "bench sweep: ok"

"$cli" bench --quick --seqlen 64 --dim 32 "${tiny[@]}" --json --plot "$work/quick.svg" > "$work/quick.json"
python3 - "$work/quick.json" "$work/quick.svg" <<'PY'
import json, sys
import xml.etree.ElementTree as ET
j = json.load(open(sys.argv[1]))
assert j["mode"] == "quick" and j["threads"] == 2, j
cases = {(c["op"], c["dtype"], c["causal"], c["dim"], c["seqlen_q"], c["threads"]) for c in j["cases"]}
expected = {(op, dt, causal, 32, 64, 2) for op in ("fwd", "bwd") for dt in ("f32", "bf16") for causal in (False, True)}
expected |= {("fwd", "f32", False, 64, 64, 2), ("fwd", "f32", False, 256, 64, 2),
             ("fwd", "f32", False, 32, 64, 1), ("fwd", "f32", False, 32, 256, 2)}
assert cases == expected and len(j["cases"]) == len(expected), sorted(cases ^ expected)
targets = j["targets"]
assert len(targets) == 9, targets
for t in targets:
    assert isinstance(t["pass"], bool) and t["ratio"] > 0 and t["target"] > 0 and t["name"] and t["measure"], t
    assert t["pass"] == (t["ratio"] >= t["target"]), t
by_name = {t["name"]: t for t in targets}
for c in j["cases"]:  # each case's own sgemm, measured just before it at the run's threads
    assert c["sgemm_gflops"] > 0 and abs(c["vs_sgemm"] - c["gflops"] / c["sgemm_gflops"]) < 1e-9 * c["vs_sgemm"], c
f32 = {(c["causal"], c["op"]): c for c in j["cases"]
       if c["dtype"] == "f32" and c["dim"] == 32 and c["seqlen_q"] == 64 and c["threads"] == 2}
t = by_name["fp32 forward, non-causal (S=64, D=32)"]
assert abs(t["ratio"] - f32[(False, "fwd")]["vs_sgemm"]) < 1e-9 * t["ratio"], t
one = [c for c in j["cases"] if c["threads"] == 1][0]
t = by_name["fp32 forward, 1 -> 2 threads"]
assert abs(t["ratio"] - f32[(False, "fwd")]["vs_sgemm"] / one["vs_sgemm"]) < 1e-9 * t["ratio"], t
assert by_name["fp32 forward, 1 -> 2 threads"]["target"] == 1.85
# Issue 25's targets: each a case's GFLOP/s over the peak measured just before it.
assert j["fma_peak_gflops"] > 0, j
peak_targets = {t["name"]: t for t in j["peak_targets"]}
assert len(peak_targets) == 8, j["peak_targets"]
for c in j["cases"]:
    assert c["bounded_by"] in ("fma", "bf16_dot", "amx_bf16") and c["peak_gflops"] > 0, c
    assert abs(c["fraction_of_peak"] - c["gflops"] / c["peak_gflops"]) <= 1e-9 * c["fraction_of_peak"], c
t = peak_targets["fp32 forward, non-causal (S=64, D=32)"]
assert abs(t["ratio"] - f32[(False, "fwd")]["fraction_of_peak"]) < 1e-9 * t["ratio"] and t["target"] == 0.88, t
assert "fma peak" in t["measure"] and t["pass"] == (t["ratio"] >= t["target"]), t
svg = ET.parse(sys.argv[2]).getroot()
ns = "{http://www.w3.org/2000/svg}"
# 12 cases on 11 lines (the 4·S case extends the base f32 forward line), and sgemm's
assert len(svg.findall(f"{ns}polyline")) == 12
assert "fwd f32 full D=32 t=1" in [t.text for t in svg.findall(f"{ns}text")]
PY
echo "bench quick: ok"

# Refused combinations: a clear error, non-zero exit.
expect_error() {
  local pattern=$1; shift
  if "$cli" bench "$@" > /dev/null 2> "$work/err.txt"; then echo "expected failure: bench $*"; exit 1; fi
  grep -q -- "$pattern" "$work/err.txt" || { echo "no '$pattern' in:"; cat "$work/err.txt"; exit 1; }
}
expect_error "--plot" --plot "$work/x.svg" --repeats 5
expect_error "--sweep" --seqlens 64
expect_error "excludes" --sweep --quick
expect_error "--repeats" --sweep --repeats 3
expect_error "--ops" --sweep --ops decode --seqlens 64 --dims 16
echo "bench sweep (refused flags): ok"
