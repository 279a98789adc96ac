#!/usr/bin/env bash
# The positive-control pilot (issue 39; README.md here). From studies/pilot/:
#
#   bash run_pilot.sh base                      # tasks (pilot problems), student SFT (400 steps), teacher SFT, their evals
#   bash run_pilot.sh student NAME STEPS        # another student warm start: SFT STEPS steps -> models/NAME, evals/NAME.json
#   bash run_pilot.sh setting NAME [-S k=v ...] # the three arms x study.seeds at one shared setting -> settings/NAME/
#                                               # (ARMS="rl_only" runs a subset of the arms, SEEDS="90" of the
#                                               # seeds, J=1 one cell at a time,
#                                               # STUDENT=sft300 starts from models/sft300 instead of models/sft)
#
# A setting's cells run J at a time (default 2: the machine is shared); each writes
# settings/NAME/evals/<arm>-s<seed>.json (final held-out accuracy on the pilot problems) and
# settings/NAME/runs/<arm>-s<seed>/history.csv; `summary.py` tabulates every setting against the pass bar.
set -euo pipefail
cd "$(dirname "$0")"
J="${J:-2}"
TEACHER_STEPS="${TEACHER_STEPS:-1600}"
STUDENT="${STUDENT:-sft}"
T=data/tasks/gsm8k
SFT=(composer-plugins sft -c params.yaml --section train data.train_path=$T/train.jsonl data.test_path=$T/test.jsonl
     mlflow.enabled=false)

case "${1:-}" in
base)
  mkdir -p logs evals
  composer-plugins prepare --out data/tasks
  python pilot_tasks.py $T
  "${SFT[@]}" output_dir=models/sft > logs/sft.log 2>&1 &
  "${SFT[@]}" output_dir=models/teacher sft.steps="$TEACHER_STEPS" > logs/teacher.log 2>&1 &
  wait
  composer-plugins study eval --baseline --model models/sft/model --out evals/sft.json
  composer-plugins study eval --baseline --model models/teacher/model --out evals/teacher.json
  ;;
student)
  name="$2"; steps="$3"
  mkdir -p logs evals
  "${SFT[@]}" output_dir="models/$name" sft.steps="$steps" > "logs/$name.log" 2>&1
  composer-plugins study eval --baseline --model "models/$name/model" --out "evals/$name.json"
  ;;
setting)
  name="$2"; shift 2
  d="settings/$name"
  mkdir -p "$d/logs"
  ln -sfn ../../models "$d/models"; ln -sfn ../../data "$d/data"
  cp params.yaml "$d/params.yaml"
  printf '%s\n' "$@" > "$d/overrides.txt"
  [ "$STUDENT" = sft ] || echo "$STUDENT" > "$d/student.txt"  # summary.py: rl_only - SFT against evals/$STUDENT.json
  seeds="${SEEDS:-$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["seeds"])')}"
  arms="${ARMS:-$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["variants"])')}"
  cd "$d"
  export OVR="$*" NAME="$name" STUDENT  # overrides hold no spaces (-S key=value ...)
  for s in $seeds; do for v in $arms; do echo "$v $s"; done; done |
    xargs -P "$J" -L 1 bash -c '
      [ -e "evals/$0-s$1.json" ] && exit 0
      composer-plugins study train --variant "$0" --seed "$1" --pairs "" --model "models/$STUDENT/model" $OVR > "logs/$0-s$1.log" 2>&1 &&
      composer-plugins study eval --variant "$0" --seed "$1" $OVR >> "logs/$0-s$1.log" 2>&1 &&
      echo "done $NAME $0 s$1 $(date -u +%H:%M:%S)"'
  ;;
*)
  echo "usage: bash run_pilot.sh base | student NAME STEPS | setting NAME [-S key=value ...]" >&2; exit 2 ;;
esac
