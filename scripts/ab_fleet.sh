#!/usr/bin/env bash
# Paired A/B of the fleet replay: the same replay run alternately from two
# checkouts (default: a worktree of an older commit, and this one), so both
# see the same machine and the same background load.
#
#   git worktree add /tmp/ab_old cdc45ec
#   AB_TRACE=PATH scripts/ab_fleet.sh /tmp/ab_old /work/main 3 /tmp/ab_out   # 3 pairs
#   (AB_TRACE: the conversation trace file, for an old commit whose replay has
#   no bundled default)
#   scripts/ab_fleet.sh --summary /tmp/ab_out
#
# Each run (one process per policy; its CPU seconds are recorded): 8 instances, round-robin, the emulated 0.1 GB/s link, one store,
# the tiny preset, 200 requests of the conversation trace, barrier and
# overlap. The load average is recorded before and after each run.
# AB_REQUESTS (200) and AB_ARGS (more replay options for both sides, e.g.
# "--time-scale 50"); AB_ARGS_A / AB_ARGS_B: options for one side only, e.g.
# AB_ARGS_B="--host-costs off" when side A predates the replay's host costs
# (an A/B of the engine must run the same benchmark on both sides).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${AB_PYTHON:-$here/.venv/bin/python}"
if [[ "${1:-}" == "--summary" ]]; then
    exec "$py" "$here/scripts/ab_summary.py" "$2"
fi
a="${1:?usage: ab_fleet.sh ROOT_A ROOT_B PAIRS OUTDIR}"
b="${2:?}"; pairs="${3:-3}"; out="${4:-/tmp/ab_out}"
trace_args=()  # the replay's bundled conversation trace unless AB_TRACE names another
[[ -n "${AB_TRACE:-}" ]] && trace_args=(--trace "$AB_TRACE")
mkdir -p "$out"
run() {  # label root index policy
    local label="$1_$4_$3" root="$2" side_var="AB_ARGS_$1"
    local side_args="${!side_var:-}"
    echo "$label start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/log"
    (cd /tmp && timeout 1200 "$py" "$here/scripts/ab_run.py" "$root" bench replay \
        --instances 8 --router round-robin --policies "$4" \
        --links emulated:0.1,10 --preset tiny --requests "${AB_REQUESTS:-200}" \
        "${trace_args[@]}" --kl-samples 1 --json "$out/$label.json" ${AB_ARGS:-} $side_args) \
        >"$out/$label.txt" 2>&1 || echo "$label FAILED (see $out/$label.txt)" | tee -a "$out/log"
    echo "$label end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/log"
}
pair() {  # index: one side's barrier and overlap, then the other's
    run "$1" "$2" "$3" barrier; run "$1" "$2" "$3" overlap
}
for i in $(seq 1 "$pairs"); do
    if (( i % 2 )); then pair A "$a" "$i"; pair B "$b" "$i"; else pair B "$b" "$i"; pair A "$a" "$i"; fi
done
"$py" "$here/scripts/ab_summary.py" "$out"
