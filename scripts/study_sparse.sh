#!/usr/bin/env bash
# The sparse-reward study of issue 16 (docs/results.md), run in its own directory so it never
# touches the default `dvc repro` outputs:  scripts/study_sparse.sh [WORKDIR] [SEEDS...]
# Stages are the ones of dvc.yaml (same commands), on params.yaml merged with params.sparse.yaml.
# Every variant of a seed starts from the same SFT model and sees the same task order.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-"$repo/study_sparse"}
shift || true
py=${PYTHON:-"$repo/.venv/bin/python"}
cp=("$py" -m composer_plugins.core.cli)
mkdir -p "$work" && cd "$work"
"$py" -c "from composer_plugins.pipeline.study import write_merged_params as w; \
w('$repo/params.yaml', '$repo/params.sparse.yaml', 'params.yaml')"
seeds=("$@")
if [ ${#seeds[@]} -eq 0 ]; then
  mapfile -t seeds < <("$py" -c "from composer_plugins.pipeline import study; \
print(*study.seeds(study.load_params('params.yaml')), sep='\n')")
fi
mapfile -t variants < <("$py" -c "from composer_plugins.pipeline import study; \
print(*study.variants(study.load_params('params.yaml')), sep='\n')")
env=gsm8k
[ -d data/tasks ] || "${cp[@]}" prepare --out data/tasks
[ -d models/sft/model ] || "${cp[@]}" sft -c params.yaml --section train output_dir=models/sft \
  data.train_path=data/tasks/$env/train.jsonl data.test_path=data/tasks/$env/test.jsonl \
  mlflow.tracking_uri=sqlite:///mlflow.db mlflow.experiment=composer-plugins-sparse mlflow.run_name=sft
[ -f evals/sft.json ] || "${cp[@]}" study eval --baseline --model models/sft/model --out evals/sft.json
[ -f data/traces.jsonl ] || "${cp[@]}" rollout --model models/sft/model --tasks data/tasks/$env/train.jsonl \
  --out data/traces.jsonl
if [ ! -f data/pairs.jsonl ]; then
  "${cp[@]}" study replay-config --out data/replay/config.yaml
  "${cp[@]}" replay run -c data/replay/config.yaml --no-progress
  "${cp[@]}" pairs --traces data/traces.jsonl --cache data/teacher_cache/cache.sqlite --out data/pairs.jsonl
fi
# the replay_oracle variant: the same cached teacher answers, the oracle's alone as the chosen side
[ -f data/pairs_oracle.jsonl ] || "${cp[@]}" pairs --traces data/traces.jsonl \
  --cache data/teacher_cache/cache.sqlite --out data/pairs_oracle.jsonl \
  -S pairs.k=1 -S 'replay.teachers=[{name: oracle, id: oracle}]'
for seed in "${seeds[@]}"; do
  for v in "${variants[@]}"; do
    [ -f "evals/$v-s$seed.json" ] && continue
    "${cp[@]}" study train --variant "$v" --seed "$seed" >/dev/null
    "${cp[@]}" study eval --variant "$v" --seed "$seed" >/dev/null
    echo "done $v-s$seed $(date -u +%H:%M:%S)"
  done
done
"${cp[@]}" report
"${cp[@]}" compare --paired --baseline-variant rl_only
