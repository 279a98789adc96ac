#!/usr/bin/env bash
# Pilot round 10, second warm-start candidates (slip 0.7), side by side.   bash round10/sft3.sh   # from pilot/
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' "s1250_slip70 1250 sft.slip_rate=0.7" "s7_1300_slip70 1300 sft.seed=7 sft.slip_rate=0.7" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
