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

# One line on what this machine allows, printed first: a run that fails
# for want of a thread or memory says so in its own log (CI's included).
limits() {
  local tasks pids_max="none" cg
  tasks=$(ls -d /proc/[0-9]*/task/* 2>/dev/null | wc -l)
  cg=$(awk -F: '$2 == "pids" {print $3}' /proc/self/cgroup 2>/dev/null)
  for f in "/sys/fs/cgroup/pids$cg/pids.max" "/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup 2>/dev/null)/pids.max"; do
    [[ -r "$f" ]] && pids_max=$(<"$f") && break
  done
  echo "== machine: $(nproc) cores, $(awk '/MemAvailable/ {printf "%.1f", $2 / 1048576}' /proc/meminfo) GiB available;" \
    "$tasks threads running; limits: ulimit -u $(ulimit -u), pid_max $(</proc/sys/kernel/pid_max)," \
    "threads-max $(</proc/sys/kernel/threads-max), cgroup pids.max $pids_max"
}

lane_own() {
  .venv/bin/python -m pytest -q && bash scripts/test_kernels.sh others
}

lane_hosts() {
  "$MAKE" --no-print-directory test-hosts
}

limits
if [[ "${LAYERLIFT_TEST_LANES:-2}" == 1 ]]; then
  lane_own && lane_hosts
  rc=$?
  ((rc == 0)) || limits
  exit "$rc"
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
((own == 0 && rc_hosts == 0)) && exit 0
limits
exit 1
