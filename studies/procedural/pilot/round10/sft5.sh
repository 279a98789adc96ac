#!/usr/bin/env bash
# Pilot round 10, second warm-start candidates for s1300_slip70's state (slip 0.7).   bash round10/sft5.sh   # from pilot/
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' "s1350_slip70 1350 sft.slip_rate=0.7" "s1_1300_slip70 1300 sft.seed=1 sft.slip_rate=0.7" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
