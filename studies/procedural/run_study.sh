#!/usr/bin/env bash
# Run the procedural study (issue 49) on a shared 2-core machine: both SFT warm starts, every cell, both reports.
#
# Each warm start is a DVC study of its own (this directory and ../procedural_b; each one's SFT seed and length and
# its RL seeds are in its overrides.yaml). `dvc repro` in each runs the same stages one after another (the reproducible command); this
# runner is how the committed results were produced (README.md here, docs/results.md):
#   1. the upstream stages of both warm starts side by side, one core each (prepare, sft, teacher, eval_teacher,
#      eval_sft, rollout, replay, pairs), with `dvc repro`;
#   2. the gap predictor (`composer-plugins study gap`: results/gap.json, before any RL), then
#      every `composer-plugins study train/eval` cell exactly as dvc.yaml writes it, J at a time, seed by seed
#      alternating the warm starts, so whatever has finished at a deadline is complete, paired seeds;
#   3. `dvc commit` of the finished cells into each dvc.lock, then the reports: ../procedural_b's (its warm start
#      alone), then this one's, which pools both (`study.warm_starts`).
# Every part's wall-clock time and the whole run's CPU-seconds go to logs/study.time. FORCE=1 reruns the
# upstream stages even where DVC finds nothing changed; the `sft` and `teacher` stages still reuse a model that
# the project's cache (.composer_cache/ in each directory) holds for the same settings, so a run timed from
# scratch moves .composer_cache/ and models/ away first (the third run did, README.md).
#
#   J=2 [FORCE=1] bash run_study.sh
set -euo pipefail
cd "$(dirname "$0")"
J="${J:-2}"
DIRS=(. ../procedural_b)
mkdir -p logs
t0=$(date +%s)
lap() { echo "$1: $(($(date +%s) - t0)) s since the start ($(date -u +%H:%M:%S) UTC)" | tee -a logs/study.time; }
: > logs/study.time
for d in "${DIRS[@]}"; do
  (cd "$d" && mkdir -p logs && dvc repro ${FORCE:+--force} pairs eval_sft eval_teacher > logs/upstream.log 2>&1) &
done
wait
lap "upstream stages (both warm starts)"
# the gap predictor (before RL, this warm start's SFT policy): results/gap.json, listed beside each effect
composer-plugins study gap > logs/gap.log 2>&1
lap "gap predictor"
cells() {  # "dir variant seed", seed by seed, the two warm starts alternating
  local n i d
  n=$(python -c 'import yaml; print(len(yaml.safe_load(open("params.yaml"))["study"]["seeds"]))')
  for ((i = 0; i < n; i++)); do
    for d in "${DIRS[@]}"; do
      (cd "$d" && python -c '
import sys, yaml
p = yaml.safe_load(open("params.yaml"))["study"]
s = p["seeds"][int(sys.argv[1])]
print("\n".join(f"{sys.argv[2]} {v} {s}" for v in p["variants"]))' "$i" "$d")
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
for d in ../procedural_b .; do  # this directory last: its report pools ../procedural_b's cells
  (
    cd "$d"
    targets=() # the cells that finished (a run stopped at a deadline leaves the rest out of dvc.lock)
    read -r -a seeds <<< "$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["seeds"])')"
    read -r -a variants <<< "$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["variants"])')"
    for s in "${seeds[@]}"; do for v in "${variants[@]}"; do
      [ -e "evals/$v-s$s.json" ] && targets+=("train@$v-$s" "eval@$v-$s")
    done; done
    dvc commit -f "${targets[@]}" > logs/commit.log 2>&1
    dvc repro --single-item report > logs/report.log 2>&1
  )
done
lap "reports"
times >> logs/study.time # the CPU-seconds of this shell's children: user and system
