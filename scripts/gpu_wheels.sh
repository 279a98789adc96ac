#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh may install on the GPU machine (which has no network) into .gpu_wheels/
# (ignored by git): every pin of scripts/gpu_wheels.txt, --no-deps, binary only, for CPython 3.12 on
# manylinux x86_64, whatever Python runs this. Run it here, before the tree travels to the GPU machine.
#
#   bash scripts/gpu_wheels.sh                      # all of scripts/gpu_wheels.txt
#   bash scripts/gpu_wheels.sh --skip pyarrow,pandas   # leave out what the GPU machine has (see its --dry-run)
#
# The tree that travels to the GPU machine may hold 64 MiB in all, and the wheels take 70 MiB as downloaded
# (pyarrow alone 48 MiB): every wheel over 8 MiB is recompressed with LZMA (zip method 14, which pip reads;
# the files and their RECORD hashes are unchanged), ~1.5 CPU minutes, 70 -> 55 MiB; --no-lzma keeps them as
# they are. The script prints the folder's size and warns past GPU_WHEELS_BUDGET_MIB (default 58).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS:-.gpu_wheels}
PY=${PYTHON:-python3}
SKIP=","
LZMA=1
while [ $# -gt 0 ]; do
  case "$1" in
    --skip) SKIP=",${2:?--skip needs a comma-separated list},"; shift ;;
    --dest) DEST=${2:?--dest needs a folder}; shift ;;
    --no-lzma) LZMA=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown option '$1' (valid: --skip a,b, --dest DIR, --no-lzma, --help)" >&2; exit 2 ;;
  esac
  shift
done
reqs=()
while read -r line; do
  line=${line%%#*}
  line=$(echo "$line" | tr -d '[:space:]')
  [ -n "$line" ] || continue
  name=${line%%=*}
  case "$SKIP" in *",$name,"*) echo "skip $name"; continue ;; esac
  file=$(echo "$name" | tr 'A-Z.-' 'a-z__')-${line##*==}-
  if compgen -G "$DEST/$file*.whl" > /dev/null; then continue; fi  # downloaded (and repacked) before
  reqs+=("$line")
done < scripts/gpu_wheels.txt
mkdir -p "$DEST"
[ "${#reqs[@]}" = 0 ] || "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${reqs[@]}" 2> >(grep -v "^WARNING: Location" >&2)
if [ "$LZMA" = 1 ]; then
  "$PY" scripts/gpu_check.py repack "$DEST" --min-mib 8
fi
ls -1 "$DEST"/*.whl
mib=$(du -sm "$DEST" | cut -f1)
echo "$(ls -1 "$DEST"/*.whl | wc -l) wheels, ${mib} MiB in $DEST"
if [ "$mib" -gt "${GPU_WHEELS_BUDGET_MIB:-58}" ]; then
  echo "WARNING: ${mib} MiB with the tree is more than the 64 MiB that travels to the GPU machine: run" \
       "gpu_check.sh --dry-run there once and --skip what it has (e.g. --skip pyarrow,pandas)" >&2
fi
