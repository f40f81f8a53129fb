#!/usr/bin/env bash
# `make test`: the whole suite in two lanes side by side.
#
#   lane 1: LayerLift's own tests (the machine's kernels), then the
#           transformers architecture tests under the other kernel sets;
#   lane 2: each host's environment (built when missing), then its tests
#           (`make test-hosts`).
#
# The suite waits more than it computes (Mooncake masters and clients
# starting, bounded waits run out on purpose, hosts' imports): run one lane
# after the other it kept about half of two cores busy (24 min of wall time
# for 13 min of CPU). The lanes share nothing but the machine: every
# Mooncake master binds ports that were free as it started, every
# namespace host is named after its process. Lane 1 prints as it runs;
# lane 2 writes out/test/hosts.log, printed once both ended. Exits non-zero when either lane failed (its exit
# status is printed). LAYERLIFT_TEST_LANES=1 runs the lanes one after the
# other, printing as they go.
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE="${MAKE:-make}"

lane_own() {
  .venv/bin/python -m pytest -q && bash scripts/test_kernels.sh others
}

lane_hosts() {
  "$MAKE" --no-print-directory test-hosts
}

if [[ "${LAYERLIFT_TEST_LANES:-2}" == 1 ]]; then
  lane_own && lane_hosts
  exit
fi

mkdir -p out/test
log=out/test/hosts.log
trap 'kill 0' INT TERM
lane_hosts > "$log" 2>&1 &
hosts=$!
lane_own
own=$?
wait "$hosts"
rc_hosts=$?
echo "== the hosts' tests (lane 2, $log) =="
cat "$log"
echo "== make test: LayerLift's own tests and kernel sets exit $own, the hosts' tests exit $rc_hosts"
((own == 0 && rc_hosts == 0))
