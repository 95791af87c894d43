#!/usr/bin/env bash
# `pip install .` from the repository root into a fresh virtual environment (it reuses the
# machine's numpy/ml_dtypes and build backend, so no network is needed), then one call.
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install -q --no-build-isolation "$src" \
  --config-settings=build-dir="$work/build" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
cd "$work"
"$work/venv/bin/python" - <<'PY'
import numpy as np
import flashattn
assert flashattn.__file__.startswith(__import__("sys").prefix), flashattn.__file__
q = np.random.default_rng(0).standard_normal((1, 5, 2, 8)).astype(np.float32)
out = flashattn.flash_attn_func(q, q, q, causal=True)
assert out.shape == (1, 5, 2, 8) and np.isfinite(out).all()
print("pip install .: ok,", flashattn.simd_target())
PY
