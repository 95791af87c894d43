#!/usr/bin/env bash
# Runs dist_dead_rank on 3 ranks; rank 1 is killed mid-run. Passes when ranks 0 and 2 both
# report a flashattn::Error about a dead or stalled peer, and nothing hung.
set -uo pipefail
mpirun=$1
program=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
# --enable-recovery: by default mpirun kills every rank as soon as one dies, and there would
# be no survivor left to check.
timeout 90 "$mpirun" --allow-run-as-root --oversubscribe --enable-recovery -np 3 "$program" >"$log" 2>&1
status=$?
elapsed=$((SECONDS - start))
cat "$log"
if [ "$status" -eq 124 ]; then
  echo "FAIL: the ring hung (killed after 90 s)"
  exit 1
fi
if grep -q "finished" "$log"; then
  echo "FAIL: a rank finished although its peer was killed mid-run"
  exit 1
fi
for survivor in 0 2; do
  if ! grep -q "^rank $survivor: flashattn::Error: ring_forward: .*a peer is dead or stalled" "$log"; then
    echo "FAIL: rank $survivor did not report the dead peer"
    exit 1
  fi
done
echo "PASS: both survivors stopped with an error after ${elapsed} s"
# Rank 1 never enters the ring: the others time out duplicating the communicator, each
# naming itself (rank r of 3), not rank 0 of 1.
timeout 90 "$mpirun" --allow-run-as-root --oversubscribe --enable-recovery -np 3 "$program" absent >"$log" 2>&1
status=$?
cat "$log"
if [ "$status" -eq 124 ]; then
  echo "FAIL: the ring hung waiting for the absent rank (killed after 90 s)"
  exit 1
fi
for survivor in 0 2; do
  if ! grep -q "^rank $survivor: flashattn::Error: ring_forward: rank $survivor of 3 waited .* to enter the ring" "$log"; then
    echo "FAIL: rank $survivor did not report, as rank $survivor of 3, the rank that never entered the ring"
    exit 1
  fi
done
echo "PASS: both stopped naming themselves when a rank never entered the ring"
