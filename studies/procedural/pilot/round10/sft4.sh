#!/usr/bin/env bash
# Pilot round 10, second warm-start candidates near s1300_slip70's state (slip 0.7).   bash round10/sft4.sh   # from pilot/
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' "s1400_slip70 1400 sft.slip_rate=0.7" "s7_1400_slip70 1400 sft.seed=7 sft.slip_rate=0.7" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
