#!/usr/bin/env bash
# Pilot round 5's probe wrapper (../../README.md, "Pilot round 5"): run from studies/procedural/pilot/ with the
# project's venv active, models/ holding round 3's starts and teacher.
#   bash round5/go.sh TAG START VARIANT SEED STEPS [-S k=v ...]   -> TAG.out (its /usr/bin/time and eval lines)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=$1; shift
KEEP_PARAMS=1 nice -n 5 bash run_pilot.sh probe "$@" -S train.eval.every_n_steps=64 > "$tag.out" 2>&1
