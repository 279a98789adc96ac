#!/usr/bin/env bash
# The core's tests beside the newest transformers and lightning releases, in an environment of their own
# (results/compat.md holds the last result). Not part of .ci/run: the install and the tests take longer
# than CI's budget leaves.
#   bash scripts/compat_newest.sh              # venv in ../venv-newest (VENV=... to choose), tests below
# Only torch is pinned (the CPU wheel, as constraints.txt); no backend package (verl, trl, monarch) is
# installed, so the test files that compare against TRL are left out, and so are tests/backends, tests/diloco
# (torchft), tests/pipeline (dvc) and tests/gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-../venv-newest}"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install -q -U pip setuptools wheel
echo "torch==2.13.0" >"$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" -U -e . pytest pytest-timeout transformers lightning
"$VENV/bin/python" -m pip install -q --no-deps -e ./examples/composer-plugins-focal -e ./examples/composer-plugins-reverse
"$VENV/bin/python" -m pip check
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|lightning|tokenizers|huggingface.hub) '
env -u PYTHONPATH HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts=-ra \
  tests/core tests/kernels tests/losses tests/procs tests/teachers tests/testing tests/training tests/envs \
  --ignore tests/losses/test_losses_distill.py --ignore tests/losses/test_losses_policy.py "$@"
