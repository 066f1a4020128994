#!/usr/bin/env bash
# The GPU benchmark for one H200 (the `device` tool), in one call, under 8 minutes, no network:
#   here, once:   bash bench/gpu/fetch_wheels.sh      (bitsandbytes and pydantic wheels into .whl/, ~46 MB)
#   device tool:  run(command="bash bench/gpu/run.sh", carry=[".whl"], timeout_s=540)
# The device image has torch, transformers, accelerate and peft but not bitsandbytes (8-bit AdamW) or
# pydantic (rlhf/core/config.py, for the estimator's prediction): they travel as wheels.
# Output: the table on stdout and gpu_steps.json / gpu_steps.md in $OUT (or bench/gpu/ elsewhere).
set -euo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
out=${OUT:-bench/gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 timeout 450 python3 bench/gpu/steps.py --shape qwen2.5-1.5b --out "$out/gpu_steps.json" 2>&1 \
  | tee "$out/gpu_steps.md"
