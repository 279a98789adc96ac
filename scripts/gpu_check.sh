#!/usr/bin/env bash
# The GPU check, in at most 6 minutes on one H200 (every step under `timeout`): the fair benchmark first (the
# composed step against TRL's GRPOTrainer in steady state, every row, a phase split and a profile:
# benchmarks/bench_gpu.py), then the kernel benchmark against Liger and the `gpu` test tier. It writes
# results/gpu.json and results/gpu.md (with the device name) after every row of the fair benchmark and at the
# end, whatever step fails.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run       # anywhere: print every step's command, resolve its imports, and run
#                                             # the fair benchmark at tiny sizes on the CPU (seconds) into a
#                                             # temporary folder (DIR/dry-run with --out DIR)
#   bash scripts/gpu_check.sh --out DIR       # write DIR/gpu.json, DIR/gpu.md, DIR/gpu.d/ (default: results)
#
# It uses the machine's Python as it is (PYTHON, default python3; torch with CUDA must be there already): the
# project goes on PYTHONPATH (no install, torch untouched) and only the distributions that Python lacks are
# installed, --no-deps and offline, from the wheels `bash scripts/gpu_wheels.sh` downloaded beforehand
# (GPU_WHEELS, default .gpu_wheels) into a folder on PYTHONPATH (GPU_SITE, default .gpu_site).
# Step budgets in seconds (GPU_CHECK_<STEP>_S): SETUP 10, FAIR 230, KERNELS 60, TIER 60 (360 s; the report
# after it is bounded too). FAIR: 6 rows, one process each (start, model build, 1 warm-up step with the decode
# step's compilation, 5 timed steps; the full composition one more, profiled), each row at most 90 s; a row
# not started for lack of budget says so. GPU_CHECK_STEPS (default "setup fair kernels tier") runs a subset,
# e.g. GPU_CHECK_STEPS="setup fair" GPU_CHECK_FAIR_S=340 gives the fair benchmark the whole 6 minutes.
# GPU_CHECK_ALLOW_CPU=1 runs the steps without CUDA too (the tier then skips; the suite tests the script so).
# Documented in benchmarks/README.md ("GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu_wheels}
SITE=${GPU_SITE:-$ROOT/.gpu_site}
OUT=results
OUT_GIVEN=0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=${2:?--out needs a folder}; OUT_GIVEN=1; shift ;;
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
  case " ${GPU_CHECK_STEPS:-setup fair kernels tier} " in
    *" $name "*) ;;
    *) echo "[gpu_check] step $name: not in GPU_CHECK_STEPS, skipped"; return 0 ;;
  esac
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
run_step setup "${GPU_CHECK_SETUP_S:-10}" "$PY" "$ROOT/scripts/gpu_check.py" install --wheels "$WHEELS" --target "$SITE"
FAIR_S=${GPU_CHECK_FAIR_S:-230}
run_step fair "$FAIR_S" "$PY" -m benchmarks.bench_gpu --shape gpu-0.5b --steps 5 --warmup 1 \
  --budget-s $((FAIR_S - 10)) --row-timeout 90 --json "$D/fair.json" --report-dir "$OUT"
run_step kernels "${GPU_CHECK_KERNELS_S:-60}" "$PY" -m benchmarks.bench_losses --repeats 3 \
  --variants logprobs_materialised,logprobs_chunked,hint_distill_materialised,hint_distill_chunked,hint_distill_liger,hint_distill_chunked_topk100 \
  --out "$D/kernels.json"
run_step tier "${GPU_CHECK_TIER_S:-60}" "$PY" -m pytest "$ROOT/tests/gpu" -m gpu -q -rA -p no:cacheprovider \
  --timeout 45 --junitxml "$D/tier.xml"
if [ "$DRY" = 1 ]; then
  echo "[gpu_check] step report: $PY scripts/gpu_check.py report $OUT"
  echo "[gpu_check] imports of every step, in one process:"
  "$PY" "$ROOT/scripts/gpu_check.py" imports "${dry_steps[@]}" report --wheels "$WHEELS" || failed=1
  [ "$failed" = 0 ] && echo "[gpu_check] dry run: every step's imports resolve" || echo "[gpu_check] dry run: MISSING imports above"
  # the fair benchmark itself, at tiny sizes on the CPU: every row, the phase split and the profile
  if [ "$OUT_GIVEN" = 1 ]; then DRY_OUT="$OUT/dry-run"; else DRY_OUT=$(mktemp -d); fi
  mkdir -p "$DRY_OUT/gpu.d"
  echo "[gpu_check] dry run of the fair benchmark (cpu-tiny) into $DRY_OUT"
  COMPOSER_CACHE_DIR="$DRY_OUT/gpu.d/cache" timeout -k 10 "${GPU_CHECK_DRY_FAIR_S:-400}" "$PY" -m benchmarks.bench_gpu --shape cpu-tiny --steps 5 --warmup 1 \
    --json "$DRY_OUT/gpu.d/fair.json" --report-dir "$DRY_OUT" > "$DRY_OUT/gpu.d/fair.log" 2>&1 || failed=1
  tail -n 8 "$DRY_OUT/gpu.d/fair.log"
  [ "$failed" = 0 ] && echo "[gpu_check] dry run: the fair benchmark wrote $DRY_OUT/gpu.md" || echo "[gpu_check] dry run: FAILED (see $DRY_OUT/gpu.d/fair.log)"
  exit "$failed"
fi
timeout 60 "$PY" "$ROOT/scripts/gpu_check.py" report "$OUT" || failed=1
exit "$failed"
