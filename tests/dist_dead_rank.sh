#!/usr/bin/env bash
# Runs dist_dead_rank on 3 ranks, twice: rank 1 killed mid-run, then rank 1 never entering
# the ring. Passes when ranks 0 and 2 both report a flashattn::Error about a dead or stalled
# peer each time (the second naming themselves), and nothing hung.
set -uo pipefail
mpirun=$1
program=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# run_case WHAT PATTERN [ARG]: the program on 3 ranks (ARG passed to it); ranks 0 and 2 must
# each print a line matching "^rank R: flashattn::Error: ring_forward: PATTERN", R substituted
# for @ in PATTERN. --enable-recovery: by default mpirun kills every rank as soon as one
# dies, and there would be no survivor left to check.
run_case() {
  local what=$1 pattern=$2 start=$SECONDS
  timeout 90 "$mpirun" --allow-run-as-root --oversubscribe --enable-recovery -np 3 "$program" "${@:3}" >"$log" 2>&1
  local status=$?
  cat "$log"
  if [ "$status" -eq 124 ]; then
    echo "FAIL ($what): the ring hung (killed after 90 s)"
    exit 1
  fi
  if grep -q "finished" "$log"; then
    echo "FAIL ($what): a rank finished although its peer stopped answering"
    exit 1
  fi
  for survivor in 0 2; do
    if ! grep -q "^rank $survivor: flashattn::Error: ring_forward: ${pattern//@/$survivor}" "$log"; then
      echo "FAIL ($what): rank $survivor did not report it as expected"
      exit 1
    fi
  done
  echo "PASS ($what): both survivors stopped with an error after $((SECONDS - start)) s"
}

run_case "a rank killed mid-run" ".*a peer is dead or stalled"
# Duplicating the communicator times out; each waiter names itself (rank r of 3), not rank 0 of 1.
run_case "a rank that never enters" "rank @ of 3 waited .* to enter the ring" absent
