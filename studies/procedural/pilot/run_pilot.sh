#!/usr/bin/env bash
# The procedural study's pilot (issue 49; ../README.md): its own problems (pilot_tasks.py) and seeds (90+).
#
#   bash run_pilot.sh base                        # tasks: the study's train rows, 200 pilot problems
#   bash run_pilot.sh student NAME STEPS [k=v...] # SFT STEPS steps (+ train overrides) -> models/NAME, evals/NAME.json
#                                                 # (greedy accuracy and pass@8 on the pilot problems)
#   bash run_pilot.sh probe STUDENT VARIANT SEED STEPS [-S k=v ...]   # one RL cell from models/STUDENT, timed
#                                                 # (CPU-s per step for the study's projection) -> runs/, evals/
set -euo pipefail
cd "$(dirname "$0")"
T=data/tasks/gsm8k
[ -n "${KEEP_PARAMS:-}" ] || cp ../params.yaml params.yaml
case "${1:-}" in
base)
  composer-plugins prepare --out data/tasks
  python pilot_tasks.py $T
  ;;
student)
  name="$2"; steps="$3"; shift 3
  mkdir -p logs evals
  /usr/bin/time -f "sft $name: %e s wall, %U+%S CPU-s" composer-plugins sft -c params.yaml --section train \
    data.train_path=$T/train.jsonl data.test_path=$T/test.jsonl output_dir="models/$name" sft.steps="$steps" "$@" \
    > "logs/$name.log" 2>&1
  sets=(); for kv in "$@"; do sets+=(-S "train.$kv"); done
  /usr/bin/time -f "eval $name: %e s wall, %U+%S CPU-s" composer-plugins study eval --baseline \
    --model "models/$name/model" --out "evals/$name.json" -S eval.envs.gsm8k.k=8 -S eval.envs.gsm8k.num_samples=8 \
    -S eval.envs.gsm8k.num_problems=200 "${sets[@]}" >> "logs/$name.log" 2>&1
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {k: v for k, v in d.items() if 'gsm8k' in k and not isinstance(v, (list, dict, str))})" "evals/$name.json"
  ;;
probe)
  student="$2"; variant="$3"; seed="$4"; steps="$5"; shift 5
  mkdir -p logs evals
  /usr/bin/time -f "train $variant-s$seed ($steps steps): %e s wall, %U+%S CPU-s" composer-plugins study train \
    --variant "$variant" --seed "$seed" --pairs "" --model "models/$student/model" -S train.trainer.max_steps="$steps" \
    "$@" > "logs/$variant-s$seed.log" 2>&1
  /usr/bin/time -f "eval $variant-s$seed: %e s wall, %U+%S CPU-s" composer-plugins study eval --variant "$variant" \
    --seed "$seed" -S eval.envs.gsm8k.num_problems=200 "$@" >> "logs/$variant-s$seed.log" 2>&1
  grep -E "CPU-s|eval@" "logs/$variant-s$seed.log"
  ;;
*) echo "usage: bash run_pilot.sh base | student NAME STEPS [key=value ...]" >&2; exit 2 ;;
esac
