#!/usr/bin/env bash
# Install composer-plugins into ./.venv (Python 3.11) with torch pinned to the CPU wheel.
#   bash scripts/install.sh        # the project, all built-in features
#   bash scripts/install.sh dev    # + test/lint tools, the example plugins and the backend packages
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q -U pip setuptools wheel
# torch first, on its own, so nothing later can resolve a CUDA build.
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
if [ "${1:-}" = "dev" ]; then
  # editable, as the backends: the example plugins a plugin author copies follow their source without a reinstall
  extra_pkgs=(-e ./examples/composer-plugins-focal -e ./examples/composer-plugins-reverse)
  # the backend distributions hold the trl/verl/prime_rl/monarch adapters: editable, so edits need no reinstall
  for p in packages/*/; do [ -f "$p/pyproject.toml" ] && extra_pkgs+=(-e "./$p"); done
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[all,dev]" "${extra_pkgs[@]}"
else
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[all]"
fi
.venv/bin/python -m pip check  # a broken requirement fails the install
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
