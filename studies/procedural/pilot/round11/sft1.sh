#!/usr/bin/env bash
# Pilot round 11: warm starts in A's state (columns wrong > slipped) at a lower slip rate.   bash round11/sft1.sh   # from pilot/
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' "s1300_slip50 1300 sft.slip_rate=0.5" "s1300_slip60 1300 sft.slip_rate=0.6" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
