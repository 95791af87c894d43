#!/usr/bin/env bash
# `flashattn explain --json` (GPU table and this CPU with counters) and `flashattn tour`
# at small sizes: the documented JSON keys, counters equal to the model, the figures.
set -euo pipefail
cli=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$cli" explain --seqlen 300 --heads 2 --dim 64 --arch b200 --json > "$work/gpu.json"
"$cli" explain --seqlen-q 200 --seqlen-k 700 --heads 4 --heads-kv 2 --dim 40 --dim-v 24 --dtype f32 \
  --window-size 50 10 --no-causal --arch cpu --threads 2 --measure --repeats 1 --json > "$work/cpu.json"
"$cli" explain --seqlen 300 --heads 2 --dim 64 --arch b200 --standard eager --dropout-p 0.1 --json > "$work/eager.json"
"$cli" explain --seqlen 256 --heads 1 --dim 32 --arch a100 > "$work/text.txt"
# The first paper's GPT-2 medium table: each ratio within ±25% of the paper's figures
# (66.6 / 75.2 GFLOPs, 40.3 / 4.4 GB, 41.7 / 7.3 ms); the preset refuses flags that change it.
"$cli" explain --preset gpt2-medium --json > "$work/gpt2.json"
"$cli" explain --preset gpt2-medium > "$work/gpt2.txt"
grep -q "^  HBM reads + writes, GB (standard / flash) *40.3 *4.4 *9.16 " "$work/gpt2.txt"
if "$cli" explain --preset gpt2-medium --batch 8 2> "$work/err.txt"; then exit 1; fi
grep -q "sets the paper's problem; drop --batch" "$work/err.txt"
python3 - "$work/gpt2.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
p = j["problem"]
assert (p["batch"], p["seqlen_q"], p["heads_q"], p["head_dim"], p["dtype"], p["causal"]) == (64, 1024, 16, 64, "f16", False), p
assert j["arch"]["name"] == "a100-40gb"
f, t, pr = j["flops"], j["traffic"], j["predicted"]
model = [(f["forward"] + f["backward"]) / (f["standard_forward"] + f["standard_backward"]),
         t["standard_bytes"] / t["flash_bytes"], pr["standard_ms"] / pr["flash_ms"]]
paper = [75.2 / 66.6, 40.3 / 4.4, 41.7 / 7.3]
for m, b in zip(model, paper):
    assert abs(m / b - 1) <= 0.25, (model, paper)
assert [r["within_tolerance"] for r in j["preset"]["rows"]] == [True, True, True], j["preset"]
PY
grep -q "Cycles per 128x128x32 tile" "$work/text.txt"
# Non-causal by default, as upstream; the header line states it.
grep -q "^flashattn explain: batch=1 .* causal=false " "$work/text.txt"
"$cli" explain --seqlen 256 --heads 1 --dim 32 --arch a100 --causal > "$work/causal.txt"
grep -q "^flashattn explain: .* causal=true " "$work/causal.txt"
python3 - "$work/gpu.json" "$work/cpu.json" <<'PY'
import json, sys
for path in sys.argv[1:]:
    j = json.load(open(path))
    for key in ["forward", "backward", "backward_recompute", "standard_forward", "standard_backward"]:
        assert j["flops"][key] > 0, (path, key)
    t = j["traffic"]
    for key in ["standard_bytes", "flash_bytes", "theta_standard", "theta_flash"]:
        assert t[key] > 0, (path, key)
    assert t["standard_bytes"] == t["forward"]["standard_bytes"] + t["backward"]["standard_bytes"]
    assert t["flash_bytes"] == t["forward"]["flash_bytes"] + t["backward"]["flash_bytes"]
    for p in ["forward", "backward"]:
        c = j["tile_cycles"][p]
        assert all(c[k] > 0 for k in ["mma", "exp", "smem"]) and c["bottleneck"], c
    # The tiled backward is the standard one's products over the visible pairs plus the recomputation.
    assert j["flops"]["backward"] > j["flops"]["backward_recompute"] > 0
    # Both sides predicted from the same table; the tiled traffic with the L2 at most the raw count.
    pr = j["predicted"]
    assert pr["standard_ms"] > 0 and pr["flash_ms"] > 0, pr
    assert abs(pr["flash_ms"] - 1e3 * (j["prediction"]["forward"]["seconds"] + j["prediction"]["backward"]["seconds"])) < 1e-9 * pr["flash_ms"]
    assert abs(pr["standard_ms"] - 1e3 * (pr["standard"]["forward"]["seconds"] + pr["standard"]["backward"]["seconds"])) < 1e-9 * pr["standard_ms"]
    assert 0 < t["flash_bytes"] <= t["flash_raw_bytes"], t
    for p in ["forward", "backward"]:
        assert t[p]["standard_bytes"] == sum(k["bytes"] for k in t[p]["standard_passes"]), (path, p)
