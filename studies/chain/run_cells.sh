#!/usr/bin/env bash
# Run the chain study's train + eval cells J at a time, seed by seed, then record them in dvc.lock and report.
#
# `dvc repro` runs the same stages one after another (the reproducible command); on a shared 2-core machine
# this runner is how the committed results were produced (docs/results.md): the upstream stages first
# (prepare, sft, eval_sft, rollout, replay, pairs) with `dvc repro pairs eval_sft`, then every
# `composer-plugins study train/eval` cell exactly as dvc.yaml writes it, all variants of seed 0 first,
# then seed 1, ..., so whatever has finished at a deadline is complete, paired seeds; `dvc commit` writes
# the cells' hashes into dvc.lock and `dvc repro report` builds results/, metrics.json and plots/.
#
#   J=3 SEEDS="0 1 2 3 4 5 6 7 8 9" bash run_cells.sh
set -euo pipefail
cd "$(dirname "$0")"
J="${J:-3}"
SEEDS="${SEEDS:-$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["seeds"])')}"
VARIANTS="$(python -c 'import yaml; print(*yaml.safe_load(open("params.yaml"))["study"]["variants"])')"
mkdir -p logs
dvc repro pairs eval_sft
# a cell whose log exists has been started (or run) before and is skipped: delete its log to run it again
for s in $SEEDS; do for v in $VARIANTS; do [ -e "logs/$v-s$s.log" ] || echo "$v $s"; done; done |
  xargs -P "$J" -L 1 bash -c '
    [ -e "logs/$0-s$1.log" ] && exit 0
    composer-plugins study train --variant "$0" --seed "$1" > "logs/$0-s$1.log" 2>&1 &&
    composer-plugins study eval --variant "$0" --seed "$1" >> "logs/$0-s$1.log" 2>&1 &&
    echo "done $0 s$1 $(date -u +%H:%M:%S)"'
targets=()  # the cells that finished (a run stopped at a deadline leaves the rest out of dvc.lock)
for s in $SEEDS; do for v in $VARIANTS; do
  [ -e "evals/$v-s$s.json" ] && targets+=("train@$v-$s" "eval@$v-$s")
done; done
dvc commit -f "${targets[@]}"
dvc repro --single-item report
