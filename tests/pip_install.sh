#!/usr/bin/env bash
# `pip wheel .` from the repository root, the wheel installed into a fresh virtual environment
# (it reuses the machine's numpy/ml_dtypes and build backend, so no network is needed), then
# imported and called where the system's libhwy cannot be loaded: the wheel must carry what
# it needs. Usage: pip_install.sh SOURCE_DIR [BUILD_DIR]; a BUILD_DIR kept between runs makes
# the wheel's build incremental (and ccache, when installed, serves its first one).
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
build=${2:-$work/build}
settings=(--config-settings=build-dir="$build")
if command -v ccache >/dev/null; then
  # The project's compiler cache (scripts/setup's), its paths relative to the source tree: a
  # clean clone anywhere hits what an earlier clone compiled (with ccache's own defaults every
  # clone's absolute paths missed, and the wheel's build took 6 minutes of CTest's time).
  export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/flashattn-ccache} CCACHE_BASEDIR=$(cd "$src" && pwd -P)
  settings+=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
             --config-settings=cmake.define.CMAKE_C_COMPILER_LAUNCHER=ccache)
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
python3 -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" "$src" "${settings[@]}" \
  >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
wheel=$(ls "$work"/dist/flashattn-*.whl)
python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install -q --no-deps --no-index "$wheel" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }

cat >"$work/check.py" <<'PY'
import ctypes
import os
import sys
import zipfile

import numpy as np

wheel, mode, hidden = sys.argv[1], sys.argv[2], sys.argv[3:]
carried = [n for n in zipfile.ZipFile(wheel).namelist() if os.path.basename(n).startswith("libhwy.so")]
assert carried, f"{wheel} carries no libhwy"
for path in hidden:  # the system's copies really are unloadable here
    try:
        ctypes.CDLL(path)
    except OSError:
        continue
    raise AssertionError(f"{path} still loads: the system's libhwy is not hidden")

import flashattn  # noqa: E402

pkg = os.path.dirname(os.path.realpath(flashattn.__file__))
assert pkg.startswith(os.path.realpath(sys.prefix)), pkg
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 5, 2, 8)).astype(np.float32) for _ in range(3))
out = flashattn.flash_attn_func(q, k, v, causal=True)
s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(8) + np.triu(np.full((5, 5), -np.inf), 1)
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)
assert np.abs(out - ref).max() < 1e-5, np.abs(out - ref).max()
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libhwy" in line}
assert mapped and all(os.path.dirname(os.path.realpath(m)) == pkg for m in mapped), mapped
print(f"pip wheel .: ok ({mode}), {os.path.basename(wheel)}, libhwy from the wheel, simd {flashattn.simd_target()}")
PY

cd "$work"
# The system's libhwy files, hidden behind /dev/null in a private mount namespace.
mapfile -t system_hwy < <(ldconfig -p | awk '/libhwy\.so/ {print $NF}' | xargs -r -n1 readlink -f | sort -u)
if [ ${#system_hwy[@]} -gt 0 ] && unshare --user --map-root-user --mount true 2>/dev/null; then
  unshare --user --map-root-user --mount bash -c \
    'for f in "${@:5}"; do mount --bind /dev/null "$f"; done; exec env -u LD_LIBRARY_PATH "$@"' \
    _ "$work/venv/bin/python" "$work/check.py" "$wheel" "system libhwy hidden" "${system_hwy[@]}" \
    || exit 1
else
  echo "pip_install: no system libhwy to hide, or no user namespaces here to hide it in:" \
       "checking only that the process loads the wheel's own libhwy"
  env -u LD_LIBRARY_PATH "$work/venv/bin/python" "$work/check.py" "$wheel" "system libhwy visible"
fi