gpu = json.load(open(sys.argv[1]))
assert gpu["problem"]["causal"] is False, gpu["problem"]
# --standard eager: one kernel per step, more bytes than the minimal model, dropout's kernels listed.
eager = json.load(open(sys.argv[1].replace("gpu.json", "eager.json")))
assert eager["traffic"]["standard_model"] == "eager" and gpu["traffic"]["standard_model"] == "minimal"
assert eager["traffic"]["standard_bytes"] > 1.5 * gpu["traffic"]["standard_bytes"], (eager["traffic"]["standard_bytes"], gpu["traffic"]["standard_bytes"])
names = [k["name"] for k in eager["traffic"]["forward"]["standard_passes"]]
assert names[1:5] == ["scale", "mask", "P = softmax(S)", "dropout"], names
assert eager["traffic"]["flash_bytes"] == gpu["traffic"]["flash_bytes"]  # dropout regenerated: no tiled traffic
assert eager["predicted"]["standard_ms"] > gpu["predicted"]["standard_ms"]
assert gpu["arch"]["name"] == "b200" and gpu["tile_cycles"]["tile"] == [128, 128, 64]
assert gpu["tile_cycles"]["forward"]["bottleneck"] in ("mma", "exp", "mma=exp"), gpu["tile_cycles"]
cpu = json.load(open(sys.argv[2]))
assert cpu["arch"]["name"] == "cpu" and cpu["arch"]["units"] == 2
m = cpu["measured"]
for p in ["forward", "backward"]:
    for key, value in m["model"][p].items():
        # kv_packed depends on which thread ran which item, rows_computed and scores_computed
        # on the micro-tile's geometry (the strips' padding): measured only, the model has none.
        if key in ("kv_packed", "rows_computed", "scores_computed"):
            continue
        assert m[p][key] == value, (p, key, m[p][key], value)
    assert m[p]["tiles_computed"] > 0 and m[p]["tiles_skipped"] > 0  # the window skips tiles
PY

"$cli" tour --max-seqlen 512 --dim 32 --heads 1 --repeats 1 --threads 2 --out "$work/figures" > "$work/tour.txt"
grep -q "^problems: batch=1 heads=1 head_dim=32 dtype=f32 causal=false seqlen=256..512" "$work/tour.txt"
for chapter in "== 1. " "== 2. " "== 3. " "== 4. " "== 5. "; do grep -q "$chapter" "$work/tour.txt"; done
python3 - "$work/tour.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
chapter4 = text[text.index("== 4. "):text.index("== 5. ")]
chapter5 = text[text.index("== 5. "):]
# Chapter 4: each switch off in turn; without K/V reuse every streamed element is packed
# again (the model's raw count), with it fewer are.
sw = {m[0].strip(): (int(m[1]), int(m[2])) for m in
      re.findall(r"^  (all on|K/V packing reuse off|software prefetch off|deferred normalization off|Q-tile parallelism off)"
                 r" +(\d+) +(\d+) +[0-9.]+ +[0-9.]+$", chapter4, re.M)}
assert len(sw) == 5, chapter4
assert sw["K/V packing reuse off"][0] == sw["K/V packing reuse off"][1], sw
assert sw["all on"][0] < sw["all on"][1] and sw["software prefetch off"][0] < sw["software prefetch off"][1], sw
per_head = sw.pop("Q-tile parallelism off")
assert len({v[1] for v in sw.values()}) == 1, sw  # the same K/V streamed whatever else is switched
# One Q tile per head streams each key once per head: less than Q tiles of 64 rows do.
assert per_head[1] < sw["all on"][1], (per_head, sw)
# Chapter 4: the FP8 experiment's five RMSEs, each FP8 variant well above bf16's error.
rmse = {name: float(value) for name, value in
        re.findall(r"^   (bf16 attention|FP8 per \w+(?: \+ Hadamard)?)(?: \(\d+/\d+ rows\))? +([0-9.]+e[-+][0-9]+)$",
                   chapter4, re.M)}
assert len(rmse) == 5, rmse
assert all(v > 3 * rmse["bf16 attention"] for k, v in rmse.items() if k.startswith("FP8")), rmse
# Chapter 5: the CPU's rows of the cycle table, exact and poly3 exp2; poly3 moves the
# exponentials from the exp column to the FMA column.
cpu = {m[0]: [float(x) for x in m[1:]] for m in
       re.findall(r"^  cpu +forward +(plain|poly3 exp2 \(exp2=poly3\)) +(\S+) +(\S+) +(\S+) +(\S+)", chapter5, re.M)}
