#!/usr/bin/env bash
# usage: lrsweep.sh STUDENT STEPS LR SEED VARIANT... ; outputs tagged by lr
cd "$(dirname "$0")"
student=$1; steps=$2; lr=$3; seed=$4; shift 4
for v in "$@"; do
  bash run_pilot.sh probe "$student" "$v" "$seed" "$steps" -S train.rollout.prompts_per_step=32 -S train.rollout.num_generations=4 \
    -S train.optim.lr=$lr -S train.optim.warmup_steps=5 > "sweep_${student}_${v}_lr${lr}_s${seed}_n${steps}.out" 2>&1
done
