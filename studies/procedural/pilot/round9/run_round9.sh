#!/usr/bin/env bash
# Pilot round 9 (../../README.md): GRPO's levers from the study's two SFT starts, rl_only x 96 steps, pilot seed 96,
# greedy on the 200 pilot problems. Run after the study's upstream stages (it copies their SFT models):
#   bash pilot/round9/run_round9.sh        # from studies/procedural
# Each probe runs in its own scratch directory under pilot/runs/round9/ (ignored by git), two at a time.
set -euo pipefail
P="$(cd "$(dirname "$0")/.." && pwd)"
cd "$P"
mkdir -p logs models
bash run_pilot.sh base > logs/round9_base.log 2>&1
rm -rf models/s1000 models/s900
cp -r ../models/sft models/s1000
cp -r ../../procedural_b/models/sft models/s900
one() {  # TAG START [-S key=value ...]
  local tag=$1 start=$2 d="$P/runs/round9/$1"
  shift 2
  rm -rf "$d"; mkdir -p "$d"; cd "$d"
  ln -s "$P/data" data; ln -s "$P/models" models; cp "$P/params.yaml" "$P/run_pilot.sh" .
  KEEP_PARAMS=1 bash run_pilot.sh probe "$start" rl_only 96 96 "$@" > out.txt 2>&1
  echo "$tag: $(tr '\n' ' ' < out.txt)"
}
export -f one; export P
printf '%s\n' \
  "A_r s1000" "B_r s900" \
  "A_g8 s1000 -S train.rollout.prompts_per_step=16 -S train.rollout.num_generations=8" \
  "B_g8 s900 -S train.rollout.prompts_per_step=16 -S train.rollout.num_generations=8" \
  "A_lr2 s1000 -S train.optim.lr=2.0e-4" "B_lr2 s900 -S train.optim.lr=2.0e-4" |
  xargs -P 2 -L 1 bash -c 'one "$@"' _
