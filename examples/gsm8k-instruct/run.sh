#!/usr/bin/env bash
# Train Qwen2.5-0.5B-Instruct on GSM8K on one GPU (examples/gsm8k-instruct/README.md).
# With vLLM installed: the TRL backend, vLLM generating in the training process (colocate);
# without it: the native Lightning path (HF generate). Extra arguments are config overrides (-S key=value).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
config="$here/config.yaml"
if python -c "import vllm" 2>/dev/null; then
  exec composer-plugins backend run trl -c "$config" \
    --opt 'grpo_args={use_vllm: true, vllm_mode: colocate, vllm_gpu_memory_utilization: 0.3}' "$@"
else
  exec composer-plugins train -c "$config" "$@"
fi
