#!/usr/bin/env bash
# Pilot round 11 (../../README.md; round10/probes.sh with its scratch under runs/round11/): rl_only and teacher_only, 96 steps at the fifth run's settings, from the slipped
# SFT starts of round10/sft.sh, pilot seed 97, greedy on the 200 pilot problems. The teacher is the fifth run's
# A teacher (../models/teacher, 0.9925 on the study problems), copied to models/teacher.
#   bash round10/probes.sh START [START ...]      # from pilot/, after round10/sft.sh
# Each probe runs in its own scratch directory under runs/round11/ (ignored by git), two at a time.
set -euo pipefail
P="$(cd "$(dirname "$0")/.." && pwd)"
cd "$P"
[ -d models/teacher ] || cp -r ../models/teacher models/teacher
one() {  # START VARIANT [-S key=value ...]
  local start=$1 variant=$2 d="$P/runs/round11/$1-$2-s${PSEED:-97}"
  shift 2
  rm -rf "$d"; mkdir -p "$d"; cd "$d"
  ln -s "$P/data" data; ln -s "$P/models" models; cp "$P/params.yaml" "$P/run_pilot.sh" .
  KEEP_PARAMS=1 bash run_pilot.sh probe "$start" "$variant" ${PSEED:-97} 96 "$@" > out.txt 2>&1 || true
  echo "$start $variant: $(tr '\n' ' ' < out.txt)"
}
export -f one; export P PSEED
for s in "$@"; do printf '%s rl_only\n%s teacher_only\n' "$s" "$s"; done | xargs -P 2 -L 1 bash -c 'one "$@"' _
