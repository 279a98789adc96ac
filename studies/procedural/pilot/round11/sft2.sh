#!/usr/bin/env bash
# Pilot round 11, second pair: A's length (1,300 steps, seed 0) at the slip rates beside A's 0.7.   bash round11/sft2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' "s1300_slip65 1300 sft.slip_rate=0.65" "s1300_slip75 1300 sft.slip_rate=0.75" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
