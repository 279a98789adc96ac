#!/usr/bin/env bash
# pilot round 9: GRPO's levers from the fifth run's two starts, 96 steps, pilot seed 96, 200 pilot problems
set -euo pipefail
P=/work/main/studies/procedural/pilot
cd $P
bash run_pilot.sh base > /work/tmp/p9_base.log 2>&1
mkdir -p models
rm -rf models/s1000 models/s900
cp -r ../models/sft models/s1000
cp -r ../../procedural_b/models/sft models/s900
one() {  # TAG START lever-args...
  local tag=$1 start=$2; shift 2
  local d=/work/tmp/p9/$tag
  rm -rf $d; mkdir -p $d; cd $d
  ln -s $P/data data; ln -s $P/models models; cp $P/params.yaml params.yaml; cp $P/run_pilot.sh .
  KEEP_PARAMS=1 bash run_pilot.sh probe $start rl_only 96 96 "$@" > out.txt 2>&1
  echo "$tag: $(cat out.txt | tr '\n' ' ')"
}
export -f one; export P
printf '%s\n' \
  "A_r s1000" "B_r s900" \
  "A_g8 s1000 -S train.rollout.prompts_per_step=16 -S train.rollout.num_generations=8" \
  "B_g8 s900 -S train.rollout.prompts_per_step=16 -S train.rollout.num_generations=8" \
  "A_lr2 s1000 -S train.optim.lr=2.0e-4" "B_lr2 s900 -S train.optim.lr=2.0e-4" |
  xargs -P 2 -L 1 bash -c 'one "$@"' _
