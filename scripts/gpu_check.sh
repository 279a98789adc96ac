#!/usr/bin/env bash
# The GPU check: the `gpu` test tier, the kernel benchmark against Liger and bench_scale's GPU half (ours vs TRL's
# GRPOTrainer at the Qwen2.5-0.5B and 1.5B shapes), on one CUDA machine, in at most 9.5 minutes (every step under
# `timeout`); writes results/gpu.json and results/gpu.md (with the device name) whatever step fails.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run       # anywhere: print every step's command and resolve its imports
#   bash scripts/gpu_check.sh --out DIR       # write DIR/gpu.json, DIR/gpu.md, DIR/gpu.d/ (default: results)
#
# It uses the machine's Python as it is (PYTHON, default python3; torch with CUDA must be there already): the
# project goes on PYTHONPATH (no install, torch untouched) and only the distributions that Python lacks are
# installed, --no-deps and offline, from the wheels `bash scripts/gpu_wheels.sh` downloaded beforehand
# (GPU_WHEELS, default .gpu_wheels) into a folder on PYTHONPATH (GPU_SITE, default .gpu_site).
# Step budgets in seconds (GPU_CHECK_<STEP>_S): SETUP 20, TIER 190, KERNELS 75, SCALE05 170, SCALE15 100 (555 s;
# sized on one H200, 2026-11-27: a 0.5B configuration takes 40-55 s with its model build, the 1.5B ones more).
# GPU_CHECK_ALLOW_CPU=1 runs the steps without CUDA too (the tier then skips; the suite tests the script so).
# Documented in benchmarks/README.md ("GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu_wheels}
SITE=${GPU_SITE:-$ROOT/.gpu_site}
OUT=results
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$1' (valid: --dry-run, --out DIR, --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
D="$OUT/gpu.d"

export PYTHONPATH="$ROOT:$ROOT/packages/composer-plugins-trl:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export COMPOSER_PLUGINS_LOAD=""          # the built-in plugins only, whatever else is installed
export COMPOSER_CACHE_DIR="$D/cache"     # tiny tokenizer/model builds of this run
export PYTHONDONTWRITEBYTECODE=1

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check.sh: no Python '$PY' (set PYTHON=/path/to/python)" >&2
  exit 2
fi
if [ "$DRY" = 0 ]; then
  if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: no CUDA device for $PY (torch.cuda.is_available() is False); run --dry-run here" >&2
    exit 2
  fi
  rm -rf "$D" "$OUT/gpu.json" "$OUT/gpu.md"
  mkdir -p "$D"
  git -C "$ROOT" rev-parse --short HEAD > "$D/commit.txt" 2>/dev/null || rm -f "$D/commit.txt"
fi

failed=0
dry_steps=()
# run_step NAME BUDGET_S COMMAND...: bounded by `timeout`; output to gpu.d/NAME.log; one line in gpu.d/steps.jsonl
run_step() {
  local name=$1 budget=$2
  shift 2
  echo "[gpu_check] step $name (timeout ${budget}s): $*"
  if [ "$DRY" = 1 ]; then
    dry_steps+=("$name")
    return 0
  fi
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout -k 10 "$budget" "$@" > "$D/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  [ "$rc" = 0 ] || failed=1
  "$PY" - "$name" "$rc" "$t0" "$t1" "$budget" "$*" >> "$D/steps.jsonl" <<'EOF'
import json, sys
name, rc, t0, t1, budget, cmd = sys.argv[1:]
print(json.dumps({"step": name, "rc": int(rc), "seconds": round(float(t1) - float(t0), 1), "budget_s": int(budget),
                  "timed_out": int(rc) in (124, 137), "command": cmd}))
EOF
  echo "[gpu_check]   -> exit $rc in $(awk "BEGIN {printf \"%.0f\", $t1 - $t0}") s (log: $D/$name.log)"
}

if [ "$DRY" = 1 ]; then
  echo "[gpu_check] dry run: $PY ($("$PY" -c 'import platform; print(platform.python_version())')), wheels $WHEELS"
  "$PY" "$ROOT/scripts/gpu_check.py" install --wheels "$WHEELS" --target "$SITE" --dry-run || failed=1
fi
run_step setup "${GPU_CHECK_SETUP_S:-20}" "$PY" "$ROOT/scripts/gpu_check.py" install --wheels "$WHEELS" --target "$SITE"
run_step tier "${GPU_CHECK_TIER_S:-190}" "$PY" -m pytest "$ROOT/tests/gpu" -m gpu -q -rA -p no:cacheprovider \
  --timeout 150 --junitxml "$D/tier.xml"
run_step kernels "${GPU_CHECK_KERNELS_S:-75}" "$PY" -m benchmarks.bench_losses --repeats 5 \
  --variants logprobs_materialised,logprobs_chunked,hint_distill_materialised,hint_distill_chunked,hint_distill_liger,hint_distill_chunked_topk100 \
  --out "$D/kernels.json"
run_step scale-0.5b "${GPU_CHECK_SCALE05_S:-170}" "$PY" -m benchmarks.bench_scale --quick --shapes gpu-0.5b \
  --variants grpo,grpo+hint+replay,trl_grpo --hint-all --hint-distill teacher=ema --hint-distill topk=100 \
  --config-timeout 90 --json "$D/scale-0.5b.json"
run_step scale-1.5b "${GPU_CHECK_SCALE15_S:-100}" "$PY" -m benchmarks.bench_scale --quick --shapes gpu-1.5b \
  --variants grpo+hint+replay,trl_grpo --hint-all --hint-distill teacher=ema --hint-distill topk=100 \
  --config-timeout 90 --json "$D/scale-1.5b.json"
if [ "$DRY" = 1 ]; then
  echo "[gpu_check] step report: $PY scripts/gpu_check.py report $OUT"
  echo "[gpu_check] imports of every step, in one process:"
  "$PY" "$ROOT/scripts/gpu_check.py" imports "${dry_steps[@]}" report --wheels "$WHEELS" || failed=1
  [ "$failed" = 0 ] && echo "[gpu_check] dry run: every step's imports resolve" || echo "[gpu_check] dry run: MISSING imports above"
  exit "$failed"
fi
timeout 60 "$PY" "$ROOT/scripts/gpu_check.py" report "$OUT" || failed=1
exit "$failed"
