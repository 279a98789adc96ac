#!/usr/bin/env bash
# Pilot round 10 (../../README.md): SFT warm starts trained on slipped demonstrations (sft.slip_rate), two at a time.
#   bash round10/sft.sh        # from pilot/
set -euo pipefail
cd "$(dirname "$0")/.."
printf '%s\n' \
  "s1000_slip70 1000 sft.slip_rate=0.7" \
  "s7_1000_slip70 1000 sft.seed=7 sft.slip_rate=0.7" \
  "s1000_slip50 1000 sft.slip_rate=0.5" \
  "s1200_slip70 1200 sft.slip_rate=0.7" |
  KEEP_PARAMS=1 xargs -P 2 -L 1 bash run_pilot.sh student
