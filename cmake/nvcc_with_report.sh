#!/usr/bin/env bash
# nvcc_with_report.sh LOG NVCC ARGS...: runs nvcc, keeping its diagnostics (the `ptxas -v`
# report among them) in LOG; shows them and fails when nvcc fails.
set -uo pipefail
log=$1
shift
if ! "$@" 2>"$log"; then
  cat "$log" >&2
  exit 1
fi
grep -E "warning|error" "$log" >&2 || true
