#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds and runs the
# examples/ project against it with find_package(flashattn).
set -euo pipefail
build_dir=$1
examples_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$examples_dir" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/quickstart"
