#!/usr/bin/env bash
# Pilot round 6's probe wrapper (../../README.md, "Pilot round 6"): round 5's, with the held-out curve every 32
# steps. Run from studies/procedural/pilot/ with the project's venv active, models/ holding the starts and teacher.
#   bash round6/go.sh TAG START VARIANT SEED STEPS [-S k=v ...]   -> TAG.out (its /usr/bin/time and eval lines)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=$1; shift
KEEP_PARAMS=1 nice -n 5 bash run_pilot.sh probe "$@" -S train.eval.every_n_steps=32 > "$tag.out" 2>&1
