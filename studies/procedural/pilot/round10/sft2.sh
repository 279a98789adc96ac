#!/usr/bin/env bash
# Pilot round 10, second pair of SFT starts (longer, slip 0.7), side by side.   bash round10/sft2.sh   # from pilot/
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' "s1300_slip70 1300 sft.slip_rate=0.7" "s1500_slip70 1500 sft.slip_rate=0.7" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
