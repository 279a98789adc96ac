#!/usr/bin/env bash
# Pilot round 6's SFT wrapper: run from studies/procedural/pilot/ with the project's venv active.
#   bash round6/stu.sh TAG NAME STEPS [k=v ...]   -> models/NAME, evals/NAME.json, TAG.out
set -euo pipefail
cd "$(dirname "$0")/.."
tag=$1; shift
KEEP_PARAMS=1 nice -n 5 bash run_pilot.sh student "$@" > "$tag.out" 2>&1