assert len(cpu) == 2, cpu
plain, poly = cpu["plain"], cpu["poly3 exp2 (exp2=poly3)"]
assert poly[1] == 0 and plain[1] > 0 and poly[2] > plain[2] and poly[0] == plain[0], cpu
# The model's per-clock rates of the two exp2s in the ratio of their instruction counts.
model = [float(x) for x in re.findall(r"^    (?:exact|poly3) +model +([0-9.]+) per clock", chapter5, re.M)]
assert len(model) == 2 and abs(model[1] / model[0] - 15 / 13) < 0.02, model
assert re.search(r"poly3 / exact: model 1\.15 \(15 against 13 vector instructions\), measured [0-9.]+", chapter5), chapter5
# Rescales counted by the kernel: on rows that climb 1.92 log2 units per tile the classic
# rule rescales at every tile after the first, the conditional one at most as often.
counts = {m[0]: [int(m[1]), int(m[2]), int(m[3]), int(m[4])] for m in
          re.findall(r"^   (random|adversarial) +rows (\d+), (\d+) key tiles: classic (\d+) .*conditional (\d+) ",
                     chapter5, re.M)}
assert set(counts) == {"random", "adversarial"}, counts
for name, (rows, tiles, classic, conditional) in counts.items():
    assert 0 <= conditional <= classic, (name, counts)
rows, tiles, classic, conditional = counts["adversarial"]
assert classic == rows * (tiles - 1), counts
PY
python3 - "$work/figures" <<'PY'
import os, sys, xml.etree.ElementTree as ET
names = sorted(os.listdir(sys.argv[1]))
assert names == ["gflops_vs_threads.svg", "memory_vs_n.svg", "traffic_vs_n.svg", "traffic_vs_tile.svg",
                 "unit_cycles_backward.svg", "unit_cycles_forward.svg"], names
for n in names:
    root = ET.parse(os.path.join(sys.argv[1], n)).getroot()
    assert root.tag.endswith("svg") and len(root) > 5, n
    texts = [t.text or "" for t in root.iter() if t.tag.endswith("text")]
    # Tick labels are the data's values, bytes in binary units: never 1.9e+07 or 588.1.
    assert not any("e+" in t or "e-" in t for t in texts), (n, texts)
    if n in ("traffic_vs_n.svg", "memory_vs_n.svg"):
        assert any(t.endswith("KiB") or t.endswith("MiB") for t in texts), (n, texts)
# The counted tiled traffic equals the model's: the legend says the lines coincide.
for n, note in [("traffic_vs_n.svg", "= tiled (model) (same line)"), ("traffic_vs_tile.svg", "= K+V model (same line)")]:
    root = ET.parse(os.path.join(sys.argv[1], n)).getroot()
    assert note in [t.text for t in root.iter() if t.tag.endswith("text")], n
PY
# Every figure rendered to PNG (rsvg-convert, Debian's librsvg2-bin): the canvas's size, and
# ink on it — text, axes and the data's colored lines or bars.
if ! command -v rsvg-convert > /dev/null; then
  echo "SKIPPED: the PNG check of the figures needs rsvg-convert (Debian package librsvg2-bin)" >&2
  exit 77
fi
for svg in "$work"/figures/*.svg; do rsvg-convert "$svg" -o "${svg%.svg}.png"; done
python3 - "$work"/figures/*.png <<'PY'
import struct, sys, zlib

def decode(path):  # 8-bit RGB(A) PNG -> (width, height, bytes per pixel, unfiltered rows)
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", data[pos + 8:pos + 8 + n])
        elif kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    w, h, depth, ctype = ihdr[:4]
    assert depth == 8 and ctype in (2, 6), (path, ihdr)
    bpp = 3 if ctype == 2 else 4
    raw, stride, prev, rows = zlib.decompress(idat), w * bpp, bytearray(w * bpp), []
    for r in range(h):
        f, line = raw[r * (stride + 1)], bytearray(raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows

for path in sys.argv[1:]:
    w, h, bpp, rows = decode(path)
    assert w == 720 and h >= 440, (path, w, h)
    px = [row[i:i + 3] for row in rows for i in range(0, len(row), bpp)]
    ink = sum(p != b"\xff\xff\xff" for p in px) / len(px)
    colored = sum(max(p) - min(p) > 60 for p in px) / len(px)
    assert 0.01 < ink < 0.6 and colored > 0.002, (path, ink, colored)
PY
