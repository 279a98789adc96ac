#!/usr/bin/env bash
# Run the confirmatory study (issue 65) on the 2-core machine from a fresh clone: five SFT warm starts, the one
# teacher, 8 arms x 5 starts, the pooled report. README.md here is the design, committed before any cell ran.
#
# Each warm start is a DVC project of its own (this directory: start 1, the teacher and the report;
# ../confirm_{b,c,d,e}: starts 2-5, `_base: confirm` in their overrides.yaml). `dvc repro` in each runs its
# stages one after another; this runner runs the same commands J at a time:
#   1. each start's upstream stages with `dvc repro` (prepare, sft, eval_sft, rollout, replay, pairs; here also
#      teacher and eval_teacher), J starts at a time, this one first (its teacher gates the teacher arms);
#   2. every cell (`composer-plugins study train/eval`, exactly as dvc.yaml writes it), J at a time, arm by arm
#      over the five starts, rl_only and teacher_only (the control) first;
#   3. `dvc commit` of each start's cells into its dvc.lock, then this directory's report (pooled over the five).
# Every part's wall-clock time goes to logs/study.time, the children's CPU-seconds at its end.
#
#   J=2 bash run_study.sh           # from this directory, after `. ../../.venv/bin/activate`
set -euo pipefail
cd "$(dirname "$0")"
J="${J:-2}"
DIRS=(. ../confirm_b ../confirm_c ../confirm_d ../confirm_e)
mkdir -p logs
t0=$(date +%s)
lap() { echo "$1: $(($(date +%s) - t0)) s since the start ($(date -u +%H:%M:%S) UTC)" | tee -a logs/study.time; }
: > logs/study.time
printf '%s\n' "${DIRS[@]}" | xargs -P "$J" -I{} bash -c '
  cd "{}" && mkdir -p logs
  targets=(pairs eval_sft); [ "{}" = . ] && targets+=(eval_teacher)
  dvc repro "${targets[@]}" > logs/upstream.log 2>&1 && echo "upstream done: {} $(date -u +%H:%M:%S)"'
lap "upstream stages (five warm starts, the teacher)"
variants=$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["variants"])')
cells() {  # "dir variant seed", arm by arm over the starts
  local v d
  for v in $variants; do
    for d in "${DIRS[@]}"; do
      echo "$d $v $(cd "$d" && python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["seeds"])')"
    done
  done
}
# a cell whose log exists has been started (or run) before and is skipped: delete its log to run it again
cells | while read -r d v s; do [ -e "$d/logs/$v-s$s.log" ] || echo "$d $v $s"; done |
  xargs -P "$J" -L 1 bash -c '
    cd "$0"; [ -e "logs/$1-s$2.log" ] && exit 0
    composer-plugins study train --variant "$1" --seed "$2" > "logs/$1-s$2.log" 2>&1 &&
    composer-plugins study eval --variant "$1" --seed "$2" >> "logs/$1-s$2.log" 2>&1 &&
    echo "done $0 $1 s$2 $(date -u +%H:%M:%S)"'
lap "cells"
for d in ../confirm_b ../confirm_c ../confirm_d ../confirm_e .; do  # this directory last: its report pools the rest
  (
    cd "$d"
    targets=()
    read -r -a seeds <<< "$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["seeds"])')"
    for s in "${seeds[@]}"; do for v in $variants; do
      [ -e "evals/$v-s$s.json" ] && targets+=("train@$v-$s" "eval@$v-$s")
    done; done
    dvc commit -f "${targets[@]}" > logs/commit.log 2>&1
    if [ "$d" = . ]; then dvc repro --single-item report > logs/report.log 2>&1; fi
  )
done
lap "reports"
times >> logs/study.time # the CPU-seconds of this shell's children: user and system
