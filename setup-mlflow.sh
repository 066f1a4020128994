#!/usr/bin/env bash
# Builds .venv-mlflow: the environment the MLflow tracking server runs from (`rlhf up` starts it when
# tracking.backends has mlflow and tracking.mlflow.uri is on 127.0.0.1/localhost). Full mlflow 3.17.2 asks
# for pyarrow < 26, below this project's pin, so the server never shares .venv; the project itself only
# needs the client, mlflow-skinny (the [tracking] extra). Idempotent; about a minute and 0.9 GB.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${RLHF_MLFLOW_VENV:-.venv-mlflow}
stamp="$VENV/.rlhf-mlflow-$(sha256sum setup-mlflow.sh | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --no-compile "mlflow==${RLHF_MLFLOW_VERSION:-3.17.2}"
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true   # as setup.sh
"$VENV/bin/python" -c "import mlflow; print('mlflow', mlflow.__version__, 'in', '$VENV')"
rm -f "$VENV"/.rlhf-mlflow-*
touch "$stamp"
