#!/usr/bin/env bash
# Wheels bench/gpu/run.sh installs on the device machine (Python 3.12, x86-64, no network there).
# .whl/ is git-ignored; the device tool takes it along with carry=[".whl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  bitsandbytes==0.50.2 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
